"""Evaluation of the model on the records: each problem with enough timed configs held out in turn
(`leave_one_out`), the model fit without it picking among its timed candidates, compared with the
best recorded, the candidates' best, the nearest-tuned fallback and the default."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..ops import get_op
from ..ops.spec import Config, Target
from .candidates import candidate_tiers
from .fit import FitData, recmod_by_problem, timed_configs
from .policy import nearest_recorded_winner
from .predictor import CostModel
from .records import SWEEP_SOURCE  # the `source` of the records from the repo's exhaustive sweeps


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
