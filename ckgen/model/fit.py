"""Fitting the model on timing records: for each (launch floor, bytes-in-flight knee) of a small
grid, ridge regression of the phi weights on within-problem differences of log time, toward the
terms' physical priors (a term the data says nothing about stays at its prior); an intercept per op;
the grid point of least squared log error kept; then the residual table of the measured
correction. `FitData` prepares records once (their geometry) for many fits (leave-one-out, the
replays' held-out models). Deterministic, numpy only."""
from __future__ import annotations

import math
import threading
from typing import Any, Iterable

import numpy as np

from ..ops import get_op
from ..ops.spec import Config, OpSpec, Problem, Target
from .document import ModelError
from .features import PRIOR, TERM_NAMES, Geometry, geometry
from .predictor import HOST, CostModel, launch_floor

WINNERS_PER_PROBLEM = 2  # best distinct configs of each recorded problem kept as "winners"
FLOOR_GRID = (1.5, 2.5, 3.5, 4.5, 6.0)  # us for a call's first launch on the GPU (launch latency + ramp)
# each further launch of the same call, as a fraction of the first: it is queued behind the first
# one, so it pays its ramp but not the launch latency (a multi-stage GroupNorm backward, a split
# forward's merge; 1.0: every launch costs the same)
FLOOR_NEXT_GRID = (0.25, 0.5, 1.0)
NEED_GRID = (0.25e6, 0.5e6, 1e6, 2e6, 4e6, 8e6)  # bytes in flight the GPU needs to hide memory latency
RIDGE = 40.0
# Records of kernel version 2 on (records.KERNEL_VERSION) ran the NCHW backward's narrower rows;
# the fit counts older ones' chain with the rule they ran (`OpSpec.chain_steps`' narrow_rows).
NARROW_ROWS_FROM_KERNEL_VERSION = 2


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


def timed_configs(records: Iterable[dict[str, Any]]) -> dict[Config, float]:
    """The fastest recorded time of each config among (one problem's) records."""
    timed: dict[Config, float] = {}
    for r in records:
        if r.get("ok"):
            c = Config.of(r["config"])
            timed[c] = min(timed.get(c, math.inf), float(r["time_us"]))
    return timed


def recmod_by_problem(records: Iterable[dict[str, Any]]):
    from .records import by_problem

    return by_problem(records)
