"""The GroupNorm kernels' limits: what the templates can hold (shared memory, cluster sizes) and
what keeps their sums accurate. The op specs' `validate` and their array forms (gn_vector.py)
read them from here."""
from __future__ import annotations

# slice_in=reload sums each thread's values into fp32 accumulators one after another (NHWC: one
# per channel, one add per pixel row it walks; NCHW: one per thread). Past a few thousand adds
# the rounding of that running sum shows in the mean: on the recorded sweep of 1x256x256x256 bf16
# NHWC the configs with 32,768 and 65,536 serial adds gave a mean 1.18x and 2.27x over its
# tolerance (1e-4 + 1e-5|mean|); the float32 emulation (tests/test_groupnorm_accuracy.py) gives
# 0.67x at 16,384 and 0.23x at 8,192. So no config makes a thread add more than this.
MAX_SERIAL_ADDS = 8192

MAX_TILE_CHANNELS = 2048  # per-channel sums of a tile live in shared memory (2 x 4 bytes each)
NCHW_STEP_VECTORS = 4096  # NCHW single_pass: per-vector partials in shared memory (2 x 16 KB)
# single_pass/fused: the last block of a channel tile folds dgamma/dbeta itself when the tile's
# fold, N*split rows x its channels, is at most this; past it one block's fold costs more than
# the _dgb kernel's launch (bench/results/logs/gnbwd-dgb-last-*/)
DGB_LAST_MAX = 512
CLUSTER_MAX = 8  # single_pass/fused: split <= 8 is a portable cluster; past it, a grid-wide barrier
STAGED = ("multi_stage", "pipelined")  # the schemes of a sums kernel, then a dx kernel

#: slice_in=lean, NCHW: the most channels per group its per-channel table in shared memory holds
LEAN_MAX_CG = 1024
