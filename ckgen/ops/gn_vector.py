"""The GroupNorm ops' checks and launch geometry on arrays of knob values: `shape_check` for the
candidate walk (`shape_check_many`) and what the cost model asks of an op per config
(launch count, grid, registers, workspace, `chain_steps` and the other `model_*` hooks;
`geometry_columns`). An unseen
problem's pick checks thousands of walk nodes and predicts hundreds of candidates; per config in
Python these were most of its time. Each array form computes the scalar form's integers with the
same expressions (tests/test_gn_vector.py compares them on random problems and configs). Knob
arrays are int64 (ints) or unicode (strings); the problem's sizes are bounded by
`fits_int64` so that no product overflows."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..types import DTYPES, INT32_MAX, Target, coresident_sms
from .gn_limits import (CLUSTER_MAX, DGB_LAST_MAX, LEAN_MAX_CG, MAX_SERIAL_ADDS, MAX_TILE_CHANNELS,
                        NCHW_STEP_VECTORS, STAGED)

if TYPE_CHECKING:
    from .groupnorm import GroupNormProblem

Cols = Mapping[str, np.ndarray]


def fits_int64(p: GroupNormProblem) -> bool:
    """The problem's sizes leave every product the array forms make within int64 (a slice of
    C/G x H*W elements, a grid or a workspace of N x C x split x 8 bytes): all but absurd problems."""
    return p.C * max(p.HW, 1) < 1 << 53 and p.N * p.C < 1 << 40


def _cdiv(a: Any, b: Any) -> Any:
    return -(-a // b)


def nhwc_tile_many(ch: Any, vec: np.ndarray, threads: np.ndarray, split: np.ndarray, hw: int,
                   max_ch: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`groupnorm.nhwc_tile` per element: (verdict, R, pixels per block), R and the pixels 0
    where the verdict is no (as the scalar form returns them)."""
    ok = ch % vec == 0
    if max_ch is not None:
        ok = ok & (ch <= max_ch)
    cols = np.maximum(ch // vec, 1)
    ok &= cols <= threads
    rows = threads // cols
    ok &= rows * cols * 4 >= threads * 3
    share = _cdiv(hw, split)
    ok &= ~((split > 1) & (share < rows))
    return ok, np.where(ok, rows, 0), np.where(ok, share, 0)


def _grid_fits(blocks: np.ndarray, min_blocks: np.ndarray, target: Target) -> np.ndarray:
    """`groupnorm.grid_barrier_fits` per element."""
    if target.vendor != "cuda":
        return np.zeros(len(blocks), dtype=bool)
    return blocks <= coresident_sms(target) * min_blocks


# ------------------------------------------------------------------------------------ forward
def lean_regs(p: "GroupNormProblem", packed: Any, vec: Any) -> Any:
    """slice_in=lean's registers per thread (ints or arrays of them), fitted to NVRTC's counts
    for sm_90 so that a config over the budget is one that spills: x held packed (and the
    residual's vectors while y is written); NHWC where every vector lies inside one group (C/G a
    multiple of it) a scale and shift per channel, elsewhere per-channel sums and shifts too."""
    base = packed * (2 if p.residual else 1)
    if p.layout == "nchw":
        return base + 32
    one_group = p.Cg % np.maximum(vec, 1) == 0
    return base + np.where(one_group, 2 * vec + 20 + (vec if p.bias_nc else 0), 3 * vec + 24)


def _fwd_split(k: Cols) -> np.ndarray:
    return np.where(k["merge"] == "cluster", k["cluster"], k["global_split"])


def _fwd_rows(k: Cols) -> np.ndarray:
    return (k["slice_in"] == "rows") | (k["merge"] == "grid")  # groupnorm.whole_rows


def fwd_shape_check_many(p: GroupNormProblem, k: Cols, target: Target) -> np.ndarray:
    """`GroupNormFwd.shape_check` per element, for knob values `class_check` admits (a whole
    number of elements per vector)."""
    item = DTYPES[p.dtype]["itemsize"]
    threads, items, gpb, slice_in = k["threads"], k["items"], k["groups_per_block"], k["slice_in"]
    split = _fwd_split(k)
    vec = np.maximum(k["vec_bytes"] // item, 1)
    regs, reload = (slice_in == "regs") | (slice_in == "lean"), slice_in == "reload"
    rows_mode = _fwd_rows(k)
    ok = p.Cg * p.HW // vec <= INT32_MAX
    # whole NHWC pixel rows (`_validate_rows`)
    t_ok, rows, share = nhwc_tile_many(p.C, vec, threads, split, p.HW, 2048)
    serial = _cdiv(share, np.maximum(rows, 1))
    r_ok = t_ok & ~(regs & (serial > items)) & (serial <= MAX_SERIAL_ADDS) & (p.N * split <= INT32_MAX)
    r_ok &= (k["merge"] != "grid") | _grid_fits(p.N * split, k["min_blocks"], target)
    if p.layout == "nchw":
        share = _cdiv(p.Cg * p.HW // vec, split)
        s_ok = ~(regs & (share > threads * items))
        s_ok &= ~(reload & (_cdiv(share, threads) * vec > MAX_SERIAL_ADDS))
        s_ok &= ~((split > 1) & (share < threads // 4))
    else:
        s_ok = p.G % gpb == 0
        t_ok, rows, share = nhwc_tile_many(gpb * p.Cg, vec, threads, split, p.HW, 2048)
        serial = _cdiv(share, np.maximum(rows, 1))
        s_ok = s_ok & t_ok & ~(regs & (share > rows * items)) & ~(reload & (serial > MAX_SERIAL_ADDS))
    s_ok &= p.N * (p.G // gpb) * split <= INT32_MAX
    # slice_in=lean: its register budget and NCHW channel table (`GroupNormFwd.shape_check`)
    lean = slice_in == "lean"
    packed = items * vec * item // 4
    budget = np.minimum(255, 65536 // (threads * k["min_blocks"]))
    s_ok &= ~lean | ((lean_regs(p, packed, vec) <= budget) & (p.layout != "nchw" or p.Cg <= LEAN_MAX_CG))
    return ok & np.where(rows_mode, r_ok, s_ok)


def _run_bytes(p: GroupNormProblem, tile: np.ndarray, split: np.ndarray) -> np.ndarray:
    """`groupnorm.gn_run_bytes` per element."""
    item = DTYPES[p.dtype]["itemsize"]
    if p.layout == "nchw":
        return np.maximum(1, p.C // p.G * p.H * p.W // split) * item
    return np.where(tile < p.C, tile * item, np.maximum(1, p.H * p.W // split) * p.C * item)


def _x_bytes(p: GroupNormProblem) -> int:
    return p.N * p.C * p.H * p.W * DTYPES[p.dtype]["itemsize"]


def fwd_geometry_columns(op: Any, p: GroupNormProblem, k: Cols, target: Target,
                         narrow_rows: bool = True) -> dict[str, np.ndarray]:
    """What the cost model asks the forward op per config (`OpSpec.geometry_columns`), per
    element: launches, the main launch's blocks and threads, registers, workspace bytes, chain
    steps, the unroll, and the `model_*` hooks' values (vector bytes, run, re-read bytes, split,
    slices per block)."""
    item = DTYPES[p.dtype]["itemsize"]
    threads, items, gpb, merge = k["threads"], k["items"], k["groups_per_block"], k["merge"]
    split = _fwd_split(k)
    rows_mode = _fwd_rows(k)
    vec = np.maximum(k["vec_bytes"] // item, 1)
    blocks = np.where(rows_mode, p.N * split, p.N * (p.G // gpb) * split)
    # groupnorm.fwd_regs_needed (vec there is vec_bytes // itemsize: 0 where it does not divide)
    v0 = k["vec_bytes"] // item
    packed = items * v0 * item // 4
    held = (k["slice_in"] == "regs") | (k["slice_in"] == "lean")
    regs = np.where(held, packed,
                    np.where(k["slice_in"] == "rows", 2 * packed, items * v0 // 2)) + 32
    if p.layout == "nhwc":
        regs = regs + 3 * v0
    regs = np.maximum(np.where(k["slice_in"] == "lean", lean_regs(p, packed, v0), regs), 32)  # features._regs
    partials = blocks * np.where(rows_mode, p.G, gpb) * np.where(rows_mode, 2, 3) * 4
    ws = np.where(merge == "cluster", 0, partials + np.where(merge == "grid", 4 * p.N, 0))
    if p.layout == "nchw":
        per_step, share = threads * items, _cdiv(p.Cg * p.HW // vec, split)
    else:
        ch = np.where(rows_mode, p.C, gpb * p.Cg)
        _, rows, share = nhwc_tile_many(ch, vec, threads, split, p.HW)
        per_step = rows * items
    steps = np.where(held, 1, 2 * _cdiv(share, np.maximum(1, per_step)))
    tile = np.where(rows_mode, p.C, gpb * p.C // p.G)
    reread = np.where((k["slice_in"] == "reload") | (k["slice_in"] == "rows"), _x_bytes(p), 0)
    return {"launches": np.where(merge == "global", 2, 1), "blocks": blocks, "threads": threads,
            "regs": regs, "ws": ws, "steps": steps, "unroll": items, "vec_bytes": k["vec_bytes"],
            "run": _run_bytes(p, tile, split), "reread": reread, "split": split,
            "slices": np.where(rows_mode, p.G, gpb) if p.layout == "nhwc" else 1}


# ----------------------------------------------------------------------------------- backward
def _bwd_scheme(op: Any, k: Cols) -> np.ndarray:
    return k["scheme"] if op.want_dx else np.full(len(k["split"]), "multi_stage")


def _grid_merged(scheme: np.ndarray, split: np.ndarray) -> np.ndarray:
    return ((scheme == "single_pass") | (scheme == "fused")) & (split > CLUSTER_MAX)


def bwd_shape_check_many(op: Any, p: GroupNormProblem, k: Cols, target: Target) -> np.ndarray:
    """`_GroupNormBwd.shape_check` per element, for knob values `class_check` admits."""
    item = DTYPES[p.dtype]["itemsize"]
    threads, items, gpb, split = k["threads"], k["items"], k["groups_per_block"], k["split"]
    scheme = _bwd_scheme(op, k)
    single = scheme == "single_pass"
    vec = np.maximum(k["vec_bytes"] // item, 1)
    ch = gpb * p.Cg
    ok = (p.Cg * p.HW // vec <= INT32_MAX) & (ch <= MAX_TILE_CHANNELS)
    if p.layout == "nchw":
        ok &= ~(single & (threads * items > NCHW_STEP_VECTORS))
        share = _cdiv(p.Cg * p.HW // vec, split)
        ok &= ~(single & (share > threads * items))
        ok &= ~((split > 1) & (share < threads // 4))
    else:
        ok &= p.G % gpb == 0
        t_ok, rows, share = nhwc_tile_many(ch, vec, threads, split, p.HW)
        ok &= t_ok & ~(single & (share > rows * items))
    blocks = p.N * (p.G // gpb) * split
    ok &= (blocks <= INT32_MAX) & (p.N * split * p.C * 2 <= INT32_MAX)
    merged = _grid_merged(scheme, split)
    return ok & (~merged | _grid_fits(blocks, k["min_blocks"], target))


def _pow2_at_least(n: np.ndarray) -> np.ndarray:
    """`groupnorm_bwd.pow2_at_least` per element: frexp's exponent of n - 1 > 0 is its bit length."""
    return np.left_shift(1, np.frexp(np.maximum(n - 1, 0).astype(np.float64))[1].astype(np.int64))


def bwd_geometry_columns(op: Any, p: GroupNormProblem, k: Cols, target: Target,
                         narrow_rows: bool = True) -> dict[str, np.ndarray]:
    """`fwd_geometry_columns` for the backward ops."""
    item = DTYPES[p.dtype]["itemsize"]
    threads, items, gpb, split = k["threads"], k["items"], k["groups_per_block"], k["split"]
    want_dx, want_dgb = op.want_dx, op.want_dgb
    scheme = _bwd_scheme(op, k)
    single, fused, pipelined = scheme == "single_pass", scheme == "fused", scheme == "pipelined"
    staged = (scheme == STAGED[0]) | (scheme == STAGED[1])
    merged = _grid_merged(scheme, split)
    blocks = p.N * (p.G // gpb) * split
    dgb_in_dx = pipelined if want_dx and want_dgb else np.zeros(len(split), dtype=bool)
    dgb_last = ((single | fused) & ~merged) if want_dx and want_dgb else np.zeros(len(split), dtype=bool)
    ticket = dgb_last & (p.N * split * gpb * p.Cg <= DGB_LAST_MAX)
    launches = staged.astype(np.int64) + (1 if want_dx else 0)
    if want_dgb:
        launches = launches + (~dgb_in_dx & ~ticket & ~merged)
    # bwd_regs_needed
    v0 = k["vec_bytes"] // item
    packed = 2 * items * v0 * item // 4
    two_steps = (pipelined | merged) if p.layout == "nhwc" else np.zeros(len(split), dtype=bool)
    regs = np.where(single, packed + 40, np.where(two_steps, 2 * packed + 40, 2 * items * v0 + 40))
    if p.layout == "nhwc":
        regs = regs + 7 * v0
    # workspace_bytes: partial rows, A/B partials, zeroed counters
    ab = np.where(staged | merged, blocks * gpb * 2, 0) if want_dx else 0
    partial = (p.N * split * p.C * 2 if want_dgb else 0) + ab
    zeroed = np.where(merged, 4, np.where(dgb_last, 4 * (p.G // gpb), 0))
    ws = partial * 4 + zeroed
    # chain_steps
    vec = np.maximum(v0, 1)
    passes = 2 if want_dx else 1
    if p.layout == "nhwc":
        _, rows, share = nhwc_tile_many(gpb * p.Cg, vec, threads, split, p.HW)
        steps = passes * _cdiv(share, np.maximum(1, rows * items))
    else:
        hv = np.maximum(1, p.HW // vec)
        share = _cdiv(p.Cg * hv, split)
        dx = _cdiv(share, threads * items) if want_dx else 0
        if narrow_rows:
            cc = np.where(hv >= threads * items, threads, _pow2_at_least(_cdiv(hv, items)))
        else:
            cc = np.where(hv >= threads, threads, _pow2_at_least(hv))
        cc = np.minimum(cc, threads)
        chans = np.minimum(p.Cg, _cdiv(share, hv) + (share % hv != 0))
        rounds = _cdiv(chans, threads // cc)
        steps = rounds * _cdiv(np.minimum(hv, share), cc * items) + dx
    steps = np.where(single, 1, steps)
    unroll = items
    if p.layout == "nhwc" and "scheme" in k:  # geometry reads the knob itself (None without one)
        raw = k["scheme"]
        unroll = np.where((raw == "pipelined") | ((raw == "fused") & merged), 2 * items, items)
    reread = np.where(scheme != "single_pass", 2 * _x_bytes(p), 0) if want_dx else 0
    return {"launches": launches, "blocks": blocks, "threads": threads, "regs": regs, "ws": ws,
            "steps": steps, "unroll": unroll, "vec_bytes": k["vec_bytes"],
            "run": _run_bytes(p, gpb * p.C // p.G, split), "reread": reread, "split": split,
            "slices": gpb if p.layout == "nhwc" else 1}
