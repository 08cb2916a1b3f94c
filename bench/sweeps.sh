#!/usr/bin/env bash
# Fresh exhaustive sweeps of today's spaces on one GPU (issue 17), written as test data into
# tests/data/sweeps/: GroupNorm fwd and bwd in both layouts at 3 shapes (small, SD-size, large),
# max/avg pooling fwd/bwd in both layouts at one shape. Every sweep is resumable: it writes its
# file after each chunk, so rerunning this script after an interruption (or a session limit)
# measures only what is missing; a finished sweep is skipped in seconds.
#
#   bash bench/sweeps.sh                # all of them, in order
#   ONLY=groupnorm_fwd bash bench/sweeps.sh   # the sweeps of one op
#   CHUNK=128 bash bench/sweeps.sh      # smaller chunks (default 256 configs)
#
# Then: python3 -m pytest -q -s tests/test_tune_replay.py (replays every complete sweep) and
# python3 bench/replay_search.py (the sampler comparison). The sweeps of the first format
# (sweep-nchw-16x512x64x64.json.gz, sweep-nhwc-8x320x64x64.json.gz: merge=cluster only) can be
# deleted once the groupnorm_fwd ones here are complete.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=tests/data/sweeps
CHUNK=${CHUNK:-256}
GN="G=32,dtype=bf16"
POOL="k=3x3,s=2x2,p=1x1,d=1x1,ceil=0,dtype=bf16"
SWEEPS=()
for op in groupnorm_fwd groupnorm_bwd; do
  for layout in nchw nhwc; do
    SWEEPS+=("$op N=2,C=320,H=32,W=32,$GN,layout=$layout,act=none")      # small
    SWEEPS+=("$op N=2,C=320,H=64,W=64,$GN,layout=$layout,act=none")      # SD UNet 64x64 latent
    SWEEPS+=("$op N=1,C=256,H=256,W=256,$GN,layout=$layout,act=none")    # large (SD VAE decoder)
  done
done
for layout in nchw nhwc; do
  SWEEPS+=("maxpool2d_fwd N=64,C=64,H=112,W=112,$POOL,layout=$layout,idx=0")
  SWEEPS+=("maxpool2d_bwd N=64,C=64,H=112,W=112,$POOL,layout=$layout,indices=stored")
  SWEEPS+=("avgpool2d_fwd N=64,C=64,H=112,W=112,$POOL,layout=$layout,cip=1,div=0")
  SWEEPS+=("avgpool2d_bwd N=64,C=64,H=112,W=112,$POOL,layout=$layout,cip=1,div=0")
done
for s in "${SWEEPS[@]}"; do
  op=${s%% *}; key=${s#* }
  [[ -n "${ONLY:-}" && "$op" != "$ONLY" ]] && continue
  echo "== $op $key"
  python3 bench/sweep.py --op "$op" --key "$key" --out "$OUT" --chunk "$CHUNK"
done
