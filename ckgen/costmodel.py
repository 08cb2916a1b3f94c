"""The config cost model: what the dispatcher asks for a problem no DB entry covers, and where
the tuner takes its first seeds from.

**Why an analytical model with fitted terms, not a learner.** The training records
(ckgen/records.py) are thin: two exhaustive sweeps (GroupNorm forward, bf16, one NCHW and one
NHWC shape: 3,196 timings), 20-trial tuning runs of 139 grid problems (most of them GroupNorm
forward), and about two timings per problem (winner and default) for the rest. A
gradient-boosted or ranking model fit on that learns the two swept problems and has little to
generalise with across shapes (`bench/costmodel_loo.py` measures it). So the model's *form*
is physics: time = a launch floor (the call's first launch, less for each further one) + the
bytes the op must move / bandwidth,
scaled by exp(w . phi), where phi are deficits that make a memory-bound
kernel slower than its roofline (bytes in flight below what the GPU needs to hide latency,
SMs left idle, the last wave's tail, narrow vectors, re-reads, splits, ...). Only the weights
w (ridge regression pulled toward physical priors, so a term the data says nothing about stays
at its prior), one intercept per op, the per-launch floor and the bytes-in-flight knee are
fitted, on within-problem differences (a ranking, not absolute times across problems). It is
numpy only and deterministic.

**The measured correction.** Where the records time a config on problems near the one asked
about, they say how far off the roofline is for that config there; the prediction takes that
over: its log GPU time moves by the weighted mean of the config's within-problem log residuals
on the other recorded problems of the op (weights exp(-related_distance / CORR_TAU), shrunk
toward 0 by CORR_PRIOR of pseudo-weight; the problem itself never counts). It corrects
systematic errors of the form (a config the roofline flatters on small slices, say) from what the
tuner measured next door. `fit` stores the residual table in the model file (most of its ~500
kB). Leave-one-problem-out over the records (`bench/costmodel_loo.py --all`: 263 problems) it
takes the pick from 1.146x the best timed to 1.074x (tau 1, prior 0.2, chosen there); on the
held-out shapes (`bench/heldout.py`), which sit farther from every recorded problem, it changed
little (1.27x -> 1.26x their own tuned best, bench/results/heldout/runs/README.md).

**A tuned sibling wins ties** (`dispatch_pick`): the winner of the same shape tuned in another
dtype or activation (op.distance <= NEAREST_DISTANCE) is kept unless the model's pick is
predicted NEAREST_MARGIN faster (bench/costmodel_incumbent_loo.py: 1.064x -> 1.047x over the
records, the sweeps 1.24x -> 1.10x; held out: 1.24x).

**Host time.** A call costs the host a fixed part, ~4 us per kernel launch (cuLaunchKernel)
and ~3 us per output allocation (measured: bench/results/host_overhead-*.json). Back to back,
a call takes max(GPU time, host time), so for tiny problems fewer launches win; candidates are
ranked by that, then by GPU time.

**Candidates, in two tiers.** The near tier: every config that won anywhere (the model file's
per-problem best configs from the records, and the DB entries of the op) and the space's valid
configs one knob step away from them (a step further while fewer than MIN_CANDIDATES). The wide
tier: the configs up to MAX_STEPS knob steps away (MAX_CANDIDATES in all). A wide-tier config is
taken only when its predicted time per call beats the near tier's best by WIDE_MARGIN: winners
of other problems often lie 2-3 steps from a problem's best, but among hundreds of untimed
configs the most optimistic prediction is the likeliest to be wrong (`bench/costmodel_loo.py`).
Each candidate is checked with `op.validate` (and the caller's usability test: pointer
alignment), so the model never picks an invalid config.

**Loading.** `load()`: $CKGEN_MODEL (a path; "off" disables the model), else a model fitted by
the user beside the user DB (`python -m ckgen.costmodel fit`), else the packaged
ckgen/data/costmodel.json. A missing or corrupt file gives one warning and no model: the
dispatcher then serves the nearest tuned problem's winner, as before. Nothing here imports CuPy."""
from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from .ops import get_op
from .ops.groupnorm import fwd_regs_needed, nhwc_tile, whole_rows
from .ops.groupnorm_bwd import bwd_regs_needed
from .ops.spec import DTYPES, Config, OpSpec, Problem, Target
from .target import DEFAULT_SMS, NUM_SMS  # SMs per arch where no device is at hand

FORMAT = "ckgen-costmodel"
VERSION = 1
from .settings import ENV_MODEL  # noqa: E402 - one place for every environment setting
MAX_CANDIDATES = 512
MIN_CANDIDATES = 24  # near tier: fewer usable within one knob step of the winners: look a step further
MAX_STEPS = 3  # wide tier: up to this many knob steps from the winners
# A wide-tier candidate must be predicted this much faster than the near tier's best (x 1/(1+M)):
# chosen on the exhaustive sweeps held out (bench/costmodel_loo.py --margins): 0.1-0.2 never
# made a sweep's pick worse, 0.05 or none did (NHWC 1.30x -> 1.70x); 0.15 the middle.
WIDE_MARGIN = 0.15
# The dispatcher keeps the winner of a tuned sibling (same arch, op.distance <= NEAREST_DISTANCE:
# the same shape in another dtype (2.0) or activation (0.5)) unless the model's pick is predicted
# NEAREST_MARGIN faster (x 1/(1+M)); None: the model's pick always. Chosen by leave-one-problem-out
# over the records (docs/architecture.md): farther tuned problems' winners are poor picks (the
# held-out shapes, bench/results/heldout/runs/README.md: model-off).
NEAREST_MARGIN: float | None = 0.3
NEAREST_DISTANCE = 2.0
# `choose`'s compiled check (the dispatcher's spill test, `library.spill_free`) looks at most this
# far down the ranking; each look is one NVRTC compile (~0.3 s) on the first call of a problem.
ACCEPT_TRIES = 8
WINNERS_PER_PROBLEM = 2  # best distinct configs of each recorded problem kept as "winners"
KEEP_WS_BYTES = 4 << 20  # dispatch keeps a workspace up to this size per stream (no per-call alloc)


# Host time of one call (bench/host_overhead.py, torch inputs): cuLaunchKernel's floor per
# launch (4.06 us), an output allocation, and the rest of a call; within 3 us of the 10 measured
# ops' 9.5-26 us except groupnorm_bwd_gamma_beta (26).
HOST = {"call_us": 4.0, "launch_us": 4.06, "alloc_us": 3.0}

# The phi terms, their physical priors (the ridge pulls toward these) and meaning.
TERMS: tuple[tuple[str, float, str], ...] = (
    ("par", 0.8, "log of bytes in flight needed / in flight (0 when enough): Little's law"),
    ("cov", 0.5, "log of SMs / SMs with a block (0 when every SM has one)"),
    ("tail", 0.7, "log of the last wave's waste: ceil(waves) / waves"),
    ("vec_nchw", 0.15, "log2(16 / vector bytes), NCHW"),
    ("vec_nhwc", 0.05, "log2(16 / vector bytes), NHWC"),
    ("sector", 0.7, "log of DRAM bytes fetched / used for the contiguous run a block reads (32-byte sectors)"),
    ("reread", 0.5, "log(1 + bytes read again / bytes the op must move)"),
    ("split", 0.02, "log2 of blocks sharing one slice (cluster or workspace merge)"),
    ("scatter", 0.3, "pooling backward by scatter (zeroing + atomics)"),
    ("small_work", 0.1, "log(256 / bytes per thread), when fewer"),
    ("big_work", 0.1, "log(bytes per thread / 64 KiB), when more"),
    ("threads", 0.0, "log2(threads / 256)"),
    ("unroll", 0.0, "log2(vectors or positions per thread)"),
    ("min_blocks", 0.0, "log2(min blocks per SM)"),
    ("gpb", 0.0, "log2(groups per block), GroupNorm NHWC"),
    ("chain", 0.5, "GroupNorm: log of the serial load round trips' time (chain_steps x waves x CHAIN_US) / roofline, when more"),
)
TERM_NAMES = tuple(t[0] for t in TERMS)
PRIOR = np.array([t[1] for t in TERMS])
BW_BYTES_PER_US = 3.0e6  # the roofline's bandwidth (an HBM3 part's ~3.35 TB/s peak); intercepts absorb the rest
FLOOR_GRID = (1.5, 2.5, 3.5, 4.5, 6.0)  # us for a call's first launch on the GPU (launch latency + ramp)
# each further launch of the same call, as a fraction of the first: it is queued behind the first
# one, so it pays its ramp but not the launch latency (a multi-stage GroupNorm backward, a split
# forward's merge; 1.0: every launch costs the same)
FLOOR_NEXT_GRID = (0.25, 0.5, 1.0)
# max pool backward with the argmax recomputed: x re-read under the covering outputs' windows as
# a "reread" term (geometry); False: no such term (compared in bench/costmodel_kfold.py)
RECOMPUTE_REREAD = True
NEED_GRID = (0.25e6, 0.5e6, 1e6, 2e6, 4e6, 8e6)  # bytes in flight the GPU needs to hide memory latency
RIDGE = 40.0
# The chain term (GroupNorm): a block's serial load round trips (`chain_steps`) x its waves x
# CHAIN_US bound the time from below however few bytes move (HBM latency ~0.6-0.8 us,
# plus the reduction that follows a step). "max": log(max(1, chain / roofline)); "sum":
# log(1 + chain / roofline); None: no term (compared in bench/costmodel_kfold.py)
CHAIN: str | None = "max"
CHAIN_US = 1.0
# Records of kernel version 2 on (records.KERNEL_VERSION) ran the NCHW backward's narrower rows;
# the fit counts older ones' chain with the rule they ran. Predictions count today's
# (PREDICT_NARROW_ROWS; the k-fold study turns it off to score picks against the old records' times).
NARROW_ROWS_FROM_KERNEL_VERSION = 2
PREDICT_NARROW_ROWS = True
# The measured correction: a config's prediction is corrected by how far off the model was for
# that config on recorded problems near this one (its within-problem log residual), weighted by
# exp(-related_distance / CORR_TAU) and shrunk toward 0 by CORR_PRIOR of pseudo-weight. 0: off.
CORR_TAU = 1.0
CORR_PRIOR = 0.2


# What a model file may hold (`CostModel.from_doc`): every prediction is then a finite time. The
# packaged model is far inside: weights and intercepts within 1.1, residuals within 1.8.
MAX_WEIGHT = 10.0
MAX_US = 1e4  # host times per call and launch floors
MAX_NEED_BYTES = 1e12
MAX_RESIDUAL = 20.0
MAX_CORRECTION = 1e6


class ModelError(ValueError):
    """A model file that cannot be used (the message says why)."""


class ModelWarning(UserWarning):
    """The cost model is unavailable (missing or corrupt file); the dispatcher uses nearest-tuned."""


# ---------------------------------------------------------------------------------- features


def num_sms(arch: str) -> int:
    return NUM_SMS.get(arch, DEFAULT_SMS)


def _main_launch(op: OpSpec, p: Problem, c: Config, launches: Sequence[Any]) -> Any:
    """The launch that does the op's work: the one named as the instance, else its stats kernel."""
    name = op.instance_name(p, c)
    by_name = {l.kernel: l for l in launches}
    return by_name.get(name) or by_name.get(f"{name}_stats") or launches[0]


@dataclass(frozen=True)
class Geometry:
    """What the model sees of one (problem, config): everything but the fitted constants."""

    launches: int
    allocs: int  # per-call allocations: outputs, and a workspace too large to keep
    log_roof: float  # log(us) of the bytes the op must move at BW_BYTES_PER_US
    log_inflight: float  # log(bytes in flight over the GPU)
    phi: tuple[float, ...]  # the TERMS but "par" (which needs the fitted knee): par slot is 0


