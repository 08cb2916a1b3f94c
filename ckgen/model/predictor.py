"""The fitted cost model (`CostModel`): its predictions (the roofline scaled by the phi terms of
`features.geometry`, plus the launch floors, corrected by the measured residuals of nearby recorded
problems), its ranking and two-tier selection of the candidates, its file form (`to_doc` /
`from_doc`) and the residual tables' index.

**The measured correction.** Where the records time a config on problems near the one asked
about, they say how far off the roofline is for that config there; the prediction takes that
over: its log GPU time moves by the weighted mean of the config's within-problem log residuals
on the other recorded problems of the op (weights exp(-related_distance / CORR_TAU), shrunk
toward 0 by CORR_PRIOR of pseudo-weight; the problem itself never counts).

**Host time.** A call costs the host a fixed part, ~4 us per kernel launch (cuLaunchKernel)
and ~3 us per output allocation (bench/results/host_overhead-*.json). Back to back, a call takes
max(GPU time, host time), so for tiny problems fewer launches win; candidates are ranked by that,
then by GPU time."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..ops.spec import Config, OpSpec, Problem, Target
from .candidates import candidate_tiers, related_winners
from .document import (FORMAT, MAX_CORRECTION, MAX_NEED_BYTES, MAX_RESIDUAL, MAX_US, MAX_WEIGHT, VERSION, ModelError,
                       _config_ok, _mapping, _number, _residuals_ok)
from .features import BW_BYTES_PER_US, TERM_NAMES, _geometry_arrays, _phi_matrix, geometry_many

# A wide-tier candidate must be predicted this much faster than the near tier's best (x 1/(1+M)):
# chosen on the exhaustive sweeps held out (bench/costmodel_loo.py --margins): 0.1-0.2 never
# made a sweep's pick worse, 0.05 or none did (NHWC 1.30x -> 1.70x); 0.15 the middle.
WIDE_MARGIN = 0.15
# `choose`'s compiled check (the dispatcher's spill test, `spill.spill_free`) looks at most this
# far down the ranking; each look is one NVRTC compile (~0.3 s) on the first call of a problem.
ACCEPT_TRIES = 8

# Host time of one call (bench/host_overhead.py, torch inputs): cuLaunchKernel's floor per
# launch (4.06 us), an output allocation, and the rest of a call; within 3 us of the 10 measured
# ops' 9.5-26 us except groupnorm_bwd_gamma_beta (26).
HOST = {"call_us": 4.0, "launch_us": 4.06, "alloc_us": 3.0}

# The measured correction: a config's prediction is corrected by how far off the model was for
# that config on recorded problems near this one (its within-problem log residual), weighted by
# exp(-related_distance / CORR_TAU) and shrunk toward 0 by CORR_PRIOR of pseudo-weight. 0: off.
CORR_TAU = 1.0
CORR_PRIOR = 0.2


def launch_floor(launches: Any, first: float, nxt: float) -> Any:
    """first + (launches - 1) x nxt (launches: an int or an array)."""
    return first + (launches - 1) * nxt


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
