#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) over every op family's configs:
# tools/sanitize_ops.py runs each of the 8 ops x dtypes x layouts (x swish, x pooling geometries,
# x max-pool index modes) with the space's default and seeded random valid configs, round-robin,
# so a tool cut by its time limit has still covered every family. Instances are compiled first,
# outside the sanitizer (--prepare). One log per tool under $OUT (default bench/results/logs);
# the summary says how many checks ran under the tool, how many failed, and how many sanitizer
# errors it reported. CKGEN_SANITIZE=1 turns CuPy's memory pool off in sanitize_ops.py, so
# memcheck sees every buffer's real bounds. Needs a GPU and compute-sanitizer: on PATH, or PyPI's
# nvidia-cuda-sanitizer-api wheel installed into $SITE (default /tmp/site; tested with 13.5.25, which
# carries compute-sanitizer/ whole).
# Usage: tools/sanitize.sh [SECONDS_PER_TOOL] [CONFIGS_PER_FAMILY]
set -uo pipefail
per=${1:-120}
n=${2:-6}
out=${OUT:-bench/results/logs}
site=${SITE:-/tmp/site}
cs=$(command -v compute-sanitizer || true)
if [ -z "$cs" ]; then
  cs=$site/nvidia/cu13/compute-sanitizer/compute-sanitizer
  chmod +x "$site"/nvidia/cu13/compute-sanitizer/* "$site"/nvidia/cu13/bin/* 2>/dev/null
fi
py=$(command -v python3)  # not resolved: a venv python must keep its own path
here=$(cd "$(dirname "$0")" && pwd)
plan=$(mktemp /tmp/ckgen-sanitize-plan.XXXXXX)
"$py" "$here/sanitize_ops.py" --prepare --configs "$n" --plan "$plan" || exit 1
export CKGEN_SANITIZE=1
rc=0
for tool in memcheck racecheck synccheck; do
  log=$out/sanitizer-$tool.log
  "$cs" --version | head -2 > "$log"
  timeout "$per" "$cs" --tool "$tool" --target-processes all --error-exitcode 3 \
    "$py" "$here/sanitize_ops.py" --configs "$n" --plan "$plan" >> "$log" 2>&1
  r=$?
  echo "### exit $r$([ $r -eq 124 ] && echo ' (cut by the time limit)')" >> "$log"
  [ $r -ne 0 ] && [ $r -ne 124 ] && rc=$r
  echo "$tool: $(grep -c '] round .* ok ' "$log") checks ran under it, $(grep -c '] round .* FAIL ' "$log") failed," \
       "$(grep -c 'done: ' "$log") rounds complete of $n;" \
       "sanitizer errors reported: $(grep -cE '^========= (Invalid|Race|Barrier|Error|Uninitialized|Program hit|Misaligned|Address)' "$log");" \
       "$(grep 'ERROR SUMMARY' "$log" | tr '\n' ' ')"
done
rm -f "$plan"
exit $rc
