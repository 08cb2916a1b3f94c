#!/usr/bin/env bash
# The GPU tier in one call: every test under tests/gpu, 8 processes by file, one kernel cache.
set -uo pipefail
out=${OUT:-lab-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 CKGEN_CACHE_DIR=$(mktemp -d)
export CKGEN_KERNEL_CACHE=$CKGEN_CACHE_DIR/kernels
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 520 python3 -m pytest -m gpu tests/gpu -n 8 --dist loadfile -q -p no:cacheprovider --maxfail=30 \
  -W ignore::DeprecationWarning > "$out/gpu_tier.log" 2>&1
echo "pytest rc=$?"
grep -E "passed|failed|error" "$out/gpu_tier.log" | tail -5
grep -E "^FAILED|^ERROR" "$out/gpu_tier.log" | head -30
