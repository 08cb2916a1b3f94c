#!/usr/bin/env bash
# Issue 11's broad sm_90 DB, tuned over several device runs: every op's grids in a fixed order
# (the "broad" grids first: the default problems in every dtype, layout and activation; then the
# model grids), each with `ckgen tune --skip-tuned`, so a run cut by its time budget goes on where
# the last one stopped. State (the tuned entries and the optuna study storage) lives in $STATE,
# which the next run must get back (carry it to the device, copy it home from $OUT).
#
#   STATE=scratch/dbtune bash bench/tune_db.sh SECONDS [TRIALS]   # default TRIALS 20
#   PLAN="groupnorm_fwd:broad maxpool2d_fwd:broad" TUNE_ARGS="--layout nhwc" ...  # another plan
#
# Every measured trial goes to $STATE/tuned.records.jsonl (the records file beside the DB in
# use, CKGEN_DB): the cost model's training data (tools/build_records.py reads the copies kept
# under bench/results/tuning/).
# Afterwards, on any machine: `ckgen db merge ckgen/data/instances.yaml $STATE/tuned.yaml -o
# ckgen/data/instances.yaml` (per problem and arch, the faster verified entry), keep the records
# gzipped under bench/results/tuning/ (`records.write_gz`), then `python tools/build_records.py`
# to refit the cost model on the new trials and `ckgen generate` for generated/.
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${1:?usage: STATE=DIR bench/tune_db.sh SECONDS [TRIALS]}
trials=${2:-20}
state=${STATE:?set STATE to a folder that the next run gets back}
mkdir -p "$state"
db=$state/tuned.yaml
storage=sqlite:///$(cd "$state" && pwd)/studies.sqlite3
export CKGEN_DB=$db  # the tuning records go beside it: $state/tuned.records.jsonl
ITEMS=(
  "groupnorm_fwd broad" "groupnorm_bwd broad" "maxpool2d_fwd broad" "maxpool2d_bwd broad"
  "avgpool2d_fwd broad" "avgpool2d_bwd broad" "groupnorm_bwd_data broad" "groupnorm_bwd_gamma_beta broad"
  "groupnorm_fwd sd-vae" "groupnorm_bwd sd-vae" "maxpool2d_fwd resnet" "maxpool2d_bwd resnet"
  "avgpool2d_fwd resnet" "groupnorm_fwd sd15-unet" "groupnorm_bwd sd15-unet" "maxpool2d_fwd vgg"
  "maxpool2d_bwd vgg" "groupnorm_fwd sdxl-unet" "groupnorm_bwd sdxl-unet" "groupnorm_fwd detection"
)
start=$(date +%s)
if [ -n "${PLAN:-}" ]; then ITEMS=(); for it in $PLAN; do ITEMS+=("${it/:/ }"); done; fi
for item in "${ITEMS[@]}"; do
  set -- $item
  left=$(( budget - ($(date +%s) - start) ))
  [ "$left" -lt 30 ] && { echo "time budget spent before $item"; break; }
  echo "=== $item (${left} s left)"
  python3 -m ckgen tune "$1" --grid "$2" --skip-tuned --trials "$trials" --total-timeout "$left" \
    --db "$db" --storage "$storage" --format tsv ${TUNE_ARGS:-}
  rc=$?  # 1: some problems not tuned (the time budget); 2 and up: no GPU, bad options, storage
  [ $rc -ge 2 ] && { echo "stopping: ckgen tune exited $rc"; break; }
done
python3 - "$db" <<'PY'
import collections, sys
from ckgen.runtime.db import InstanceDB
entries = InstanceDB.load(sys.argv[1]).entries
print(f"{sys.argv[1]}: {len(entries)} entries;", dict(collections.Counter(e.op for e in entries)))
PY
