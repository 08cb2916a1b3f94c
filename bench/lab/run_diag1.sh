#!/usr/bin/env bash
# Lab run 1: structure probes + today's configs on the big suite shapes, then ncu on three kernels.
set -uo pipefail
out=${OUT:-lab-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 CKGEN_CACHE_DIR=$(mktemp -d)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 330 python3 bench/kernel_lab.py --plan bench/lab/diag1.yaml --out "$out" 2>&1 | tee "$out/lab.log" | grep -v "^\[" 
sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats"
for only in "hold_t512_i8_m2_red_128MB" "hold_t1024_i8_m1_red_128MB"; do
  timeout 60 ncu --clock-control none -k regex:hold -c 1 $sec python3 bench/kernel_lab.py --plan bench/lab/diag1.yaml --once --only "$only" > "$out/ncu_$only.txt" 2>&1
done
timeout 90 ncu --clock-control none -k regex:"ckgen_groupnorm_fwd_bf16_n" --launch-skip 3 -c 1 $sec python3 bench/kernel_lab.py --plan bench/lab/diag1.yaml --once --only "N=16,C=512,H=64,W=64,G=32,dtype=bf16,layout=nchw" > "$out/ncu_gn_nchw.txt" 2>&1
grep -E "DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued" "$out"/ncu_*.txt | head -60