def geometry(op: OpSpec, p: Problem, c: Config, target: Target, sms: int | None = None,
             narrow_rows: bool | None = None) -> Geometry:
    """`narrow_rows`: the NCHW backward rule `chain_steps` counts with (None: PREDICT_NARROW_ROWS)."""
    sms = sms or num_sms(target.arch)
    d = c.as_dict()
    item = DTYPES[p.dtype]["itemsize"]
    launches = op.launches(p, c, target)
    main = _main_launch(op, p, c, launches)
    blocks = max(1, main.grid[0] * main.grid[1] * main.grid[2])
    threads = max(1, main.block[0] * main.block[1] * main.block[2])
    per_sm = max(d.get("min_blocks", 1), min(32, 2048 // threads, 65536 // (threads * _regs(op, p, c))))
    conc = min(blocks, sms * per_sm)
    need_bytes = op.min_bytes(p)
    name = op.name
    gn = name.startswith("groupnorm")
    unroll = d["items"] if gn else d.get("th", 1) * d.get("tw", 1)
    if p.layout == "nhwc" and (d.get("scheme") == "pipelined" or (d.get("scheme") == "fused" and op.grid_merge(c))):
        unroll *= 2  # two steps of vectors in flight (fused at a grid barrier streams as pipelined does)
    streams = 2 if name in ("groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta") else 1
    vec_bytes = d["vec_bytes"]
    if not gn and p.layout == "nchw" and name.endswith("_bwd"):
        vec_bytes = item * (op.row_vec_elems(p, c) if getattr(op, "x_footprint")(p, c) else 1)
    per_thread = need_bytes / (blocks * threads)
    inflight = conc * threads * max(1.0, min(unroll * vec_bytes * streams, per_thread))
    waves = blocks / (sms * per_sm)
    phi = dict.fromkeys(TERM_NAMES, 0.0)
    phi["cov"] = math.log(sms / min(sms, blocks))
    phi["tail"] = math.log(math.ceil(waves) / waves) if waves > 1 else 0.0
    narrow = math.log2(16 / max(1, vec_bytes))
    phi["vec_nchw" if p.layout == "nchw" else "vec_nhwc"] = narrow
    phi["small_work"] = max(0.0, math.log(256 / max(per_thread, 1e-3)))
    phi["big_work"] = max(0.0, math.log(per_thread / 65536))
    phi["threads"] = math.log2(threads / 256)
    phi["unroll"] = math.log2(max(1, unroll))
    phi["min_blocks"] = math.log2(d.get("min_blocks", 1))
    x_bytes = p.N * p.C * p.H * p.W * item
    # the contiguous run of bytes a block reads: a channel tile per pixel (NHWC), a slice or a
    # row (NCHW); a run not a whole number of 32-byte sectors wastes the rest of its sectors
    # (pooling reads whole rows or pixels of all channels: long runs)
    if gn:
        split = d["cluster"] if d.get("merge") == "cluster" else d.get("global_split", d.get("split", 1))
        tile = p.C if name == "groupnorm_fwd" and whole_rows(c) else d["groups_per_block"] * p.C // p.G
        if p.layout == "nchw":
            run = max(1, p.C // p.G * p.H * p.W // split) * item
        elif tile < p.C:
            run = tile * item
        else:  # the tile spans every channel: the block's pixels are one contiguous run
            run = max(1, p.H * p.W // split) * p.C * item
        phi["sector"] = math.log(32 * (math.ceil(run / 32) + (1 if run % 32 else 0)) / run)
    if name == "groupnorm_fwd":
        if d["slice_in"] in ("reload", "rows"):
            phi["reread"] = math.log1p(x_bytes / need_bytes)
        phi["split"] = math.log2(d["cluster"] if d["merge"] == "cluster" else d["global_split"])
        if p.layout == "nhwc":
            phi["gpb"] = math.log2(p.G if whole_rows(c) else d["groups_per_block"])
    elif gn:
        scheme = op.scheme(c)  # type: ignore[attr-defined]
        if name != "groupnorm_bwd_gamma_beta" and scheme != "single_pass":
            phi["reread"] = math.log1p(2 * x_bytes / need_bytes)
        phi["split"] = math.log2(d["split"])
        if p.layout == "nhwc":
            phi["gpb"] = math.log2(d["groups_per_block"])
    elif d.get("algo") == "scatter":
        phi["scatter"] = 1.0
    elif RECOMPUTE_REREAD and getattr(p, "indices", "") == "recompute" and d.get("algo") == "gather":
        # max backward recomputing the argmax: a thread's th x tw inputs are covered by up to
        # na x nb outputs, each of whose argmax is recomputed from x: from the x footprint under
        # their windows, read once (NCHW aligned tiles, XR x XC), else from each window
        # (kh x kw reads per covering output). The overlap is read again (L1/L2) and recomputed:
        # a th=1 tile reads ~2-3x the x a th>=2 tile does (the ResNet-stem sweeps: 2x slower)
        th, tw = op.tile(c)  # type: ignore[attr-defined]
        phi["reread"] = math.log1p(x_bytes * max(0.0, _recompute_reads(op, p, c) / (th * tw) - 1.0) / need_bytes)
    steps = chain_steps(op, p, c, PREDICT_NARROW_ROWS if narrow_rows is None else narrow_rows)
    if CHAIN and steps:
        ratio = steps * math.ceil(waves) * CHAIN_US / (need_bytes / BW_BYTES_PER_US)
        phi["chain"] = math.log1p(ratio) if CHAIN == "sum" else max(0.0, math.log(ratio))
    ws = op.workspace_bytes(p, c)
    allocs = len(op.output_buffers(p)) + (1 if ws > KEEP_WS_BYTES else 0)
    return Geometry(len(launches), allocs, math.log(max(need_bytes, 1) / BW_BYTES_PER_US), math.log(inflight),
                    tuple(phi[n] for n in TERM_NAMES))


def _recompute_reads(op: OpSpec, p: Problem, c: Config) -> int:
    """x elements a max pool backward thread reads to recompute the argmax of the outputs covering
    its th x tw tile: the x footprint under their windows (NCHW aligned tiles), else each covering
    output's window, else the windows of the tile's cover span."""
    if op.x_footprint(p, c):  # type: ignore[attr-defined]
        xr, xc = op._x_footprint_dims(p, c)  # type: ignore[attr-defined]
        return xr * xc
    if op.aligned_gather(p, c):  # type: ignore[attr-defined]
        na, nb = op.cover_counts(p, c)  # type: ignore[attr-defined]
        return na * nb * p.kernel[0] * p.kernel[1]  # type: ignore[attr-defined]
    th, tw = op.tile(c)  # type: ignore[attr-defined]
    (ekh, ekw), (sh, sw) = p.eff_kernel, p.stride  # type: ignore[attr-defined]
    return -(-(th + ekh - 1) // sh) * -(-(tw + ekw - 1) // sw) * p.kernel[0] * p.kernel[1]  # type: ignore[attr-defined]


_T = {n: i for i, n in enumerate(TERM_NAMES)}  # a term's column in Geometry.phi


def geometry_many(op: OpSpec, p: Problem, configs: Sequence[Config], target: Target,
                  narrow_rows: bool | None = None) -> list[Geometry]:
    """`geometry` of each config, equal to it exactly (the same expressions in the same order,
    tests/test_pick_latency.py and tests/test_gn_vector.py check): what depends on the problem
    alone is computed once, phi is filled by column, and a call's only launch is its main one
    without naming the instance. An
    unseen problem's pick predicts hundreds of candidates, so per-config overhead is what it saves
    (`geometry` per config costs a third of such a pick)."""
    arrays = _geometry_arrays(op, p, configs, target, narrow_rows)
    if arrays is not None:
        launches, allocs, log_roof, log_inflight, phi_rows = arrays
        return [Geometry(n, a, log_roof, li, tuple(row))
                for n, a, li, row in zip(launches, allocs, log_inflight.tolist(), phi_rows.tolist())]
    sms = num_sms(target.arch)
    item = DTYPES[p.dtype]["itemsize"]
    need_bytes = op.min_bytes(p)
    name = op.name
    gn = name.startswith("groupnorm")
    nhwc = p.layout == "nhwc"
    streams = 2 if name in ("groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta") else 1
    pool_nchw_bwd = not gn and p.layout == "nchw" and name.endswith("_bwd")
    x_bytes = p.N * p.C * p.H * p.W * item
    n_out = len(op.output_buffers(p))
    log_roof = math.log(max(need_bytes, 1) / BW_BYTES_PER_US)
    narrow_rule = PREDICT_NARROW_ROWS if narrow_rows is None else narrow_rows
    recompute = RECOMPUTE_REREAD and getattr(p, "indices", "") == "recompute"
    regs_est = getattr(op, "regs_used", None)
    vec_col = _T["vec_nchw" if p.layout == "nchw" else "vec_nhwc"]
    i_cov, i_tail, i_small, i_big, i_threads, i_unroll, i_min = (
        _T["cov"], _T["tail"], _T["small_work"], _T["big_work"], _T["threads"], _T["unroll"], _T["min_blocks"])
    i_sector, i_reread, i_split, i_gpb, i_scatter, i_chain = (
        _T["sector"], _T["reread"], _T["split"], _T["gpb"], _T["scatter"], _T["chain"])
    n_terms = len(TERM_NAMES)
    out = []
    for c in configs:
        d = c.as_dict()
        launches = op.launches(p, c, target)
        main = launches[0] if len(launches) == 1 else _main_launch(op, p, c, launches)
        blocks = max(1, main.grid[0] * main.grid[1] * main.grid[2])
        threads = max(1, main.block[0] * main.block[1] * main.block[2])
        if regs_est is not None:
            try:
                regs = max(32, int(regs_est(p, c)))
            except (KeyError, ValueError, ZeroDivisionError):
                regs = 32
        else:
            regs = _regs(op, p, c)
        per_sm = max(d.get("min_blocks", 1), min(32, 2048 // threads, 65536 // (threads * regs)))
        conc = min(blocks, sms * per_sm)
        unroll = d["items"] if gn else d.get("th", 1) * d.get("tw", 1)
        if nhwc and (d.get("scheme") == "pipelined" or (d.get("scheme") == "fused" and op.grid_merge(c))):
            unroll *= 2
        vec_bytes = d["vec_bytes"]
        if pool_nchw_bwd:
            vec_bytes = item * (op.row_vec_elems(p, c) if getattr(op, "x_footprint")(p, c) else 1)
        per_thread = need_bytes / (blocks * threads)
        inflight = conc * threads * max(1.0, min(unroll * vec_bytes * streams, per_thread))
        waves = blocks / (sms * per_sm)
        phi = [0.0] * n_terms
        phi[i_cov] = math.log(sms / min(sms, blocks))
        phi[i_tail] = math.log(math.ceil(waves) / waves) if waves > 1 else 0.0
        phi[vec_col] = math.log2(16 / max(1, vec_bytes))
        phi[i_small] = max(0.0, math.log(256 / max(per_thread, 1e-3)))
        phi[i_big] = max(0.0, math.log(per_thread / 65536))
        phi[i_threads] = math.log2(threads / 256)
        phi[i_unroll] = math.log2(max(1, unroll))
        phi[i_min] = math.log2(d.get("min_blocks", 1))
        if gn:
            split = d["cluster"] if d.get("merge") == "cluster" else d.get("global_split", d.get("split", 1))
            tile = p.C if name == "groupnorm_fwd" and whole_rows(c) else d["groups_per_block"] * p.C // p.G
            if p.layout == "nchw":
                run = max(1, p.C // p.G * p.H * p.W // split) * item
            elif tile < p.C:
                run = tile * item
            else:
                run = max(1, p.H * p.W // split) * p.C * item
            phi[i_sector] = math.log(32 * (math.ceil(run / 32) + (1 if run % 32 else 0)) / run)
        if name == "groupnorm_fwd":
            if d["slice_in"] in ("reload", "rows"):
                phi[i_reread] = math.log1p(x_bytes / need_bytes)
            phi[i_split] = math.log2(d["cluster"] if d["merge"] == "cluster" else d["global_split"])
            if nhwc:
                phi[i_gpb] = math.log2(p.G if whole_rows(c) else d["groups_per_block"])
        elif gn:
            scheme = op.scheme(c)  # type: ignore[attr-defined]
            if name != "groupnorm_bwd_gamma_beta" and scheme != "single_pass":
                phi[i_reread] = math.log1p(2 * x_bytes / need_bytes)
            phi[i_split] = math.log2(d["split"])
            if nhwc:
                phi[i_gpb] = math.log2(d["groups_per_block"])
        elif d.get("algo") == "scatter":
            phi[i_scatter] = 1.0
        elif recompute and d.get("algo") == "gather":
            th, tw = op.tile(c)  # type: ignore[attr-defined]
            phi[i_reread] = math.log1p(x_bytes * max(0.0, _recompute_reads(op, p, c) / (th * tw) - 1.0) / need_bytes)
        if gn and CHAIN:
            steps = chain_steps(op, p, c, narrow_rule)
            if steps:
                ratio = steps * math.ceil(waves) * CHAIN_US / (need_bytes / BW_BYTES_PER_US)
                phi[i_chain] = math.log1p(ratio) if CHAIN == "sum" else max(0.0, math.log(ratio))
        ws = op.workspace_bytes(p, c)
        out.append(Geometry(len(launches), n_out + (1 if ws > KEEP_WS_BYTES else 0), log_roof, math.log(inflight),
                            tuple(phi)))
    return out


def _exact(fn: Callable[[float], float], x: np.ndarray) -> np.ndarray:
    """fn (a `math` function) of each element, taken once per distinct value: numpy's own log
    may round the last bit otherwise, and `geometry` takes math's."""
    if not len(x):
        return np.zeros(0, dtype=np.float64)
    u, inv = np.unique(x, return_inverse=True)
    return np.array([fn(v) for v in u.tolist()], dtype=np.float64)[inv.reshape(-1)]


def _knob_columns(op: OpSpec, configs: Sequence[Config]) -> dict[str, np.ndarray] | None:
    """Each knob of the space over `configs` as an int64 or unicode array, of the kind of the
    space's values; None where a config lacks a knob or holds a value of another kind."""
    lat = _lattice(op.space)
    if lat is None or lat._arrays is None:
        return None
    dicts = [c.as_dict() for c in configs]
    out = {}
    try:
        for name, values in zip(lat.names, lat._arrays):
            col = [d[name] for d in dicts]
            a = np.array(col)
            if values.dtype.kind == "U":
                if a.dtype.kind != "U" or not all(type(v) is str for v in col):
                    return None
            elif a.dtype != np.int64:
                return None
            out[name] = a
    except (KeyError, ValueError, TypeError, OverflowError):
        return None
    return out


def _geometry_arrays(op: OpSpec, p: Problem, configs: Sequence[Config], target: Target,
                     narrow_rows: bool | None = None) -> tuple[list[int], list[int], float, np.ndarray, np.ndarray] | None:
    """`geometry` of each config as arrays (launches, allocs, log_roof, log_inflight, phi rows),
    for an op with `geometry_columns` (GroupNorm: ckgen/ops/gn_vector.py): the op's integers on
    knob arrays, then `geometry`'s float expressions element by element in numpy, with its
    transcendental functions taken from `math` by distinct value (`_exact`): equal to
    `geometry` exactly. None where the op has no such form, or a config or the problem is
    outside it (`geometry_many` then goes config by config)."""
    name = op.name
    many = getattr(op, "geometry_columns", None)
    if many is None or not name.startswith("groupnorm") or not configs:
        return None
    need_bytes = op.min_bytes(p)
    if not 0 < need_bytes < 1 << 50:
        return None
    k = _knob_columns(op, configs)
    if k is None:
        return None
    g = many(p, k, target, PREDICT_NARROW_ROWS if narrow_rows is None else narrow_rows)
    if g is None:
        return None
    n = len(configs)
    sms = num_sms(target.arch)
    item = DTYPES[p.dtype]["itemsize"]
    streams = 2 if name in ("groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta") else 1
    blocks = np.maximum(1, np.broadcast_to(g["blocks"], n))
    threads = np.maximum(1, np.broadcast_to(g["threads"], n))
    min_blocks = k["min_blocks"] if "min_blocks" in k else np.ones(n, dtype=np.int64)
    per_sm = np.maximum(min_blocks, np.minimum(np.minimum(32, 2048 // threads), 65536 // (threads * g["regs"])))
    conc = np.minimum(blocks, sms * per_sm)
    unroll, vec_bytes = np.broadcast_to(g["unroll"], n), k["vec_bytes"]
    per_thread = need_bytes / (blocks * threads)
    inflight = (conc * threads) * np.maximum(1.0, np.minimum(unroll * vec_bytes * streams, per_thread))
    waves = blocks / (sms * per_sm)
    phi = np.zeros((n, len(TERM_NAMES)), dtype=np.float64)
    log, log2 = math.log, math.log2
    phi[:, _T["cov"]] = _exact(log, sms / np.minimum(sms, blocks))
    over = waves > 1
    phi[over, _T["tail"]] = _exact(log, np.ceil(waves[over]) / waves[over])
    phi[:, _T["vec_nchw" if p.layout == "nchw" else "vec_nhwc"]] = _exact(log2, 16 / np.maximum(1, vec_bytes))
    phi[:, _T["small_work"]] = np.maximum(0.0, _exact(log, 256 / np.maximum(per_thread, 1e-3)))
    phi[:, _T["big_work"]] = np.maximum(0.0, _exact(log, per_thread / 65536))
    phi[:, _T["threads"]] = _exact(log2, threads / 256)
    phi[:, _T["unroll"]] = _exact(log2, np.maximum(1, unroll))
    phi[:, _T["min_blocks"]] = _exact(log2, min_blocks)
    fwd = name == "groupnorm_fwd"
    gpb = k["groups_per_block"]
    if fwd:
        rows = (k["slice_in"] == "rows") | (k["merge"] == "grid")  # whole_rows
        split = np.where(k["merge"] == "cluster", k["cluster"], k["global_split"])
        tile = np.where(rows, p.C, gpb * p.C // p.G)
    else:
        split, tile = k["split"], gpb * p.C // p.G
    if p.layout == "nchw":
        run = np.maximum(1, p.C // p.G * p.H * p.W // split) * item
    else:
        run = np.where(tile < p.C, tile * item, np.maximum(1, p.H * p.W // split) * p.C * item)
    phi[:, _T["sector"]] = _exact(log, 32 * (-(-run // 32) + (run % 32 != 0)) / run)
    x_bytes = p.N * p.C * p.H * p.W * item
    if fwd:
        reread = (k["slice_in"] == "reload") | (k["slice_in"] == "rows")
        phi[reread, _T["reread"]] = math.log1p(x_bytes / need_bytes)
    elif name != "groupnorm_bwd_gamma_beta":
        phi[k["scheme"] != "single_pass", _T["reread"]] = math.log1p(2 * x_bytes / need_bytes)  # dx: the scheme's own
    phi[:, _T["split"]] = _exact(log2, split)
    if p.layout == "nhwc":
        phi[:, _T["gpb"]] = _exact(log2, np.where(rows, p.G, gpb) if fwd else gpb)
    if CHAIN:
        steps = np.broadcast_to(g["steps"], n)
        on = steps != 0
        ratio = steps[on] * np.ceil(waves[on]).astype(np.int64) * CHAIN_US / (need_bytes / BW_BYTES_PER_US)
        phi[on, _T["chain"]] = (_exact(math.log1p, ratio) if CHAIN == "sum"
                                else np.maximum(0.0, _exact(log, ratio)))
    n_out = len(op.output_buffers(p))
    allocs = (n_out + (np.broadcast_to(g["ws"], n) > KEEP_WS_BYTES)).tolist()
    return (np.broadcast_to(g["launches"], n).tolist(), allocs, math.log(max(need_bytes, 1) / BW_BYTES_PER_US),
            _exact(log, inflight), phi)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def chain_steps(op: OpSpec, p: Problem, c: Config, narrow_rows: bool = True) -> int:
    """GroupNorm: the load round trips one block makes one after another (its critical path),
    as the templates walk their shares. A block whose x is held (`regs`, `single_pass`) loads
    it in one step; a streaming pass takes one step per ITEMS vectors a thread has in flight
    (NCHW: threads x ITEMS vectors of the share per step; NHWC: R pixel rows x ITEMS), and the
    forward's reload / the backward's staged and fused schemes stream twice (sums, then y or
    dx). The NCHW backward's sums go channel by channel in a 2-D tile of RR rows x CC threads:
    a round per RR channels, each ceil(channel / (CC x ITEMS)) steps long, where a row is as
    narrow as sweeps a channel in one step (CC x ITEMS >= H*W/vec) since kernel version 2, and was as
    wide as the channel (CC >= H*W/vec, up to the block) before (`narrow_rows=False`: records
    of a kernel version before NARROW_ROWS_FROM_KERNEL_VERSION ran that). Exact where every
    block's share is whole channels;
    where a share straddles channels each piece is counted as a whole channel's steps, an upper
    bound within 2x of the walk (tests/test_costmodel_chain.py). Pooling: 0 (no chain term)."""
    name = op.name
    if not name.startswith("groupnorm"):
        return 0
    d = c.as_dict()
    item = DTYPES[p.dtype]["itemsize"]
    vec = max(1, d["vec_bytes"] // item)
    threads, items = d["threads"], d["items"]
    Cg, HW = p.C // p.G, p.H * p.W  # type: ignore[attr-defined]
    if name == "groupnorm_fwd":
        split = d["cluster"] if d["merge"] == "cluster" else d["global_split"]
        held = d["slice_in"] == "regs"
        if p.layout == "nchw":
            per_step, share = threads * items, -(-(Cg * HW // vec) // split)
        else:
            ch = p.C if whole_rows(c) else d["groups_per_block"] * Cg
            _, rows, share = nhwc_tile(ch, vec, threads, split, HW, "")
            per_step = rows * items
        return 1 if held else 2 * -(-share // max(1, per_step))
    scheme = op.scheme(c)  # type: ignore[attr-defined]
    want_dx = getattr(op, "want_dx", True)
    split = d["split"]
    if scheme == "single_pass":
        return 1
    passes = 2 if want_dx else 1  # the sums, then dx
    if p.layout == "nhwc":
        _, rows, share = nhwc_tile(d["groups_per_block"] * Cg, vec, threads, split, HW, "")
        return passes * -(-share // max(1, rows * items))
    hv = max(1, HW // vec)
    share = -(-(Cg * hv) // split)
    dx = -(-share // (threads * items)) if want_dx else 0
    if narrow_rows:
        cc = threads if hv >= threads * items else _pow2_at_least(-(-hv // items))
    else:
        cc = threads if hv >= threads else _pow2_at_least(hv)
    cc = min(cc, threads)
    chans = min(Cg, -(-share // hv) + (1 if share % hv else 0))
    rounds = -(-chans // (threads // cc))
    return rounds * -(-min(hv, share) // (cc * items)) + dx


def _regs(op: OpSpec, p: Problem, c: Config) -> int:
    """Registers per thread (at least 32): pooling's `regs_used` (what the compiler is expected to
    allocate, up to the launch bounds' budget); GroupNorm's from its ops' estimates."""
    est = getattr(op, "regs_used", None)  # the pooling ops have it; GroupNorm's is below
    if est is not None:
        try:
            return max(32, int(est(p, c)))
        except (KeyError, ValueError, ZeroDivisionError):
            return 32
    if op.name == "groupnorm_fwd":
        return fwd_regs_needed(p, c)  # type: ignore[arg-type]
    return bwd_regs_needed(p, c, op.scheme(c))  # type: ignore[arg-type,attr-defined]


def launch_floor(launches: Any, first: float, nxt: float) -> Any:
    """first + (launches - 1) x nxt (launches: an int or an array)."""
    return first + (launches - 1) * nxt


def _phi_matrix(geos: Sequence[Geometry], need: float) -> np.ndarray:
    phi = np.array([g.phi for g in geos], dtype=np.float64).reshape(len(geos), len(TERM_NAMES))
    phi[:, 0] = np.maximum(0.0, math.log(need) - np.array([g.log_inflight for g in geos]))
    return phi


# ---------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Prediction:
    gpu_us: float
    host_us: float

    @property
    def total_us(self) -> float:
        """Time per call back to back: the GPU and the host overlap, the slower one sets the pace."""
        return max(self.gpu_us, self.host_us)

    def __str__(self) -> str:
        where = "host-bound" if self.host_us > self.gpu_us else "GPU-bound"
        return f"{self.total_us:.1f} us ({where}: GPU {self.gpu_us:.1f} us, host {self.host_us:.1f} us)"


class CostModel:
    """A fitted model (see the module doc). Build with `fit`, or `from_doc` of a saved file."""

    def __init__(self, weights: Sequence[float], intercepts: dict[str, float], floor_us: float, need_bytes: float,
                 host: dict[str, float], winners: dict[str, list[dict[str, Any]]], stats: dict[str, Any],
                 residuals: dict[str, dict[str, Any]] | None = None,
                 correction: dict[str, float] | None = None, floor_next_us: float | None = None):
        self.weights = np.array(weights, dtype=np.float64)
        self.intercepts = dict(intercepts)
        self.floor_us, self.need_bytes = float(floor_us), float(need_bytes)
        # a further launch of the same call (a file without it: every launch costs floor_us)
        self.floor_next_us = float(floor_us if floor_next_us is None else floor_next_us)
        self.host = dict(host)
        self.winners = {k: list(v) for k, v in winners.items()}
        self.stats = dict(stats)
        self._winner_configs: dict[str, list[Config]] = {}
        # per op: the recorded problems ([arch, key]), their configs, and parallel lists problem /
        # config (indices into those) / residual (flat lists: a fast load)
        self.residuals = dict(residuals or {})
        self.correction = {"tau": CORR_TAU, "prior": CORR_PRIOR, **(correction or {})}
        self._resid_index: dict[str, tuple[list[tuple[str, Problem]], dict[Config, list[tuple[int, float]]]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a model handed to or from a worker process) without this process's indexes,
        which hold the op objects they were built for."""
        state = dict(self.__dict__)
        state["_winner_configs"], state["_resid_index"] = {}, {}
        return state

    # ---- file form ----
    def to_doc(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "terms": list(TERM_NAMES),
                "weights": [round(float(w), 6) for w in self.weights],
                "intercepts": {k: round(v, 6) for k, v in sorted(self.intercepts.items())},
                "floor_us": self.floor_us, "floor_next_us": self.floor_next_us, "need_bytes": self.need_bytes,
                "bw_bytes_per_us": BW_BYTES_PER_US,
                "host": self.host, "stats": self.stats,
                "correction": dict(sorted(self.correction.items())),
                "residuals": {k: v for k, v in sorted(self.residuals.items())},
                "winners": {k: v for k, v in sorted(self.winners.items())}}

    @classmethod
    def from_doc(cls, doc: Any) -> "CostModel":
        """ModelError for anything but a well-formed model document of this version."""
        try:
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ModelError("not a ckgen cost model")
            if doc.get("version") != VERSION:
                raise ModelError(f"model version {doc.get('version')!r}; this ckgen reads {VERSION}")
            if doc.get("terms") != list(TERM_NAMES):
                raise ModelError("its terms differ from this ckgen's")
            w = [_number(x) for x in doc["weights"]]
            if len(w) != len(TERM_NAMES):
                raise ModelError("wrong number of weights")
            inter = {str(k): _number(v) for k, v in _mapping(doc["intercepts"], "intercepts").items()}
            host = {k: _number(_mapping(doc["host"], "host")[k]) for k in HOST}
            floor_us, need = _number(doc["floor_us"]), _number(doc["need_bytes"])
            floor_next = _number(doc.get("floor_next_us", floor_us))
            # Bounds that keep every prediction a finite time (exp of the weighted terms, which are
            # logs of at most a few dozen): a fitted model is far inside them (weights and
            # intercepts within 2, floors and host times of a few us, the knee a few MB)
            if not all(abs(x) <= MAX_WEIGHT for x in [*w, *inter.values()]):
                raise ModelError(f"a weight or intercept is out of range (not finite or beyond +-{MAX_WEIGHT:g})")
            if not all(0 <= x <= MAX_US for x in [*host.values(), floor_us, floor_next]):
                raise ModelError("a host time or launch floor is out of range "
                                 f"(not finite or outside [0, {MAX_US:g}] us)")
            if not 1.0 <= need <= MAX_NEED_BYTES:
                raise ModelError(f"need_bytes {need!r} is out of range (not finite or outside [1, {MAX_NEED_BYTES:g}])")
            winners = doc.get("winners") or {}
            if not isinstance(winners, dict) or not all(
                    isinstance(v, list) and all(_config_ok(c) for c in v) for v in winners.values()):
                raise ModelError("'winners' is not a mapping of op -> list of configs (knob name -> "
                                 "a number, string or bool)")
            resid = doc.get("residuals", {})
            if not isinstance(resid, dict) or not all(_residuals_ok(v) for v in resid.values()):
                raise ModelError("'residuals' is not a mapping of op -> {knobs, problems, configs, problem, "
                                 "config, residual} (index lists in range, knob values numbers, strings or "
                                 f"bools, residuals finite and within +-{MAX_RESIDUAL:g})")
            corr = {str(k): _number(v) for k, v in _mapping(doc.get("correction") or {}, "correction").items()}
            if not all(0 <= v <= MAX_CORRECTION for v in corr.values()):
                raise ModelError("'correction': a constant is out of range "
                                 f"(not finite or outside [0, {MAX_CORRECTION:g}])")
            stats = doc.get("stats") or {}
            if not isinstance(stats, dict):
                raise ModelError("'stats' is not a mapping")
            return cls(w, inter, floor_us, need, host, winners, dict(stats), resid, corr, floor_next)
        except ModelError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ModelError(f"malformed ({e.__class__.__name__}: {str(e)[:200]})") from None

    def summary(self) -> str:
        s = self.stats
        return (f"{s.get('records', '?')} records of {s.get('problems', '?')} problems; floor {self.floor_us} us "
                f"for a call's first launch, {self.floor_next_us:g} us for each further one, "
                f"knee {self.need_bytes / 1e6:g} MB in flight; weights "
                + ", ".join(f"{n}={w:.2f}" for n, w in zip(TERM_NAMES, self.weights)))

    # ---- prediction ----
    def predict_many(self, op: OpSpec, p: Problem, configs: Sequence[Config], target: Target) -> list[Prediction]:
        arrays = _geometry_arrays(op, p, configs, target)
        if arrays is not None:  # geometry_many's Geometry objects without building them
            launches, allocs, log_roof, log_inflight, phi = arrays
            phi[:, 0] = np.maximum(0.0, math.log(self.need_bytes) - log_inflight)  # _phi_matrix
            roofs = np.full(len(configs), log_roof)
        else:
            geos = geometry_many(op, p, configs, target)
            if not geos:
                return []
            phi = _phi_matrix(geos, self.need_bytes)
            roofs = np.array([g.log_roof for g in geos])
            launches, allocs = [g.launches for g in geos], [g.allocs for g in geos]
        b = self.intercepts.get(op.name, float(np.mean(list(self.intercepts.values()) or [0.0])))
        with np.errstate(over="ignore", invalid="ignore"):
            mem = np.exp(roofs + b + phi @ self.weights)
        if not np.isfinite(mem).all():  # a model file's constants within their bounds, but not for this problem
            raise ModelError(f"it predicts a time that is not finite for {op.name} {p.key()}")
        corr = self.corrections(op, p, configs, target)
        h = self.host
        return [Prediction((self.launch_us(n) + float(m)) * math.exp(k),
                           h["call_us"] + h["launch_us"] * n + h["alloc_us"] * a)
                for n, a, m, k in zip(launches, allocs, mem, corr)]

    def _residual_index(self, op: OpSpec) -> "_ResidualIndex":
        idx = self._resid_index.get(op.name)
        if idx is None:  # `corrections` asks only for an op the table holds
            table = self.residuals[op.name]
            arrays = getattr(self.residuals, "arrays", None)  # a parse cache's tables: their arrays too
            idx = self._resid_index[op.name] = _ResidualIndex(op, table, arrays(op.name) if arrays else None)
        return idx

    def corrections(self, op: OpSpec, p: Problem, configs: Sequence[Config], target: Target) -> list[float]:
        """Per config, the measured correction to its log GPU time (see CORR_TAU): 0 for a config
        no nearby recorded problem timed, or with the correction off."""
        tau, prior = self.correction["tau"], self.correction["prior"]
        if tau <= 0 or not self.residuals.get(op.name):
            return [0.0] * len(configs)
        index = self._residual_index(op)
        weight: dict[int, float] = {}
        out = []
        for c in configs:
            num = den = 0.0
            for pi, res in index.entries(c):
                w = weight.get(pi)
                if w is None:
                    arch, q = index.problem(pi)
                    w = weight[pi] = (0.0 if q is None or q == p or arch != target.arch
                                      else math.exp(-op.related_distance(p, q) / tau))
                num += w * res
                den += w
            out.append(num / (den + prior) if den > 0 else 0.0)
        return out

    def launch_us(self, launches: int) -> float:
        """GPU time of a call's launches beyond its memory traffic: the first launch's floor, and
        a smaller one for each further launch (queued behind the first)."""
        return launch_floor(launches, self.floor_us, self.floor_next_us)

    def predict(self, op: OpSpec, p: Problem, config: Config, target: Target) -> Prediction:
        return self.predict_many(op, p, [config], target)[0]

    def rank(self, op: OpSpec, p: Problem, configs: Sequence[Config], target: Target) -> list[tuple[Prediction, Config]]:
        """Best first: lowest time per call, then lowest GPU time, then the config's key (ties are
        broken the same way every run)."""
        preds = self.predict_many(op, p, configs, target)
        order = sorted(range(len(configs)), key=lambda i: (round(preds[i].total_us, 6), round(preds[i].gpu_us, 6),
                                                          configs[i].key()))
        return [(preds[i], configs[i]) for i in order]

    def winner_configs(self, op: OpSpec) -> list[Config]:
        """The recorded winners of this op and its siblings, as points of this op's space."""
        if op.name not in self._winner_configs:
            self._winner_configs[op.name] = related_winners(op, self.winners)
        return self._winner_configs[op.name]

    def select(self, op: OpSpec, p: Problem, cands: Sequence[Config], near: int,
               target: Target, margin: float = WIDE_MARGIN) -> list[tuple[Prediction, Config]]:
        """The two-tier ranking of `candidate_tiers`' (cands, near): the wide-tier candidates
        predicted faster than the near tier's best by WIDE_MARGIN (best first), then the near
        tier's, best first (`rank`'s order). Only the near tier when no wide one clears the bar."""
        ranked = self.rank(op, p, cands, target)
        inner = set(cands[:near])
        first = [x for x in ranked if x[1] in inner]
        if not first:
            return ranked
        bar = first[0][0].total_us / (1.0 + margin)
        return [x for x in ranked if x[1] not in inner and x[0].total_us < bar] + first

    def choose(self, op: OpSpec, p: Problem, target: Target, usable: Callable[[Config], bool],
               extra_winners: Iterable[Config] = (), accept: Callable[[Config], bool] | None = None,
               admitted: Callable[[Config], bool] | None = None) -> tuple[Config, Prediction, int] | None:
        """The best candidate (`select`) that `usable` accepts (it must include op.validate),
        its prediction, and how many candidates were ranked; None if no candidate is usable.
        `accept` (costly: a compile) is asked of the best ACCEPT_TRIES in order; the first it
        accepts wins (none: the best). `admitted`: see `candidate_tiers`."""
        cands, near = candidate_tiers(op, p, target, [*extra_winners, *self.winner_configs(op)], usable,
                                      admitted=admitted)
        if not cands:
            return None
        ranked = self.select(op, p, cands, near, target)
        if accept is not None:
            for pred, config in ranked[:ACCEPT_TRIES]:
                if accept(config):
                    return config, pred, len(cands)
        pred, config = ranked[0]
        return config, pred, len(cands)


class _ResidualIndex:
    """One op's residual table (`CostModel.residuals`), ready for `corrections`: a config's
    entries (recorded problem index, residual) in the file's order, found by the config's knob
    values; a problem's key parsed when an entry of it is first used. Built in a few ms (parsing
    every problem and building a Config per table row took ~0.1 s per GroupNorm op, in the first
    unseen problem's pick)."""

    def __init__(self, op: OpSpec, doc: dict[str, Any],
                 arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        """`arrays`: the table's problem, config and residual lists as arrays, where the reader
        has them (converting the lists again costs a few ms per GroupNorm op)."""
        self.op = op
        self.knobs = list(doc["knobs"])
        self._knob_set = set(self.knobs)
        self._problems = doc["problems"]
        self._parsed: dict[int, tuple[str, Problem | None]] = {}
        self._ci: dict[Config, int | None] = {}  # a config's group (None: not in the table)
        # rows equal as configs (1 and 1.0 alike, as Config compares them) share one group
        group: dict[tuple, int] = {}
        canon = np.array([group.setdefault(tuple(row), ci) for ci, row in enumerate(doc["configs"])] or [0],
                         dtype=np.int64)
        self._group = group
        problem, config, residual = arrays if arrays is not None else (doc["problem"], doc["config"], doc["residual"])
        ci = canon[np.asarray(config, dtype=np.int64)] if len(config) else np.zeros(0, dtype=np.int64)
        order = np.argsort(ci, kind="stable")  # each config's entries in the file's order
        self._pi = np.asarray(problem, dtype=np.int64)[order].tolist()
        self._res = np.asarray(residual, dtype=np.float64)[order].tolist()
        counts = np.bincount(ci, minlength=len(canon))
        self._end = np.cumsum(counts).tolist()
        self._start = (np.cumsum(counts) - counts).tolist()

    def entries(self, c: Config) -> list[tuple[int, float]]:
        """(problem index, residual) of every table entry of config c whose problem parses."""
        ci = self._ci.get(c, -1)
        if ci == -1:
            d = dict(c.items)
            ci = self._group.get(tuple(d.get(k) for k in self.knobs)) if d.keys() <= self._knob_set else None
            if len(self._ci) < 200_000:
                self._ci[c] = ci
        if ci is None:
            return []
        lo, hi = self._start[ci], self._end[ci]
        return [(pi, res) for pi, res in zip(self._pi[lo:hi], self._res[lo:hi]) if self.problem(pi)[1] is not None]

    def problem(self, pi: int) -> tuple[str, Problem | None]:
        """(arch, problem) of the table's problem pi; None for a key this ckgen cannot parse."""
        got = self._parsed.get(pi)
        if got is None:
            arch, key = self._problems[pi]
            try:
                q = self.op.problem_from_key(str(key))
            except (KeyError, ValueError, TypeError):  # a problem of an older ckgen: skipped
                q = None
            got = self._parsed[pi] = (str(arch), q)
        return got


_NEIGHBOURS: dict[tuple[str, int, Config], tuple[Config, ...]] = {}


def _neighbours_cached(op: OpSpec, config: Config) -> tuple[Config, ...]:
    """`neighbours`, remembered: the candidate walk starts from the same winners for every problem
    of an op, so after the first problem it walks a graph it has seen (keyed by the space object,
    which a reloaded space replaces)."""
    key = (op.name, id(op.space), config)
    out = _NEIGHBOURS.get(key)
    if out is None:
        if len(_NEIGHBOURS) > 200_000:
            _NEIGHBOURS.clear()
        out = _NEIGHBOURS[key] = tuple(neighbours(op, config))
    return out


def neighbours(op: OpSpec, config: Config) -> list[Config]:
    """Configs one knob step away (the previous or next value of one knob in the space)."""
    params = op.space.params
    d = config.as_dict()
    out = []
    for k, values in params.items():
        try:
            i = values.index(d[k])
        except (KeyError, ValueError):
            continue
        for j in (i - 1, i + 1):
            if 0 <= j < len(values):
                out.append(config.replace(**{k: values[j]}))
    return out


def candidate_tiers(op: OpSpec, p: Problem, target: Target, winners: Iterable[Config],
                    usable: Callable[[Config], bool], limit: int = MAX_CANDIDATES,
                    admitted: Callable[[Config], bool] | None = None) -> tuple[list[Config], int]:
    """(candidates, near): the usable winners (and the space default), then the usable configs
    one knob step from them, then a step further and so on (at most MAX_STEPS), at most `limit`
    in all, in a fixed order. The first `near` are the near tier: up to the first step (from one
    on) with MIN_CANDIDATES usable; the rest the wide tier. None usable: the valid config nearest
    the default, alone.

    `usable` must accept only configs `op.validate` accepts (the dispatcher's adds the pointers'
    alignment): it is asked only about points of the space that pass the op's `class_check` for
    p's problem class, in walk order. `admitted`, where given, answers for `usable` about those
    configs without the checks the walk has made (the dispatcher's: the alignment and
    `op.shape_check`); its attribute `many`, where it has one, answers on the knob arrays of
    many such configs at once (a bool array, or None: ask `admitted` per config). The walk runs on the space's `_Lattice` (the same order as stepping
    through `neighbours`, which `_walk_configs` still does for winners off the lattice)."""
    start = list(dict.fromkeys([*winners, op.space.default]))
    lat = _lattice(op.space)
    codes = lat.encode_all(start) if lat is not None else None
    if codes is None:
        return _walk_configs(op, start, usable, limit)
    admit = _class_filter(op, p, target, lat)
    whole_step = lat.columns(np.zeros(0, dtype=np.int64)) is not None and \
        getattr(op.class_check_many, "__func__", None) is not OpSpec.class_check_many  # a wrapped op too
    ask = admitted or usable
    many = getattr(admitted, "many", None) if whole_step else None
    ok: list[Config] = []
    near = -1
    visited = np.zeros(lat.size, dtype=bool)
    frontier = np.asarray(codes, dtype=np.int64)
    for step in range(MAX_STEPS + 1):
        nodes = lat.first_unseen(frontier, visited)
        visited[nodes] = True
        # the class check first: it refuses most of an NCHW walk, whose space checks cost more;
        # over the whole step where the op has its vectorised form (cheap, remembered per class),
        # else per chunk with the space's checks (a walk that stops early checks no further)
        walk = admit(nodes) if whole_step else nodes  # `nodes` stay the next step's frontier
        for lo in range(0, len(walk), _CHUNK):
            chunk = walk[lo:lo + _CHUNK]
            points = lat.space_points(chunk if whole_step else admit(chunk))
            # `admitted.many`, where given, answers for a whole chunk (its knob arrays) at once
            mask = many(lat.columns(points)) if many is not None and len(points) else None
            if mask is not None:
                for code in points[mask].tolist():
                    ok.append(lat.config(code))
                    if len(ok) >= limit:
                        return ok, (near if near >= 0 else len(ok))
                continue
            for code in points.tolist():
                c = lat.config(code)
                if ask(c):
                    ok.append(c)
                    if len(ok) >= limit:
                        return ok, (near if near >= 0 else len(ok))
        if near < 0 and step > 0 and len(ok) >= MIN_CANDIDATES:
            near = len(ok)
        if step < MAX_STEPS:
            nb = lat.neighbours(nodes).ravel()
            nb = nb[nb >= 0]
            frontier = nb[~visited[nb]]
    if not ok:
        d = op.space.nearest_default(usable)
        if d is not None:
            ok.append(d)
    return ok, (near if near >= 0 else len(ok))


def _walk_configs(op: OpSpec, start: list[Config], usable: Callable[[Config], bool],
                  limit: int) -> tuple[list[Config], int]:
    """`candidate_tiers`' walk on Config objects, for winners off the space's lattice (a knob the
    space lacks, a value of another kind)."""
    seen: set[Config] = set()
    ok: list[Config] = []
    near = -1
    frontier = start
    for step in range(MAX_STEPS + 1):
        nxt: list[Config] = []
        for c in frontier:
            if c in seen:
                continue
            seen.add(c)
            if usable(c):
                ok.append(c)
                if len(ok) >= limit:
                    return ok, (near if near >= 0 else len(ok))
            nxt.append(c)
        if near < 0 and step > 0 and len(ok) >= MIN_CANDIDATES:
            near = len(ok)
        if step < MAX_STEPS:
            frontier = [n for c in nxt for n in _neighbours_cached(op, c) if n not in seen]
    if not ok:
        d = op.space.nearest_default(usable)
        if d is not None:
            ok.append(d)
    return ok, (near if near >= 0 else len(ok))


_CHUNK = 512  # walk nodes whose space and class checks are taken together
_LATTICE_MAX = 1 << 23  # points of a space's product the lattice indexes (ckgen's largest: 466,560)


class _Lattice:
    """A tuning space's product of knob values, each point an integer (its code: the value
    indices in mixed radix), so that the candidate walk steps and dedups with numpy instead of
    building a Config per neighbour. Remembers which codes are points of the space (space.check,
    asked once per code and process) and the Config of each code it decoded."""

    def __init__(self, space: Any) -> None:
        self.space = space
        params = space.params
        self.names = tuple(params)  # `neighbours` steps the knobs in this order
        self.values = tuple(tuple(params[n]) for n in self.names)
        # per knob, (value kind, value) -> its first index: equal and of the same kind, as
        # `encode_all` matches a Config's value (1024.0 is not 1024, True is not 1)
        self._index = []
        for vals in self.values:
            index: dict[tuple[type, Any], int] = {}
            for j, w in enumerate(vals):
                if w == w:  # a nan equals no value
                    index.setdefault((type(w), w), j)
            self._index.append(index)
        self.radix = np.array([len(v) for v in self.values], dtype=np.int64)
        # the last knob varies fastest; code = sum(index_k * stride_k)
        self.strides = np.array([math.prod(len(v) for v in self.values[i + 1:]) for i in range(len(self.values))],
                                dtype=np.int64)
        self.size = int(math.prod(int(r) for r in self.radix))
        self.in_space = np.full(self.size, -1, dtype=np.int8)  # -1: not asked yet
        self._configs: dict[int, Config] = {}
        self._codes: dict[Config, int] = {}
        # a Config's items are sorted by knob name: the knobs' positions in that order
        self._sorted = sorted(range(len(self.names)), key=lambda i: self.names[i])
        self._first = np.full(self.size, np.iinfo(np.int64).max, dtype=np.int64)  # first_unseen's scratch
        self._lock = threading.Lock()  # for the scratch: dispatch may pick in several threads
        kinds = [{type(v) for v in vals} for vals in self.values]
        self._arrays = ([np.array(vals) for vals in self.values]
                        if all(k == {int} or k == {str} for k in kinds) else None)
        # decoding a code in Python ints: (stride, radix, values) per knob, and per knob of a
        # Config's sorted items (name, stride, radix, values)
        self._digits = [(int(st), int(r), vals) for st, r, vals in zip(self.strides, self.radix, self.values)]
        self._items = [(self.names[i], *self._digits[i]) for i in self._sorted]
        # the space's constraints, asked with the knobs' values in the space's order (a code's
        # values are the space's own, so its value checks hold): `Space.check` without a Config
        compiled = getattr(space, "_memo", {}).get("compiled")
        self._failing = (compiled.first_failing if compiled is not None and list(compiled.names) == list(self.names)
                         else None)

    def encode_all(self, configs: Sequence[Config]) -> list[int] | None:
        """The codes of `configs`, None if one is not exactly a point of the product (a knob missing
        or extra, a value not among the knob's, or of another kind: 1024.0 for 1024)."""
        out = []
        for c in configs:
            code = self._codes.get(c)  # an equal Config of the same value kinds (checked below)
            if code is not None and all(type(a) is type(b)
                                        for (_, a), (_, b) in zip(c.items, self.config(code).items)):
                out.append(code)
                continue
            d = c.as_dict()
            if len(d) != len(self.names):
                return None
            code = 0
            for name, index, stride in zip(self.names, self._index, self.strides):
                v = d.get(name, _MISSING)
                try:
                    i = index.get((type(v), v), -1)
                except TypeError:  # unhashable: no knob value
                    i = -1
                if i < 0:
                    return None
                code += i * int(stride)
            if len(self._codes) < 1_000_000:
                self._codes[c] = code
            out.append(code)
        return out

    def config(self, code: int) -> Config:
        c = self._configs.get(code)
        if c is None:
            c = self._configs[code] = Config(tuple([(n, vals[code // st % r]) for n, st, r, vals in self._items]))
        return c

    def first_unseen(self, codes: np.ndarray, visited: np.ndarray) -> np.ndarray:
        """The codes not `visited`, each at its first occurrence, in order."""
        codes = codes[~visited[codes]]
        if len(codes) < 2:
            return codes
        pos = np.arange(len(codes), dtype=np.int64)
        with self._lock:
            np.minimum.at(self._first, codes, pos)
            out = codes[self._first[codes] == pos]
            self._first[codes] = np.iinfo(np.int64).max
        return out

    def neighbours(self, codes: np.ndarray) -> np.ndarray:
        """(len(codes), 2 x knobs): per code, the codes one knob step away in `neighbours`' order
        (per knob the previous value, then the next), -1 where the knob has none."""
        out = np.empty((len(codes), 2 * len(self.names)), dtype=np.int64)
        for k, (st, r) in enumerate(zip(self.strides, self.radix)):
            digit = (codes // st) % r
            out[:, 2 * k] = np.where(digit > 0, codes - st, -1)
            out[:, 2 * k + 1] = np.where(digit < r - 1, codes + st, -1)
        return out

    def columns(self, codes: np.ndarray) -> dict[str, np.ndarray] | None:
        """Each knob's values at `codes`, as arrays (an int or str array per knob); None where a
        knob's values are not all ints or all strings (no array holds them as they are)."""
        if self._arrays is None:
            return None
        return {n: a[(codes // st) % r] for n, a, st, r in zip(self.names, self._arrays, self.strides, self.radix)}

    def space_points(self, codes: np.ndarray) -> np.ndarray:
        """The codes that are points of the space (constraints hold), in order."""
        state = self.in_space[codes]
        unknown = codes[state < 0].tolist()
        if unknown and self._failing is not None and self._arrays is not None:
            # the constraints on the knob arrays (`_CompiledSpace.holds_many`) where they translate
            held = self.space._memo["compiled"].holds_many(self.columns(codes[state < 0]))
            if held is not None:
                self.in_space[codes[state < 0]] = held
                unknown = []
        if unknown:
            failing, digits = self._failing, self._digits
            if failing is None:
                for code in unknown:
                    self.in_space[code] = 1 if self.space.check(self.config(code)) else 0
            else:
                self.in_space[unknown] = [failing(*[vals[code // st % r] for st, r, vals in digits]) < 0
                                          for code in unknown]
        return codes[self.in_space[codes] == 1]


_MISSING = object()
_LATTICES: dict[tuple[str, int], _Lattice] = {}


def _lattice(space: Any) -> _Lattice | None:
    """The space's lattice (built once per space object), None for a product too large to index."""
    key = (space.op, id(space))
    lat = _LATTICES.get(key)
    if lat is None or lat.space is not space:
        if math.prod(len(v) for v in space.params.values()) > _LATTICE_MAX:
            return None
        lat = _LATTICES[key] = _Lattice(space)
    return lat


def _class_filter(op: OpSpec, p: Problem, target: Target, lat: _Lattice) -> Callable[[np.ndarray], Any]:
    """Codes -> those `op.class_check` admits for p's problem class on this target (identity where
    the op has no class check), each code's answer remembered per (op, class, arch)."""
    cls = op.problem_class(p)
    if cls is None:
        return lambda codes: codes
    key = (op.name, id(lat), cls, target)
    state = _CLASS_STATE.get(key)
    if state is None:
        if len(_CLASS_STATE) > 64:
            _CLASS_STATE.clear()
        state = _CLASS_STATE[key] = np.full(lat.size, -1, dtype=np.int8)

    def admit(codes: np.ndarray) -> np.ndarray:
        unknown = codes[state[codes] < 0]
        if len(unknown):
            columns = lat.columns(unknown)
            many = op.class_check_many(p, columns, target) if columns is not None else None
            if many is not None:
                state[unknown] = np.asarray(many, dtype=bool)
            else:
                for code in unknown.tolist():
                    try:
                        state[code] = 1 if op.class_check(p, lat.config(code), target) else 0
                    except (KeyError, ValueError, TypeError, ArithmeticError):  # off the space: its check decides
                        state[code] = 1
        return codes[state[codes] == 1]

    return admit


_CLASS_STATE: dict[tuple, np.ndarray] = {}


def candidates(op: OpSpec, p: Problem, target: Target, winners: Iterable[Config],
               usable: Callable[[Config], bool], limit: int = MAX_CANDIDATES) -> list[Config]:
    """The near tier of `candidate_tiers`: the usable winners (and the space default), then the
    usable configs one knob step from them; while fewer than MIN_CANDIDATES are usable, a step
    further (at most MAX_STEPS), at most `limit` in all."""
    ok, near = candidate_tiers(op, p, target, winners, usable, limit)
    return ok[:near]


def related_winners(op: OpSpec, winners: dict[str, list[dict[str, Any]]]) -> list[Config]:
    """Winners of this op, then those of its siblings (the other GroupNorm backward ops; max and
    average pooling of one direction) carried into this op's space: knobs it lacks dropped, knobs
    they lack at the space default; kept only if a point of the space."""
    params, default = op.space.params, op.space.default.as_dict()
    fam = _family(op.name)
    names = [op.name] + sorted(n for n in winners if n != op.name and _family(n) == fam)
    out: list[Config] = []
    seen: set[Config] = set()  # `out` as a set: hundreds of winners, a list's `in` was quadratic
    for n in names:
        for w in winners.get(n, []):
            c = Config.of({k: w.get(k, default[k]) for k in params})
            if c not in seen and op.space.check(c):
                out.append(c)
                seen.add(c)
    return out


def _family(name: str) -> str:
    if name.startswith("groupnorm_bwd"):
        return "groupnorm_bwd"
    if name.endswith("pool2d_fwd"):
        return "pool2d_fwd"
    if name.endswith("pool2d_bwd"):
        return "pool2d_bwd"
    return name


# ---------------------------------------------------------------------------------- fitting


def _usable_records(records: Iterable[dict[str, Any]]) -> list[tuple[dict[str, Any], OpSpec, Problem, Target, Config]]:
    out = []
    cache: dict[tuple[str, str], Problem] = {}
    for r in records:
        if not r.get("ok"):
            continue
        op = get_op(r["op"])
        target = Target.named(r["arch"])
        p = cache.get((r["op"], r["problem"]))
        if p is None:
            p = cache[(r["op"], r["problem"])] = op.problem_from_key(r["problem"])
        c = Config.of(r["config"])
        if op.validate(p, c, target):  # a config of an older space or rule: not what runs today
            out.append((r, op, p, target, c))
    return out


def best_configs(records: Iterable[dict[str, Any]], per_problem: int = WINNERS_PER_PROBLEM) -> dict[str, list[dict[str, Any]]]:
    """Per op, the best `per_problem` distinct configs of every recorded problem (fastest first,
    problems in order of first appearance)."""
    return _merge_winners(_problem_winners(records, per_problem))


def _problem_winners(records: Iterable[dict[str, Any]], per_problem: int = WINNERS_PER_PROBLEM,
                     ) -> list[tuple[tuple[str, str], list[dict[str, Any]]]]:
    """`best_configs` per problem: ((op, problem key), its best configs), problems in order of
    first appearance (a problem timed on two archs appears once per arch)."""
    out = []
    for (op, _, key), recs in recmod_by_problem(records):
        times = timed_configs(recs)
        if times:
            out.append(((op, key), [c.as_dict() for c in sorted(times, key=lambda c: (times[c], c.key()))[:per_problem]]))
    return out


def _merge_winners(per_problem: Iterable[tuple[tuple[str, str], list[dict[str, Any]]]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for (op, _), configs in per_problem:
        lst = out.setdefault(op, [])
        for c in configs:
            if c not in lst:
                lst.append(c)
    return out


def fit(records: Iterable[dict[str, Any]], ridge: float = RIDGE) -> CostModel:
    """Fit the constants on records (see the module doc): for each (floor, knee) of a small grid,
    ridge-regress the weights on within-problem differences of log(time - launches x floor) -
    log(roofline), toward the priors; intercept per op; keep the grid point of least squared
    log error. Then the residual table of the measured correction (`_residual_table`). Deterministic.
    (`FitData` prepares the records once for several fits.)"""
    return FitData(records).fit(ridge)


class FitData:
    """Records prepared for `fit`: every usable record validated and its geometry worked out once
    (most of a fit's CPU time). `fit(exclude=(op, problem key))` fits on every record but that
    problem's, as `fit` does on those records (leave-one-out, the replays' held-out models), and
    remembers the model: the models it returns are shared, do not change them. `extended` prepares
    only the records it adds."""

    def __init__(self, records: Iterable[dict[str, Any]]):
        self.records = list(records)
        self._set(*_prepare(self.records))

    def extended(self, records: Iterable[dict[str, Any]]) -> "FitData":
        """This data with `records` appended (only those are prepared)."""
        more = list(records)
        rows, geos = _prepare(more)
        out = FitData.__new__(FitData)
        out.records = self.records + more
        out._set(self.rows + rows, self.geos + geos)
        return out

    def _set(self, rows: list, geos: list[Geometry]) -> None:
        self.rows, self.geos = rows, geos
        self.t_obs = np.array([float(r["time_us"]) for r, *_ in rows])
        self.n_l = np.array([g.launches for g in geos], dtype=np.float64)
        self.roof = np.array([g.log_roof for g in geos])
        self.phi = np.array([g.phi for g in geos], dtype=np.float64).reshape(len(geos), len(TERM_NAMES))
        self.log_inflight = np.array([g.log_inflight for g in geos])
        self._winners: list[tuple[tuple[str, str], list[dict[str, Any]]]] | None = None
        self._fits: dict[tuple[float, tuple[str, str] | None], CostModel] = {}

    def fit(self, ridge: float = RIDGE, exclude: tuple[str, str] | None = None) -> CostModel:
        """The model `fit` gives on these records without those of problem `exclude`
        ((op, problem key), on every arch), remembered."""
        key = (ridge, exclude)
        if key not in self._fits:
            self._fits[key] = self._fit(ridge, exclude)
        return self._fits[key]

    def fitted(self, ridge: float = RIDGE, exclude: tuple[str, str] | None = None) -> CostModel | None:
        """The model `fit(ridge, exclude)` has made, or None (nothing is fit)."""
        return self._fits.get((ridge, exclude))

    def remember(self, model: CostModel, ridge: float = RIDGE, exclude: tuple[str, str] | None = None) -> None:
        """Keep `model` as `fit(ridge, exclude)`'s answer: made from these records elsewhere (a
        worker process of `replay.replay_sweeps`)."""
        self._fits.setdefault((ridge, exclude), model)

    def _fit(self, ridge: float, exclude: tuple[str, str] | None) -> CostModel:
        if exclude is None:
            keep = list(range(len(self.rows)))
        else:
            keep = [i for i, (r, *_) in enumerate(self.rows) if (r["op"], r["problem"]) != exclude]
        if not keep:
            raise ModelError("no usable record to fit on")
        rows = [self.rows[i] for i in keep]
        idx = np.array(keep, dtype=np.intp)
        t_obs, n_l, roof = self.t_obs[idx], self.n_l[idx], self.roof[idx]
        phi_base, log_inflight = self.phi[idx], self.log_inflight[idx]
        ops = [op.name for _, op, *_ in rows]
        group_of: dict[tuple[str, str, str], int] = {}
        gid = np.array([group_of.setdefault((r["op"], r["arch"], r["problem"]), len(group_of)) for r, *_ in rows])
        counts = np.bincount(gid)
        wrow = 1.0 / np.sqrt(counts[gid])  # each problem weighs sqrt(its records): sweeps do not drown the rest
        # and each op weighs the same in all: GroupNorm forward holds most records (its broad grid and
        # sweeps); unbalanced, it set the shared weights for every op, and the held-out pooling
        # picks got up to 2x worse (bench/results/heldout/runs/README.md)
        names, op_idx = np.unique(np.array(ops), return_inverse=True)
        op_sum = np.bincount(op_idx, weights=wrow)
        wrow = wrow * (len(wrow) / (len(op_sum) * op_sum[op_idx]))
        multi = counts[gid] > 1
        W = wrow * multi
        # per op (sorted names): its rows, their weights and the weights' sum, the same at every grid point
        per_op = []
        for i, name in enumerate(names):
            m = np.flatnonzero(op_idx == i)
            per_op.append((str(name), m, wrow[m], np.sum(wrow[m])))
        log_t = np.log(t_obs)
        wsum = np.sum(wrow)
        # every term but "par" (column 0, which moves with the knee) is demeaned and weighted once
        pc = _demean_cols(phi_base, gid)
        pcw = pc * W[:, None]
        devices = sorted({r["device"] for r, *_ in rows})
        best: tuple[float, CostModel] | None = None
        if self._winners is None:
            self._winners = _problem_winners(self.records)
        # the same for every grid point: once, not per improvement
        winners = _merge_winners(w for w in self._winners if w[0] != exclude)
        for floor, frac in ((f, x) for f in FLOOR_GRID for x in FLOOR_NEXT_GRID):
            fl = launch_floor(n_l, floor, frac * floor)
            z = np.log(np.maximum(t_obs - fl, 0.25 * t_obs)) - roof
            zc = _demean(z, gid)
            for need in NEED_GRID:
                phi = phi_base.copy()
                phi[:, 0] = np.maximum(0.0, math.log(need) - log_inflight)
                pc[:, 0] = _demean(phi[:, 0], gid)
                pcw[:, 0] = pc[:, 0] * W
                A = pc.T @ pcw + ridge * np.eye(len(TERM_NAMES))
                w = np.linalg.solve(A, pc.T @ (zc * W) + ridge * PRIOR)
                resid = z - phi @ w
                inter = {name: float(np.sum(resid[m] * wm) / wm_sum) for name, m, wm, wm_sum in per_op}
                b = np.array([inter[str(n)] for n in names])[op_idx]
                pred = np.log(fl + np.exp(roof + b + phi @ w))
                loss = float(np.sum(wrow * (log_t - pred) ** 2) / wsum)
                if best is None or loss < best[0] - 1e-12:
                    stats = {"records": len(rows), "problems": len(group_of), "ridge": ridge,
                             "rms_log_error": round(math.sqrt(loss), 4), "devices": devices}
                    best = (loss, CostModel(w, inter, floor, need, HOST, winners, stats,
                                            floor_next_us=frac * floor))
        assert best is not None
        model = best[1]
        phi = phi_base.copy()
        phi[:, 0] = np.maximum(0.0, math.log(model.need_bytes) - log_inflight)
        model.residuals = _residual_table(model, rows, phi, n_l, roof, t_obs)
        return model


_packaged_data: list[tuple[list[dict[str, Any]], FitData]] = []
_data_lock = threading.Lock()


def packaged_fit_data() -> FitData:
    """`FitData` of the shipped records (ckgen/data/records.jsonl.gz, `records.read_cached`),
    prepared once per version of the file: the held-out fits of the replays and of leave-one-out
    are made once and shared (the models are shared too: do not change them)."""
    from . import records as recmod

    recs = recmod.read_cached(recmod.packaged_records_path())
    with _data_lock:
        if not _packaged_data or _packaged_data[0][0] is not recs:
            _packaged_data[:] = [(recs, FitData(recs))]
        return _packaged_data[0][1]


def _prepare(records: list[dict[str, Any]]) -> tuple[list, list[Geometry]]:
    from . import records as recmod

    rows = _usable_records(records)
    geos = [geometry(op, p, c, t, narrow_rows=recmod.kernel_version(r) >= NARROW_ROWS_FROM_KERNEL_VERSION)
            for r, op, p, t, c in rows]
    return rows, geos


def _residuals_ok(v: Any, arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> bool:
    """One op's residual table is well formed (indices in range, knob values scalars, residuals
    finite and within MAX_RESIDUAL). `arrays`: its problem, config and residual lists as integer,
    integer and float arrays (the parse cache's), checked in their place."""
    keys = ("knobs", "problems", "configs", "problem", "config", "residual")
    if not isinstance(v, dict) or not all(isinstance(v.get(k), list) for k in keys):
        return False
    n_p, n_c, n_k, n = len(v["problems"]), len(v["configs"]), len(v["knobs"]), len(v["residual"])
    return (len(v["problem"]) == len(v["config"]) == n
            and all(isinstance(k, str) for k in v["knobs"])
            and all(isinstance(q, list) and len(q) == 2 and all(isinstance(x, str) for x in q) for q in v["problems"])
            and all(isinstance(c, list) and len(c) == n_k for c in v["configs"])
            and {type(x) for c in v["configs"] for x in c} <= _KNOB_TYPES
            and (_arrays_ok(arrays, n, n_p, n_c) if arrays is not None else
                 _indices_ok(v["problem"], n_p) and _indices_ok(v["config"], n_c)
                 and _finite_numbers(v["residual"], MAX_RESIDUAL)))


def _arrays_ok(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], n: int, n_p: int, n_c: int) -> bool:
    """`_residuals_ok`'s index and residual checks on arrays (problem, config, residual)."""
    pi, ci, res = arrays
    if not (pi.dtype.kind in "iu" and ci.dtype.kind in "iu" and res.dtype.kind == "f"
            and len(pi) == len(ci) == len(res) == n):
        return False
    return not n or (int(pi.min()) >= 0 and int(pi.max()) < n_p and int(ci.min()) >= 0 and int(ci.max()) < n_c
                     and bool(np.isfinite(res).all()) and float(np.abs(res).max()) <= MAX_RESIDUAL)


# A knob's value in a model file: what a tuning space holds (None: a knob the config lacks, in
# the residual table). A list or dict would reach Config's hash and fail every unseen problem.
_KNOB_TYPES = frozenset({str, int, float, bool, type(None)})


def _config_ok(c: Any) -> bool:
    return isinstance(c, dict) and all(isinstance(k, str) and type(v) in _KNOB_TYPES for k, v in c.items())


def _number(x: Any) -> float:
    """A JSON number as a float (not a bool or a string, which float() would take); ModelError
    otherwise. Not finite: nan, which every range check rejects."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ModelError(f"expected a number, got {str(x)[:40]!r} ({type(x).__name__})")
    try:
        return float(x)
    except OverflowError:  # an int beyond a float
        return math.nan


def _mapping(x: Any, what: str) -> dict:
    if not isinstance(x, dict):
        raise ModelError(f"{what!r} is not a mapping")
    return x


def _vector(xs: list, kinds: str) -> np.ndarray | None:
    """`xs` as a 1-D array whose dtype kind is in `kinds` (vectorised checks: the residual tables
    hold ~60k entries), else None."""
    try:
        a = np.asarray(xs if xs else [0])
    except (ValueError, TypeError):
        return None
    return a if a.ndim == 1 and a.dtype.kind in kinds else None


def _indices_ok(xs: list, n: int) -> bool:
    """Every item an int in [0, n)."""
    a = _vector(xs, "i")
    return a is not None and (not xs or (int(a.min()) >= 0 and int(a.max()) < n))


def _finite_numbers(xs: list, bound: float = math.inf) -> bool:
    a = _vector(xs, "if")
    return a is not None and bool(np.isfinite(a).all()) and (not xs or float(np.abs(a).max()) <= bound)


def _residual_table(model: CostModel, rows, phi: np.ndarray, n_l: np.ndarray, roof: np.ndarray,
                    t_obs: np.ndarray) -> dict[str, dict[str, Any]]:
    """Per op, how far off the model is for each recorded (problem, config): log(time) -
    log(predicted GPU time), demeaned within each problem (the fastest time of a config). `phi`,
    `n_l` (launches) and `roof` (log roofline) are the rows' terms at the model's knee."""
    b = np.array([model.intercepts[op.name] for _, op, *_ in rows])
    pred = model.launch_us(n_l) + np.exp(roof + b + phi @ model.weights)
    resids = (np.log(t_obs) - np.log(pred)).tolist()
    by: dict[tuple[str, str, str], dict[Config, float]] = {}
    for (r, op, p, t, c), res in zip(rows, resids):
        g = by.setdefault((op.name, r["arch"], r["problem"]), {})
        if c not in g or res < g[c]:
            g[c] = res
    out: dict[str, dict[str, Any]] = {}
    for (name, arch, key), g in sorted(by.items()):
        if len(g) < 2:
            continue  # one timing says nothing about one config against another
        doc = out.setdefault(name, {"problems": [], "configs": [], "problem": [], "config": [], "residual": [],
                                    "_ci": {}})
        pi = len(doc["problems"])
        doc["problems"].append([arch, key])
        mean = sum(g.values()) / len(g)
        for c in sorted(g, key=Config.key):
            ci = doc["_ci"].setdefault(c, len(doc["configs"]))
            if ci == len(doc["configs"]):
                doc["configs"].append(c.as_dict())
            doc["problem"].append(pi)
            doc["config"].append(ci)
            doc["residual"].append(round(g[c] - mean, 4))
    for doc in out.values():  # configs as value lists under one list of knob names: a smaller file
        del doc["_ci"]
        knobs = sorted({k for c in doc["configs"] for k in c})
        doc["knobs"] = knobs
        doc["configs"] = [[c.get(k) for k in knobs] for c in doc["configs"]]
    return out


def _demean(v: np.ndarray, gid: np.ndarray) -> np.ndarray:
    sums = np.bincount(gid, weights=v)
    return v - (sums / np.bincount(gid))[gid]


def _demean_cols(m: np.ndarray, gid: np.ndarray) -> np.ndarray:
    return np.column_stack([_demean(m[:, j], gid) for j in range(m.shape[1])])


def dumps(model: CostModel) -> str:
    """The model file's text: one line per top-level key, its value compact (deterministic)."""
    doc = model.to_doc()
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(doc[k], sort_keys=True, separators=(',', ':'))}"
                      for k in sorted(doc))
    return "{\n" + body + "\n}\n"


# ---------------------------------------------------------------------------------- loading


def packaged_model_path() -> Path:
    import importlib.resources

    return Path(str(importlib.resources.files("ckgen") / "data" / "costmodel.json"))


def user_model_path() -> Path:
    """Where `python -m ckgen.costmodel fit` writes: beside the user DB."""
    from . import settings

    db = settings.user_db_path()
    return db.with_name(f"{db.stem}.costmodel.json")


def model_path() -> Path | None:
    """The model file in use: $CKGEN_MODEL ("off": none), else the user's, else the packaged one."""
    env = os.environ.get(ENV_MODEL, "")
    if env.lower() in ("off", "0", "none"):
        return None
    if env:
        return Path(env)
    user = user_model_path()
    return user if user.exists() else packaged_model_path()


_lock = threading.Lock()
_loaded: dict[tuple[str, int, int], CostModel | None] = {}
_warned: set[str] = set()


def load() -> CostModel | None:
    """The model in use, or None (disabled, or its file missing or corrupt: one ModelWarning per
    file, and the dispatcher falls back to nearest-tuned). Cached per file version."""
    path = model_path()
    if path is None:
        return None
    try:
        st = path.stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
    except OSError:
        key = (str(path), -1, -1)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        try:
            if key[1] < 0:
                raise ModelError("the file is missing")
            raw = path.read_bytes()
            model = _parsed_get(raw, path)
            if model is None:
                doc = json.loads(raw.decode("utf-8"))
                model = CostModel.from_doc(doc)
                _parsed_put(raw, doc)
        except (ModelError, OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            model = None
            _warn_once(path, e)
        _loaded[key] = model
        return model


# The parse cache (ckgen/parsecache.py) of a model file: reading the packaged one costs ~60 ms
# of CPU (json of ~250,000 numbers, then the residual tables' checks), and an unseen problem's
# pick needs the residual table of its op alone. So what a model file of at least
# PARSED_MIN_BYTES holds is kept as the document less its residual tables (read and checked by
# `from_doc` as from the file) and each op's table packed (its index and residual lists as
# little-endian arrays in base64, the rest as JSON text), unpacked and checked (`_residuals_ok`,
# as `from_doc` checks it) when the op is first asked about (`_PackedTables`). A table that
# fails its check there is taken from the model file instead (parsed whole, once) and the cache
# file is removed. Kept only when the unpacked tables are the file's exactly (value kinds too).
PARSED_FORMAT = "ckgen-costmodel-parsed"
PARSED_VERSION = 1
PARSED_MIN_BYTES = 64 * 1024
_TABLE_KEYS = ("knobs", "problems", "configs", "problem", "config", "residual")


def _parsed_key(raw: bytes) -> str | None:
    from . import parsecache

    return parsecache.key("model", raw, PARSED_FORMAT, str(PARSED_VERSION))


def _pack(xs: list, dtype: str) -> str:
    import base64

    return base64.b64encode(np.asarray(xs, dtype=dtype).tobytes()).decode("ascii")


def _unpack(text: Any, dtype: str, n: int) -> np.ndarray:
    import base64

    if type(text) is not str:
        raise ValueError("not packed")
    a = np.frombuffer(base64.b64decode(text, validate=True), dtype=dtype)
    if len(a) != n:
        raise ValueError("length")
    return a


def _index_dtype(n: int) -> str:
    return "<u2" if n <= 0xFFFF else "<u4"


def _packed_table(t: dict[str, Any]) -> dict[str, Any] | None:
    """One residual table packed, None if unpacking would not give it back exactly."""
    if set(t) != set(_TABLE_KEYS) or len(t["problems"]) > 0xFFFFFFFF or len(t["configs"]) > 0xFFFFFFFF:
        return None
    if not (all(type(x) is int for x in t["problem"]) and all(type(x) is int for x in t["config"])
            and all(type(x) is float for x in t["residual"])):
        return None
    return {"knobs": t["knobs"], "problems": json.dumps(t["problems"], separators=(",", ":")),
            "configs": json.dumps(t["configs"], separators=(",", ":")), "n": len(t["residual"]),
            "problem": _pack(t["problem"], _index_dtype(len(t["problems"]))),
            "config": _pack(t["config"], _index_dtype(len(t["configs"]))),
            "residual": _pack(t["residual"], "<f8")}


def _unpacked_table(p: Any) -> tuple[dict[str, Any], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A packed table back, checked as `from_doc` checks one, and its problem, config and
    residual lists as arrays (what `_ResidualIndex` reads); ValueError if it fails. The arrays
    are checked as they are (unpacked: ints and floats by construction), not as lists again."""
    if type(p) is not dict or type(p.get("n")) is not int or type(p.get("problems")) is not str \
            or type(p.get("configs")) is not str:
        raise ValueError("packed table")
    problems, configs, n = json.loads(p["problems"]), json.loads(p["configs"]), p["n"]
    if type(problems) is not list or type(configs) is not list:
        raise ValueError("packed table")
    arrays = (_unpack(p.get("problem"), _index_dtype(len(problems)), n),
              _unpack(p.get("config"), _index_dtype(len(configs)), n),
              _unpack(p.get("residual"), "<f8", n))
    t = {"knobs": p.get("knobs"), "problems": problems, "configs": configs,
         "problem": arrays[0].tolist(), "config": arrays[1].tolist(), "residual": arrays[2].tolist()}
    if not _residuals_ok(t, arrays):
        raise ValueError("residual table")
    return t, arrays


class _PackedTables(Mapping):
    """A model's residual tables (op -> table) from the parse cache, each unpacked and checked
    when first asked for; a table that fails is taken from the model file instead."""

    def __init__(self, packed: dict[str, Any], path: Path, key: str) -> None:
        self._packed, self._path, self._key = packed, path, key
        self._tables: dict[str, dict[str, Any]] = {}
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._spoiled: dict[str, dict[str, Any]] | None = None  # the file's tables, once one failed
        self._lock = threading.Lock()

    def __getitem__(self, op: str) -> dict[str, Any]:
        t = self._tables.get(op)
        if t is None:
            with self._lock:
                t = self._tables.get(op)
                if t is None:
                    t = self._tables[op] = self._unpacked(op)
        return t

    def arrays(self, op: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Op's table's problem, config and residual lists as arrays (None: its table is the
        model file's, after a spoiled cache file)."""
        self[op]
        return self._arrays.get(op)

    def _unpacked(self, op: str) -> dict[str, Any]:
        packed = self._packed[op]  # KeyError: no table of this op
        if self._spoiled is None:
            try:
                t, self._arrays[op] = _unpacked_table(packed)
                return t
            except Exception:  # noqa: BLE001 - a spoiled cache file: the model file's tables instead
                from . import parsecache

                parsecache.forget("model", self._key)
                self._spoiled = self._file_tables()
        return self._spoiled[op]

    def _file_tables(self) -> dict[str, dict[str, Any]]:
        """The model file's residual tables (its bytes still those of the key), checked by from_doc."""
        try:
            raw = self._path.read_bytes()
            if _parsed_key(raw) != self._key:
                raise ModelError("the file changed since it was read")
            tables = CostModel.from_doc(json.loads(raw.decode("utf-8"))).residuals
        except (ModelError, OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ModelError(f"its residual tables cannot be read again ({str(e)[:200]})") from None
        if set(tables) != set(self._packed):
            raise ModelError("its residual tables cannot be read again (the file changed)")
        return tables

    def __iter__(self):
        return iter(self._packed)

    def __len__(self) -> int:
        return len(self._packed)


def _parsed_get(raw: bytes, path: Path) -> CostModel | None:
    """The model of these bytes from the parse cache (None: not there, or spoiled)."""
    if len(raw) < PARSED_MIN_BYTES:
        return None
    from . import parsecache

    try:
        key = _parsed_key(raw)
        data = parsecache.read("model", key) if key is not None else None
        if data is None:
            return None
        doc = json.loads(data)
        if (type(doc) is not dict or doc.get("format") != PARSED_FORMAT or doc.get("version") != PARSED_VERSION
                or doc.get("key") != key or type(doc.get("head")) is not dict or type(doc.get("tables")) is not dict
                or "residuals" in doc["head"]):
            return None
        model = CostModel.from_doc(doc["head"])
        model.residuals = _PackedTables(doc["tables"], path, key)
        return model
    except Exception:  # noqa: BLE001 - not JSON, too deep, a head from_doc refuses: not used
        return None


def _parsed_put(raw: bytes, doc: dict[str, Any]) -> None:
    """Keep the model document `doc` (read from `raw`, accepted by from_doc) in the parse cache."""
    if len(raw) < PARSED_MIN_BYTES:
        return
    from . import parsecache

    with contextlib.suppress(Exception):
        key = _parsed_key(raw)
        tables = {op: _packed_table(t) for op, t in (doc.get("residuals") or {}).items()}
        if key is None or any(t is None for t in tables.values()):
            return
        head = {k: v for k, v in doc.items() if k != "residuals"}
        parsecache.write("model", key, json.dumps({"format": PARSED_FORMAT, "version": PARSED_VERSION, "key": key,
                                                   "head": head, "tables": tables},
                                                  ensure_ascii=True, separators=(",", ":")))


def _warn_once(path: Path | None, e: Exception) -> None:
    """One ModelWarning per model file: it cannot be used, the dispatcher falls back."""
    if str(path) in _warned:
        return
    _warned.add(str(path))
    warnings.warn(f"ckgen cost model {path}: {str(e)[:300]}; unseen problems get the nearest tuned "
                  "problem's winner instead", ModelWarning, stacklevel=4)


def top_configs(op: OpSpec, p: Problem, target: Target, count: int, allowed: Callable[[Config], bool],
                model: CostModel | None = None, extra_winners: Iterable[Config] = ()) -> list[Config]:
    """The model's `count` best candidates that `allowed` accepts (the tuner's first seeds);
    none without a model. `model`: this one instead of the one in use (`load()`), e.g. one fit
    without the tuned problem's records for a replay. `extra_winners` join the model file's
    winners at the head of the candidate walk (`tune.model_picks`: the recorded winners carried
    with their grid, `carried_winners`)."""
    model = model if model is not None else load()
    if model is None or count <= 0:
        return []
    cands, near = candidate_tiers(op, p, target, [*extra_winners, *model.winner_configs(op)],
                                  lambda c: bool(allowed(c)))
    try:
        return [c for _, c in model.select(op, p, cands, near, target)[:count]]
    except ModelError as e:  # a prediction that is not finite: no seeds from this model
        _warn_once(model_path(), e)
        return []


# ---------------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    import argparse

    from . import records as recmod

    ap = argparse.ArgumentParser(prog="python -m ckgen.costmodel", description="Fit the config cost model.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit on the shipped records and yours; write the model beside the user DB")
    f.add_argument("--out", type=Path, default=None, help=f"model file (default: {user_model_path()})")
    f.add_argument("--no-user", action="store_true", help="the shipped records only")
    args = ap.parse_args(argv)
    # fit(recmod.all_records(...)), with the shipped records prepared as the process's other fits use them
    user = [] if args.no_user else recmod.read_cached(recmod.user_records_path())
    data = packaged_fit_data()
    model = data.extended(user).fit() if user else data.fit()
    out = args.out or user_model_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(model))
    print(f"wrote {out}: {model.summary()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ---------------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class LooResult:
    """One recorded problem held out: the model fit without its records picks among its
    candidates that the records time; ratios are recorded time / the problem's recorded best."""

    op: str
    problem: str
    layout: str
    recorded: int  # configs with a recorded time
    candidates: int  # candidates with a recorded time
    model: float  # the model's pick
    oracle: float  # the best candidate (what a perfect ranking of the candidates would give)
    nearest: float  # the nearest other recorded problem's winner (today's fallback), if recorded
    default: float  # the space default (or the valid recorded config nearest it)
    near_only: float = math.nan  # the model's pick among the near tier alone (the rule before the wide tier)


from .records import SWEEP_SOURCE  # noqa: E402 - the `source` of the records from the repo's exhaustive sweeps


def leave_one_out(records: "Sequence[dict[str, Any]] | FitData", min_recorded: int = 50,
                  fitter: Callable[[list[dict[str, Any]]], "CostModel"] | None = None,
                  as_dispatched: bool = False, source: str | None = SWEEP_SOURCE) -> list[LooResult]:
    """For every problem with at least `min_recorded` timed configs (2: every recorded problem
    with a choice) and, unless `source` is None, records whose source starts with `source` (the
    default: the exhaustive sweeps; a problem tuned at 40 trials more than once also reaches 50
    timed configs, but its best is not the space's): fit (`fitter`, default `fit`) on every other
    problem's records, let the model pick among the candidates the records time, and compare with
    the best recorded, the candidates' best, the nearest-tuned fallback and the default.

    `as_dispatched`: the candidates are those the dispatcher would rank (`candidate_tiers` with
    every valid config usable) that the records time, each tier kept; else (and when none of
    those is timed) the search for candidates counts only timed configs as usable, so its near
    tier reaches further. The pick is `select`'s (the two tiers), `near_only` the near tier's.

    `records` may be a `FitData`: its records, prepared once for every held-out fit (without a
    `fitter`), and the fits stay with it (`packaged_fit_data()`: shared with the replays)."""
    data = records if isinstance(records, FitData) else None
    records = data.records if data is not None else records
    if fitter is None:
        data = data if data is not None else FitData(records)
    out = []
    for (op_name, arch, key), recs in recmod_by_problem(records):
        timed = timed_configs(recs)
        if len(timed) < min_recorded:
            continue
        if source is not None and not any(str(r.get("source", "")).startswith(source) for r in recs):
            continue
        op, target = get_op(op_name), Target.named(arch)
        p = op.problem_from_key(key)
        rest = [r for r in records if (r["op"], r["problem"]) != (op_name, key)]
        model = fitter(rest) if fitter is not None else data.fit(exclude=(op_name, key))
        best = min(timed.values())
        usable = lambda c: c in timed and bool(op.validate(p, c, target))  # noqa: E731
        cands: list[Config] = []
        n_near = 0
        if as_dispatched:
            every, n = candidate_tiers(op, p, target, model.winner_configs(op), lambda c: bool(op.validate(p, c, target)))
            cands = [c for c in every if c in timed]
            n_near = sum(c in timed for c in every[:n])
        if not cands:
            cands, n_near = candidate_tiers(op, p, target, model.winner_configs(op), usable)
        pick = model.select(op, p, cands, n_near, target)[0][1]
        near_pick = model.rank(op, p, cands[:n_near], target)[0][1] if n_near else pick
        # today's fallback: the winner of the nearest other recorded problem whose winner is usable here
        near = nearest_recorded_winner(rest, op, p, arch, usable)
        near_cfg = near[0] if near else None
        dflt = op.space.nearest_default(usable)
        out.append(LooResult(op_name, key, p.layout, len(timed), len(cands), timed[pick] / best,
                             min(timed[c] for c in cands) / best,
                             timed[near_cfg] / best if near_cfg is not None else math.nan,
                             timed[dflt] / best if dflt is not None else math.nan,
                             timed[near_pick] / best))
    return out


def timed_configs(records: Iterable[dict[str, Any]]) -> dict[Config, float]:
    """The fastest recorded time of each config among (one problem's) records."""
    timed: dict[Config, float] = {}
    for r in records:
        if r.get("ok"):
            c = Config.of(r["config"])
            timed[c] = min(timed.get(c, math.inf), float(r["time_us"]))
    return timed


def nearest_recorded_winner(records: Iterable[dict[str, Any]], op: OpSpec, p: Problem, arch: str,
                            usable: Callable[[Config], bool]) -> tuple[Config, str] | None:
    """The winner of the nearest recorded problem of this op and arch (op.distance) that
    `usable` accepts, and that problem's key."""
    got = nearest_recorded_winners(records, op, p, arch, usable, 1)
    return got[0] if got else None


def nearest_recorded_winners(records: Iterable[dict[str, Any]], op: OpSpec, p: Problem, arch: str,
                             usable: Callable[[Config], bool], count: int) -> list[tuple[Config, str]]:
    """The `count` distinct winners (fastest recorded config of each problem) of the nearest
    recorded problems of this op and arch (op.distance) that `usable` accepts, nearest first, each
    with its problem's key; a winner shared by several problems counts once, with the nearest."""
    wins = {k: c for c, k in recorded_winners(records, op, arch)}
    out: list[tuple[Config, str]] = []
    for k in sorted(wins, key=lambda k: op.distance(p, op.problem_from_key(k))):
        c = wins[k]
        if len(out) >= count:
            break
        if all(c != o for o, _ in out) and usable(c):
            out.append((c, k))
    return out


def recmod_by_problem(records: Iterable[dict[str, Any]]):
    from .records import by_problem

    return by_problem(records)


SPLIT_KNOBS = ("global_split", "split")  # blocks per slice, beyond a cluster's (GroupNorm)


def _blocks(op: OpSpec, p: Problem, c: Config, target: Target) -> int:
    return op.main_blocks(p, c, target)


def grid_matched(op: OpSpec, q: Problem, p: Problem, c: Config, target: Target,
                 valid: Callable[[Config], bool] | None = None) -> Config | None:
    """A winner `c` of problem q carried to problem p with its split knob (`SPLIT_KNOBS`) set so
    that p's grid has about as many blocks as q's had: a winner tuned at batch 16 with 8 blocks
    per slice runs 128 blocks there, and at batch 1 the same config would leave most SMs idle
    (GroupNorm forward rows, 1x4x1024x1024: 64 blocks 19-25 us, 128 blocks 17.5-18 us on a
    132-SM part). None when the op has no split knob, c has no split (1: one block per slice is the
    config's design), or the matched value is c's own or invalid for p."""
    knob = next((k for k in SPLIT_KNOBS if k in op.space.params), None)
    if knob is None or c.as_dict().get(knob, 1) <= 1:
        return None
    try:
        want = _blocks(op, q, c, target)
    except (ValueError, KeyError, ZeroDivisionError):
        return None

    if valid is None:
        def valid(cv: Config) -> bool:
            return bool(op.space.check(cv)) and bool(op.validate(p, cv, target))

    # The scan over the knob's values keeps the first valid value whose distance beats the best so
    # far by 1e-9: the valid value of least distance, the earliest of equal ones. It is found by
    # validating the values nearest first (one or two validate calls, not one per value); a
    # distance that cannot be computed ends the scan with None if its value is valid, as before.
    dists: list[tuple[float, int, Config]] = []
    for i, v in enumerate(op.space.params[knob]):
        if v <= 1:
            continue
        cv = _replaced(c, knob, v)
        try:
            dists.append((abs(math.log(_blocks(op, p, cv, target) / want)), i, cv))
        except (ValueError, KeyError, ZeroDivisionError):
            if valid(cv):
                return None
    ds = sorted(d for d, _, _ in dists)
    if any(0 < b - a <= 1e-9 for a, b in zip(ds, ds[1:])):  # near-ties: the scan itself decides
        best, best_d = None, None
        for d, _, cv in dists:
            if (best_d is None or d < best_d - 1e-9) and valid(cv):
                best, best_d = cv, d
    else:
        best = next((cv for _, _, cv in sorted(dists, key=lambda x: (x[0], x[1])) if valid(cv)), None)
    return best if best is not None and best != c else None


_REPLACED: dict[tuple[Config, str, Any], Config] = {}


def _replaced(c: Config, knob: str, v: Any) -> Config:
    """c.replace(knob=v), remembered (the DB winners' split variants, for every unseen problem)."""
    key = (c, knob, v)
    out = _REPLACED.get(key)
    if out is None:
        if len(_REPLACED) > 100_000:
            _REPLACED.clear()
        out = _REPLACED[key] = c.replace(**{knob: v})
    return out


def carried_winners(op: OpSpec, p: Problem, target: Target, winners: Iterable[tuple[Config, str]],
                    ) -> list[Config]:
    """The `grid_matched` carries to p of (config, its problem's key) winners that have one, in
    their order, distinct: the candidates a winner of another batch size or shape adds beside
    itself (`dispatch_pick` from the DB entries, `tune.model_picks` from the records)."""
    winners = list(winners)
    valid = _split_validity(op, p, target, [c for c, _ in winners])
    out: list[Config] = []
    for c, key in winners:
        g = grid_matched(op, _problem_of(op, key), p, c, target, valid)
        if g is not None and g not in out:
            out.append(g)
    return out


def _split_validity(op: OpSpec, p: Problem, target: Target,
                    configs: Sequence[Config]) -> Callable[[Config], bool] | None:
    """`grid_matched`'s validity test (a point of the space that op.validate accepts for p) of
    the split variants of `configs`, with the space and class checks of them all made at once on
    the space's lattice (remembered per process and problem class, as the candidate walk's):
    then only `op.shape_check` per variant asked. None where the op has no split knob, no class
    check or a variant is off the lattice (grid_matched then asks validate itself)."""
    knob = next((k for k in SPLIT_KNOBS if k in op.space.params), None)
    if knob is None or not configs or op.problem_class(p) is None:
        return None
    lat = _lattice(op.space)
    if lat is None:
        return None
    variants = list(dict.fromkeys(_replaced(c, knob, v) for c in configs if c.as_dict().get(knob, 1) > 1
                                  for v in op.space.params[knob] if v > 1))
    codes = lat.encode_all(variants)
    if codes is None:
        return None
    admit = _class_filter(op, p, target, lat)
    ok = set(admit(lat.space_points(np.asarray(codes, dtype=np.int64))).tolist())
    known = dict(zip(variants, codes))

    def valid(cv: Config) -> bool:
        code = known.get(cv)
        if code is None:  # not one of the variants: validate itself
            return bool(op.space.check(cv)) and bool(op.validate(p, cv, target))
        return code in ok and bool(op.shape_check(p, cv, target))

    return valid


def recorded_winners(records: Iterable[dict[str, Any]], op: OpSpec, arch: str) -> list[tuple[Config, str]]:
    """The winner (fastest recorded config) of every recorded problem of this op and arch, with
    its problem's key, in the order of the problems' first records."""
    wins: dict[str, tuple[float, Config]] = {}
    for r in records:
        if r["op"] == op.name and r["arch"] == arch and r.get("ok"):
            t = float(r["time_us"])
            if r["problem"] not in wins or t < wins[r["problem"]][0]:
                wins[r["problem"]] = (t, Config.of(r["config"]))
    return [(c, k) for k, (_, c) in wins.items()]


def dispatch_pick(op: OpSpec, p: Problem, target: Target, entries: Sequence[Any],
                  usable: Callable[[Config], bool], accept: Callable[[Config], bool] | None = None,
                  admitted: Callable[[Config], bool] | None = None,
                  ) -> tuple[Config, Prediction, int, str | None] | None:
    """The dispatcher's question for a problem no usable DB entry covers: the model's best
    candidate (the DB entries' winners of this op on this vendor, nearest problem first, join
    the recorded ones), or a tuned sibling's winner it does not beat by NEAREST_MARGIN; its
    prediction, the candidate count and the sibling's problem key (None: the model's own pick);
    None without a model. `accept`: the compiled check an untuned pick must pass
    (`library.spill_free`), asked of the model's best few and of the sibling's winner.
    `admitted`: `usable` for configs of the space that `op.class_check` admits (`candidate_tiers`)."""
    model = load()
    if model is None:
        return None
    try:
        return _dispatch_pick(model, op, p, target, entries, usable, accept, admitted)
    except ModelError as e:  # a prediction that is not finite: the nearest-tuned fallback, as without a model
        _warn_once(model_path(), e)
        return None


_PARSED: dict[tuple[str, str], Problem] = {}
_ENTRY_CONFIGS: dict[tuple[str, int, tuple], Config | None] = {}


def _problem_of(op: OpSpec, key: str) -> Problem:
    """op.problem_from_key, remembered: every unseen problem's pick orders the DB entries of its op
    by their problems' distance, and parsing their keys again each time cost milliseconds."""
    p = _PARSED.get((op.name, key))
    if p is None:
        if len(_PARSED) > 100_000:
            _PARSED.clear()
        p = _PARSED[(op.name, key)] = op.problem_from_key(key)
    return p


def _entry_config(op: OpSpec, e: Any) -> Config | None:
    """A DB entry's config as a point of op's space, None if it is none (remembered per space)."""
    key = (op.name, id(op.space), e.config)
    if key not in _ENTRY_CONFIGS:
        if len(_ENTRY_CONFIGS) > 100_000:
            _ENTRY_CONFIGS.clear()
        c = Config.of(e.config_dict())
        ok = set(c.as_dict()) == set(op.space.params) and op.space.check(c)
        _ENTRY_CONFIGS[key] = c if ok else None
    return _ENTRY_CONFIGS[key]


def _dispatch_pick(model: CostModel, op: OpSpec, p: Problem, target: Target, entries: Sequence[Any],
                   usable: Callable[[Config], bool], accept: Callable[[Config], bool] | None,
                   admitted: Callable[[Config], bool] | None = None,
                   ) -> tuple[Config, Prediction, int, str | None] | None:
    mine = sorted(((op.distance(p, _problem_of(op, e.problem)), e) for e in entries
                   if e.op == op.name and e.vendor == target.vendor),
                  key=lambda de: (de[0], de[1].arch != target.arch, de[1].problem))
    extra, siblings = [], []
    configs = [(d, e, _entry_config(op, e)) for d, e in mine]
    valid = _split_validity(op, p, target, [c for _, _, c in configs if c is not None])
    for d, e, c in configs:
        if c is not None:
            extra.append(c)
            g = grid_matched(op, _problem_of(op, e.problem), p, c, target, valid)  # carried_winners of c alone
            if g is not None:
                extra.append(g)
            if e.arch == target.arch and d <= NEAREST_DISTANCE + 1e-9:
                siblings.append((c, e.problem))
    more = {} if admitted is None else {"admitted": admitted}
    got = model.choose(op, p, target, lambda c: bool(usable(c)), extra, accept, **more)
    if got is None:
        return None
    if NEAREST_MARGIN is not None:
        # a tuned sibling's winner is the incumbent: the model's pick replaces it only when
        # predicted NEAREST_MARGIN faster (its ranking errors are of that size; see the constant)
        inc = next(((c, k) for c, k in siblings if op.validate(p, c, target) and usable(c)
                    and (accept is None or accept(c))), None)
        if inc is not None and inc[0] != got[0]:
            pred_inc = model.predict(op, p, inc[0], target)
            if got[1].total_us >= pred_inc.total_us / (1.0 + NEAREST_MARGIN):
                return inc[0], pred_inc, got[2], inc[1]
    return got[0], got[1], got[2], None
