"""The pick: the dispatcher's answer for a problem no DB entry covers (`dispatch_pick`: the model's
best candidate, or a tuned sibling's winner it does not beat by NEAREST_MARGIN), and the tuner's
first seeds (`top_configs`, with the recorded winners carried to the problem's grid:
`recorded_winners`, `carried_winners`, `nearest_recorded_winners`).

**A tuned sibling wins ties** (`dispatch_pick`): the winner of the same shape tuned in another
dtype or activation (op.distance <= NEAREST_DISTANCE) is kept unless the model's pick is
predicted NEAREST_MARGIN faster (bench/costmodel_incumbent_loo.py: 1.064x -> 1.047x over the
records, the sweeps 1.24x -> 1.10x; held out: 1.24x)."""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..ops.spec import Config, OpSpec, Problem, Target
from .candidates import candidate_tiers
from .document import ModelError
from .lattice import _class_filter, _lattice
from .predictor import CostModel, Prediction
from .store import _warn_once, load, model_path

# The dispatcher keeps the winner of a tuned sibling (same arch, op.distance <= NEAREST_DISTANCE:
# the same shape in another dtype (2.0) or activation (0.5)) unless the model's pick is predicted
# NEAREST_MARGIN faster (x 1/(1+M)); None: the model's pick always. Chosen by leave-one-problem-out
# over the records (docs/architecture.md): farther tuned problems' winners are poor picks (the
# held-out shapes, bench/results/heldout/runs/README.md: model-off).
NEAREST_MARGIN: float | None = 0.3
NEAREST_DISTANCE = 2.0
SPLIT_KNOBS = ("global_split", "split")  # the knob of blocks per slice, beyond a cluster's, where a space has one


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
    (`spill.spill_free`), asked of the model's best few and of the sibling's winner.
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
