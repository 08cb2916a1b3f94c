#!/usr/bin/env bash
# Lab run 3: lean NHWC with whole groups per vector (scalar sums) and 16 vectors per thread; ncu of
# a lean NHWC config and of the shipped whole-row kernel on 16x512x64x64 bf16.
set -uo pipefail
out=${OUT:-lab-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 CKGEN_CACHE_DIR=$(mktemp -d)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 400 python3 bench/kernel_lab.py --plan bench/lab/lean2.yaml --out "$out" > "$out/lab.log" 2>&1
echo "lab rc=$?"
grep -v "^\[" "$out/lab.log" | grep -v -i "warn" | tail -40
grep -c "wrong result\|launch error\|compile error" "$out/lab.log"
sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy"
timeout 60 ncu --clock-control none -k regex:ckgen_groupnorm --launch-skip 2 -c 1 $sec python3 bench/kernel_lab.py --plan bench/lab/lean2_ncu_a.yaml --once > "$out/ncu_lean.txt" 2>&1
timeout 60 ncu --clock-control none -k regex:ckgen_groupnorm --launch-skip 4 -c 1 $sec python3 bench/kernel_lab.py --plan bench/lab/lean2_ncu_b.yaml --once > "$out/ncu_rows.txt" 2>&1
grep -E "^  [a-z_]+|DRAM Throughput|Duration|Compute \(SM\)|L2 Hit|Mem Busy|Max Bandwidth|Achieved Occ|Warp Cycles Per Issued" "$out"/ncu_*.txt | head -40
