"""The candidate walk: which configs the model ranks for a problem. The near tier: every config
that won anywhere (the model file's per-problem best configs from the records, those of the op's
family, and the DB entries of the op) and the space's valid configs one knob step away from them
(a step further while fewer than MIN_CANDIDATES). The wide tier: the configs up to MAX_STEPS knob
steps away (MAX_CANDIDATES in all). Each candidate is checked with `op.validate` (and the caller's
usability test: pointer alignment), so the model never picks an invalid config."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from ..ops import get_op
from ..ops.spec import Config, OpSpec, Problem, Target
from .lattice import _class_filter, _lattice

MAX_CANDIDATES = 512
MIN_CANDIDATES = 24  # near tier: fewer usable within one knob step of the winners: look a step further
MAX_STEPS = 3  # wide tier: up to this many knob steps from the winners
_CHUNK = 512  # walk nodes whose space and class checks are taken together


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
    whole_step = lat.columns(np.zeros(0, dtype=np.int64)) is not None and op.overrides("class_check_many")
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


def candidates(op: OpSpec, p: Problem, target: Target, winners: Iterable[Config],
               usable: Callable[[Config], bool], limit: int = MAX_CANDIDATES) -> list[Config]:
    """The near tier of `candidate_tiers`: the usable winners (and the space default), then the
    usable configs one knob step from them; while fewer than MIN_CANDIDATES are usable, a step
    further (at most MAX_STEPS), at most `limit` in all."""
    ok, near = candidate_tiers(op, p, target, winners, usable, limit)
    return ok[:near]


def related_winners(op: OpSpec, winners: dict[str, list[dict[str, Any]]]) -> list[Config]:
    """Winners of this op, then those of the other ops of its family (`OpSpec.model_family`: the
    GroupNorm backward ops; max and average pooling of one direction) carried into this op's space: knobs it lacks dropped, knobs
    they lack at the space default; kept only if a point of the space."""
    params, default = op.space.params, op.space.default.as_dict()
    fam = op.model_family()
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
    """The `model_family` of the op called `name` (a name this ckgen does not know: its own)."""
    try:
        return get_op(name).model_family()
    except ValueError:
        return name
