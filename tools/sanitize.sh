#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) over the GPU tests that launch every op
# family's configs (GroupNorm fwd, GroupNorm bwd, pooling: their config-spread tests), one log
# per tool under $OUT (default bench/results/logs). Each (tool, family) pair gets its own time
# limit, so every family is covered even where a tool is too slow to finish all its configs; the
# summary line says how many tests passed under the tool and how many errors it reported.
# CKGEN_SANITIZE=1 turns CuPy's memory pool off (tests/conftest.py), so memcheck sees every
# buffer's real bounds. Needs a GPU and compute-sanitizer: on PATH, or from PyPI's
# nvidia-cuda-sanitizer-api wheel installed into $SITE (default /tmp/site; its 13.0 wheel lacks
# the TreeLauncher helpers and fails with "Target application terminated before first
# instrumented API call": use the 13.5 wheel, which carries compute-sanitizer/ whole).
# Usage: tools/sanitize.sh [SECONDS_PER_TOOL_AND_FAMILY] [-k EXPR]
set -uo pipefail
per=${1:-60}; shift || true
kexpr=()
[ $# -ge 2 ] && [ "$1" = -k ] && kexpr=(-k "$2")
families=(tests/gpu/test_groupnorm_fwd_gpu.py::test_configs_match_reference
          tests/gpu/test_groupnorm_bwd_gpu.py::test_configs_match_reference
          tests/gpu/test_pool_gpu.py::test_configs_match_reference)
out=${OUT:-bench/results/logs}
site=${SITE:-/tmp/site}
cs=$(command -v compute-sanitizer || true)
if [ -z "$cs" ]; then
  cs=$site/nvidia/cu13/compute-sanitizer/compute-sanitizer
  chmod +x "$site"/nvidia/cu13/compute-sanitizer/* "$site"/nvidia/cu13/bin/* 2>/dev/null
fi
py=$(command -v python3)  # not resolved: a venv python must keep its own path
export CKGEN_SANITIZE=1
rc=0
for tool in memcheck racecheck synccheck; do
  log=$out/sanitizer-$tool.log
  "$cs" --version | head -2 > "$log"
  for fam in "${families[@]}"; do
    echo "### $tool on $fam (limit ${per}s)" >> "$log"
    timeout "$per" "$cs" --tool "$tool" --target-processes all --error-exitcode 3 \
      "$py" -m pytest -m gpu -v -p no:cacheprovider "${kexpr[@]}" "$fam" >> "$log" 2>&1
    r=$?
    echo "### exit $r" >> "$log"
    [ $r -ne 0 ] && [ $r -ne 124 ] && rc=$r
  done
  echo "$tool: $(grep -c ' PASSED' "$log") tests passed, $(grep -c ' FAILED' "$log") failed;" \
       "sanitizer errors reported: $(grep -cE '^========= (Invalid|Race|Barrier|Error|Uninitialized|Program hit)' "$log");" \
       "summaries: $(grep 'ERROR SUMMARY' "$log" | tr '\n' ' ')"
done
exit $rc
