"""What the model sees of one (problem, config): the phi terms (`TERMS`), their physical priors,
and `geometry`, which computes them from the op's launches and its `OpSpec.model_*` hooks (streams,
unroll, vector bytes, registers, contiguous run, re-reads, split, slices per block, scatter,
serial chain). `geometry_many` does the same for many configs of one problem, on arrays where the
op has `geometry_columns`, equal to `geometry` exactly."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..ops.spec import Config, OpSpec, Problem, Target
from ..types import DEFAULT_SMS, NUM_SMS  # SMs per arch where no device is at hand
from .lattice import _lattice

KEEP_WS_BYTES = 4 << 20  # dispatch keeps a workspace up to this size per stream (no per-call alloc)

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
# The chain term: a block's serial load round trips (`OpSpec.chain_steps`) x its waves x
# CHAIN_US bound the time from below however few bytes move (HBM latency ~0.6-0.8 us,
# plus the reduction that follows a step). "max": log(max(1, chain / roofline)); "sum":
# log(1 + chain / roofline); None: no term (compared in bench/costmodel_kfold.py)
CHAIN: str | None = "max"
CHAIN_US = 1.0
# Predictions count the NCHW GroupNorm backward's chain with today's narrow rows (the k-fold
# study turns it off to score picks against the old records' times; the fit counts each record's
# with the rule its kernel version ran: fit.NARROW_ROWS_FROM_KERNEL_VERSION).
PREDICT_NARROW_ROWS = True

_T = {n: i for i, n in enumerate(TERM_NAMES)}  # a term's column in Geometry.phi


def num_sms(arch: str) -> int:
    return NUM_SMS.get(arch, DEFAULT_SMS)


def _layout(p: Problem) -> str:
    """The problem's memory layout; a problem without one counts as NCHW (row-major runs)."""
    return getattr(p, "layout", "nchw")


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


def _regs(op: OpSpec, p: Problem, c: Config) -> int:
    """Registers per thread (at least 32): the op's `regs_used` (what the compiler is expected to
    allocate, up to the launch bounds' budget); 32 where it cannot say for this config."""
    try:
        return max(32, int(op.regs_used(p, c)))
    except (KeyError, ValueError, ZeroDivisionError):
        return 32


def chain_steps(op: OpSpec, p: Problem, c: Config, narrow_rows: bool = True) -> int:
    """The load round trips one block makes one after another (`OpSpec.chain_steps`; 0: no
    chain term)."""
    return op.chain_steps(p, c, narrow_rows)


def _sector(run: int) -> float:
    """The `sector` term of a contiguous run of `run` bytes: 32-byte sectors fetched / bytes used."""
    return math.log(32 * (math.ceil(run / 32) + (1 if run % 32 else 0)) / run)


