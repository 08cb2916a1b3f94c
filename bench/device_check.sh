#!/usr/bin/env bash
# One call on a GPU machine: GPU test tier, the issue's CLI tune + dispatch check, benchmark.
# Logs go to $OUT (or ./device-out). Usage: bash bench/device_check.sh [bench tune trials]
set -uo pipefail
out=${OUT:-device-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 CKGEN_CACHE_DIR=${CKGEN_CACHE_DIR:-$(mktemp -d)}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
timeout 240 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -3
# the default problems (README's main command); the result is the DB shipped in ckgen/data/
COLUMNS=200 timeout 200 python3 -m ckgen.cli --db "$out/instances.yaml" tune groupnorm_fwd --trials 40 \
    --total-timeout 170 2>&1 | grep -v -i warn | tee "$out/tune_default_problems.log" | tail -18
timeout 120 python3 -m ckgen.cli tune groupnorm_fwd --shape 8,320,64,64 --groups 32 --dtype bf16 --layout nhwc \
    --trials 40 --timeout 90 2>&1 | tee "$out/cli_tune.log" | tail -8
python3 - <<'PY' 2>&1 | tee "$out/dispatch_after_tune.log"
import torch, ckgen
x = torch.randn(8, 320, 64, 64, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
c = ckgen.explain("groupnorm_fwd", x, None, None, 32)
print("next call uses:", c)
assert c.source == "tuned", c
PY
timeout 330 python3 bench/groupnorm_fwd.py --tune-trials "${1:-60}" --out "$out" 2>&1 | grep -v -i warn | tail -14
