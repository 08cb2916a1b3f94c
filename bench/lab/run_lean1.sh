#!/usr/bin/env bash
# Lab run 2: every valid slice_in=lean config of the forward suite's problems against the shipped
# DB's config, the fusion menu's correctness on ragged shapes, fused problems against torch.compile.
set -uo pipefail
out=${OUT:-lab-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 CKGEN_CACHE_DIR=$(mktemp -d)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 540 python3 bench/kernel_lab.py --plan bench/lab/lean1.yaml --out "$out" > "$out/lab.log" 2>&1
echo "rc=$?"
grep -v "^\[" "$out/lab.log" | grep -v -i "warn" | tail -80
grep -c "wrong result\|launch error\|compile error" "$out/lab.log"
grep "wrong result\|launch error\|compile error" "$out/lab.log" | head -8