def geometry(op: OpSpec, p: Problem, c: Config, target: Target, sms: int | None = None,
             narrow_rows: bool | None = None) -> Geometry:
    """`narrow_rows`: the NCHW backward rule `chain_steps` counts with (None: PREDICT_NARROW_ROWS)."""
    sms = sms or num_sms(target.arch)
    d = c.as_dict()
    launches = op.launches(p, c, target)
    main = _main_launch(op, p, c, launches)
    blocks = max(1, main.grid[0] * main.grid[1] * main.grid[2])
    threads = max(1, main.block[0] * main.block[1] * main.block[2])
    per_sm = max(d.get("min_blocks", 1), min(32, 2048 // threads, 65536 // (threads * _regs(op, p, c))))
    conc = min(blocks, sms * per_sm)
    need_bytes = op.min_bytes(p)
    unroll = op.model_unroll(p, c)
    streams = op.model_streams(p)
    vec_bytes = op.model_vec_bytes(p, c)
    per_thread = need_bytes / (blocks * threads)
    inflight = conc * threads * max(1.0, min(unroll * vec_bytes * streams, per_thread))
    waves = blocks / (sms * per_sm)
    phi = dict.fromkeys(TERM_NAMES, 0.0)
    phi["cov"] = math.log(sms / min(sms, blocks))
    phi["tail"] = math.log(math.ceil(waves) / waves) if waves > 1 else 0.0
    narrow = math.log2(16 / max(1, vec_bytes))
    phi["vec_nchw" if _layout(p) == "nchw" else "vec_nhwc"] = narrow
    phi["small_work"] = max(0.0, math.log(256 / max(per_thread, 1e-3)))
    phi["big_work"] = max(0.0, math.log(per_thread / 65536))
    phi["threads"] = math.log2(threads / 256)
    phi["unroll"] = math.log2(max(1, unroll))
    phi["min_blocks"] = math.log2(d.get("min_blocks", 1))
    run = op.model_run_bytes(p, c)
    if run is not None:
        phi["sector"] = _sector(run)
    reread = op.model_reread_bytes(p, c)
    if reread:
        phi["reread"] = math.log1p(reread / need_bytes)
    phi["split"] = math.log2(op.model_split(p, c))
    phi["gpb"] = math.log2(op.model_slices_per_block(p, c))
    if op.model_scatter(p, c):
        phi["scatter"] = 1.0
    if CHAIN:
        steps = op.chain_steps(p, c, PREDICT_NARROW_ROWS if narrow_rows is None else narrow_rows)
        if steps:
            ratio = steps * math.ceil(waves) * CHAIN_US / (need_bytes / BW_BYTES_PER_US)
            phi["chain"] = math.log1p(ratio) if CHAIN == "sum" else max(0.0, math.log(ratio))
    ws = op.workspace_bytes(p, c)
    allocs = len(op.output_buffers(p)) + (1 if ws > KEEP_WS_BYTES else 0)
    return Geometry(len(launches), allocs, math.log(max(need_bytes, 1) / BW_BYTES_PER_US), math.log(inflight),
                    tuple(phi[n] for n in TERM_NAMES))


def geometry_many(op: OpSpec, p: Problem, configs: Sequence[Config], target: Target,
                  narrow_rows: bool | None = None) -> list[Geometry]:
    """`geometry` of each config, equal to it exactly (the same expressions in the same order,
    tests/test_pick_latency.py and tests/test_gn_vector.py check): what depends on the problem
    alone is computed once, phi is filled by column, and a call's only launch is its main one
    without naming the instance. An unseen problem's pick predicts hundreds of candidates, so
    per-config overhead is what it saves (`geometry` per config costs a third of such a pick)."""
    arrays = _geometry_arrays(op, p, configs, target, narrow_rows)
    if arrays is not None:
        launches, allocs, log_roof, log_inflight, phi_rows = arrays
        return [Geometry(n, a, log_roof, li, tuple(row))
                for n, a, li, row in zip(launches, allocs, log_inflight.tolist(), phi_rows.tolist())]
    sms = num_sms(target.arch)
    need_bytes = op.min_bytes(p)
    streams = op.model_streams(p)
    n_out = len(op.output_buffers(p))
    log_roof = math.log(max(need_bytes, 1) / BW_BYTES_PER_US)
    narrow_rule = PREDICT_NARROW_ROWS if narrow_rows is None else narrow_rows
    vec_col = _T["vec_nchw" if _layout(p) == "nchw" else "vec_nhwc"]
    i_cov, i_tail, i_small, i_big, i_threads, i_unroll, i_min = (
        _T["cov"], _T["tail"], _T["small_work"], _T["big_work"], _T["threads"], _T["unroll"], _T["min_blocks"])
    i_sector, i_reread, i_split, i_gpb, i_scatter, i_chain = (
        _T["sector"], _T["reread"], _T["split"], _T["gpb"], _T["scatter"], _T["chain"])
    unroll_of, vec_of = op.model_unroll, op.model_vec_bytes
    # the hooks whose default the op keeps are not asked per config (their terms stay 0)
    run_of, reread_of, split_of, slices_of, scatter_of, chain_of = (
        getattr(op, h) if op.overrides(h) else None for h in (
            "model_run_bytes", "model_reread_bytes", "model_split", "model_slices_per_block", "model_scatter",
            "chain_steps"))
    n_terms = len(TERM_NAMES)
    out = []
    for c in configs:
        d = c.as_dict()
        launches = op.launches(p, c, target)
        main = launches[0] if len(launches) == 1 else _main_launch(op, p, c, launches)
        blocks = max(1, main.grid[0] * main.grid[1] * main.grid[2])
        threads = max(1, main.block[0] * main.block[1] * main.block[2])
        per_sm = max(d.get("min_blocks", 1), min(32, 2048 // threads, 65536 // (threads * _regs(op, p, c))))
        conc = min(blocks, sms * per_sm)
        unroll = unroll_of(p, c)
        vec_bytes = vec_of(p, c)
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
        run = run_of(p, c) if run_of is not None else None
        if run is not None:
            phi[i_sector] = _sector(run)
        reread = reread_of(p, c) if reread_of is not None else 0
        if reread:
            phi[i_reread] = math.log1p(reread / need_bytes)
        if split_of is not None:
            phi[i_split] = math.log2(split_of(p, c))
        if slices_of is not None:
            phi[i_gpb] = math.log2(slices_of(p, c))
        if scatter_of is not None and scatter_of(p, c):
            phi[i_scatter] = 1.0
        if CHAIN and chain_of is not None:
            steps = chain_of(p, c, narrow_rule)
            if steps:
                ratio = steps * math.ceil(waves) * CHAIN_US / (need_bytes / BW_BYTES_PER_US)
                phi[i_chain] = math.log1p(ratio) if CHAIN == "sum" else max(0.0, math.log(ratio))
        ws = op.workspace_bytes(p, c)
        out.append(Geometry(len(launches), n_out + (1 if ws > KEEP_WS_BYTES else 0), log_roof, math.log(inflight),
                            tuple(phi)))
    return out


def _exact(fn: Callable[[Any], float], x: np.ndarray) -> np.ndarray:
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
    if not configs or not op.overrides("geometry_columns"):
        return None
    need_bytes = op.min_bytes(p)
    if not 0 < need_bytes < 1 << 50:
        return None
    k = _knob_columns(op, configs)
    if k is None:
        return None
    g = op.geometry_columns(p, k, target, PREDICT_NARROW_ROWS if narrow_rows is None else narrow_rows)
    if g is None:
        return None
    n = len(configs)
    sms = num_sms(target.arch)
    streams = op.model_streams(p)
    blocks = np.maximum(1, np.broadcast_to(g["blocks"], n))
    threads = np.maximum(1, np.broadcast_to(g["threads"], n))
    min_blocks = k["min_blocks"] if "min_blocks" in k else np.ones(n, dtype=np.int64)
    per_sm = np.maximum(min_blocks, np.minimum(np.minimum(32, 2048 // threads), 65536 // (threads * g["regs"])))
    conc = np.minimum(blocks, sms * per_sm)
    unroll, vec_bytes = np.broadcast_to(g["unroll"], n), np.broadcast_to(g["vec_bytes"], n)
    per_thread = need_bytes / (blocks * threads)
    inflight = (conc * threads) * np.maximum(1.0, np.minimum(unroll * vec_bytes * streams, per_thread))
    waves = blocks / (sms * per_sm)
    phi = np.zeros((n, len(TERM_NAMES)), dtype=np.float64)
    log, log2 = math.log, math.log2
    phi[:, _T["cov"]] = _exact(log, sms / np.minimum(sms, blocks))
    over = waves > 1
    phi[over, _T["tail"]] = _exact(log, np.ceil(waves[over]) / waves[over])
    phi[:, _T["vec_nchw" if _layout(p) == "nchw" else "vec_nhwc"]] = _exact(log2, 16 / np.maximum(1, vec_bytes))
    phi[:, _T["small_work"]] = np.maximum(0.0, _exact(log, 256 / np.maximum(per_thread, 1e-3)))
    phi[:, _T["big_work"]] = np.maximum(0.0, _exact(log, per_thread / 65536))
    phi[:, _T["threads"]] = _exact(log2, threads / 256)
    phi[:, _T["unroll"]] = _exact(log2, np.maximum(1, unroll))
    phi[:, _T["min_blocks"]] = _exact(log2, min_blocks)
    if g.get("run") is not None:
        run = np.broadcast_to(g["run"], n)
        phi[:, _T["sector"]] = _exact(log, 32 * (-(-run // 32) + (run % 32 != 0)) / run)
    if g.get("reread") is not None:
        reread = np.broadcast_to(g["reread"], n)
        on = reread != 0
        if on.any():
            phi[on, _T["reread"]] = _exact(lambda v: math.log1p(v / need_bytes), reread[on])
    phi[:, _T["split"]] = _exact(log2, np.broadcast_to(g.get("split", 1), n))
    phi[:, _T["gpb"]] = _exact(log2, np.broadcast_to(g.get("slices", 1), n))
    if g.get("scatter") is not None:
        phi[np.broadcast_to(g["scatter"], n).astype(bool), _T["scatter"]] = 1.0
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


def _phi_matrix(geos: Sequence[Geometry], need: float) -> np.ndarray:
    phi = np.array([g.phi for g in geos], dtype=np.float64).reshape(len(geos), len(TERM_NAMES))
    phi[:, 0] = np.maximum(0.0, math.log(need) - np.array([g.log_inflight for g in geos]))
    return phi
