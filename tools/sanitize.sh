#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) over the GPU tests that launch every op
# family's configs (GroupNorm fwd/bwd config spreads, pooling), one log per tool under $OUT
# (default bench/results/logs). Needs a GPU and compute-sanitizer: on PATH, or from PyPI's
# nvidia-cuda-sanitizer-api wheel installed into $SITE (default /tmp/site; its 13.0 wheel lacks
# the TreeLauncher helpers and fails with "Target application terminated before first
# instrumented API call": use the 13.5 wheel, which carries compute-sanitizer/ whole).
# Usage: tools/sanitize.sh [SECONDS_PER_TOOL] [pytest node ids...]
set -uo pipefail
per=${1:-120}; shift || true
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(tests/gpu/test_groupnorm_fwd_gpu.py::test_configs_match_reference
                                  tests/gpu/test_groupnorm_bwd_gpu.py tests/gpu/test_pool_gpu.py)
out=${OUT:-bench/results/logs}
site=${SITE:-/tmp/site}
cs=$(command -v compute-sanitizer || true)
[ -z "$cs" ] && cs=$site/nvidia/cu13/compute-sanitizer/compute-sanitizer
[ -x "$cs" ] || chmod +x "$site"/nvidia/cu13/compute-sanitizer/* 2>/dev/null
py=$(readlink -f "$(command -v python3)")
"$cs" --version | head -2
rc=0
for tool in memcheck racecheck synccheck; do
  timeout "$per" "$cs" --tool "$tool" --target-processes all --error-exitcode 3 \
    "$py" -m pytest -m gpu -v -x -p no:cacheprovider "${tests[@]}" > "$out/sanitizer-$tool.log" 2>&1
  r=$?
  echo "$tool: exit $r ($(grep -c PASSED "$out/sanitizer-$tool.log") tests passed under it;" \
       "$(grep -m1 'ERROR SUMMARY' "$out/sanitizer-$tool.log" || echo 'no summary: cut by the time limit')"
  [ $r -ne 0 ] && [ $r -ne 124 ] && rc=$r
done
exit $rc
