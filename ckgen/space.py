"""Tuning spaces: read tuning_spaces/<op>.yaml (ckgen.resources finds the folder), enumerate, sample, check constraints."""
from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

import yaml

from .resources import tuning_spaces_dir
from .types import Config, Support


def _same_kind(value: Any, allowed: Any) -> bool:
    """Is `value` of the kind of the space's value `allowed`? Membership alone is not enough:
    1024.0 and True compare equal to 1024 and 1, and would render as `1024.0` or `True`."""
    if isinstance(allowed, bool):
        return isinstance(value, bool)
    if isinstance(allowed, numbers.Integral):
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if isinstance(allowed, numbers.Real):
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return type(value) is type(allowed)


@dataclass(frozen=True)
class Constraint:
    expr: str
    reason: str

    def check(self, values: dict[str, Any]) -> bool:
        # Expressions come from our own YAML; no builtins are reachable from them.
        return bool(eval(self.expr, {"__builtins__": {}}, dict(values)))  # noqa: S307


@dataclass(frozen=True)
class Space:
    op: str
    tile: tuple[tuple[str, tuple[Any, ...]], ...]
    algo: tuple[tuple[str, tuple[Any, ...]], ...]
    constraints: tuple[Constraint, ...]
    default: Config
    default_problems: dict[str, Any]
    # Named problem lists (`ckgen tune OP --grid NAME`), each in the form of default_problems.
    grids: dict[str, Any] = field(default_factory=dict, compare=False)
    # Memo of check() results and the enumeration (a space is immutable once built).
    _memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def params(self) -> dict[str, tuple[Any, ...]]:
        return dict(self.tile + self.algo)

    def check(self, config: Config) -> Support:
        """Is `config` a point of this space (names, value types and values, constraints)?"""
        # Keyed with the value types too: 1024.0 == 1024 and True == 1 hash alike.
        memo_key = (config, tuple(type(v) for _, v in config.items))
        hit = self._memo.get(memo_key)
        if hit is None:
            hit = self._memo[memo_key] = self._check(config)
        return hit

    def _check(self, config: Config) -> Support:
        params = self.params
        values = config.as_dict()
        missing = sorted(set(params) - set(values))
        extra = sorted(set(values) - set(params))
        if missing or extra:
            return Support.no(f"config keys differ from the space: missing {missing}, unknown {extra}")
        for name, value in values.items():
            if not any(_same_kind(value, v) and value == v for v in params[name]):
                return Support.no(f"{name}={value!r} ({type(value).__name__}) is not one of {list(params[name])}")
        for c in self.constraints:
            if not c.check(values):
                return Support.no(c.reason)
        return Support.yes()

    def enumerate(self) -> tuple[Config, ...]:
        """Every valid point, in declaration order."""
        if "enumerate" not in self._memo:
            names = list(self.params)
            combos = (Config.of(dict(zip(names, c))) for c in itertools.product(*(self.params[n] for n in names)))
            self._memo["enumerate"] = tuple(c for c in combos if self.check(c))
        return self._memo["enumerate"]

    def nearest_default(self, usable: Callable[[Config], bool]) -> Config | None:
        """The default if `usable`, else the usable point nearest it (None if there is none)."""
        return next((c for c in self.by_distance_from_default() if usable(c)), None)

    def by_distance_from_default(self) -> tuple[Config, ...]:
        """Every point, nearest the default first (count of differing knobs, then value order)."""
        if "by_distance" in self._memo:
            return self._memo["by_distance"]
        params = self.params
        d = self.default.as_dict()

        def rank(cfg: Config) -> tuple[int, tuple[int, ...]]:
            v = cfg.as_dict()
            diff = sum(v[k] != d[k] for k in params)
            order = tuple(abs(params[k].index(v[k]) - params[k].index(d[k])) for k in sorted(params))
            return diff, order

        self._memo["by_distance"] = tuple(sorted(self.enumerate(), key=rank))
        return self._memo["by_distance"]


def _parse(doc: dict[str, Any]) -> Space:
    params = doc["params"]
    tile = tuple((k, tuple(v)) for k, v in params.get("tile", {}).items())
    algo = tuple((k, tuple(v)) for k, v in params.get("algo", {}).items())
    constraints = tuple(Constraint(c["expr"], c["reason"]) for c in doc.get("constraints", []))
    space = Space(doc["op"], tile, algo, constraints, Config.of(doc["default"]),
                  doc.get("default_problems", {}), dict(doc.get("grids") or {}))
    ok = space.check(space.default)
    if not ok:
        raise ValueError(f"tuning space {doc['op']}: default config is invalid: {ok.reason}")
    return space


@lru_cache(maxsize=None)
def load_space(op: str) -> Space:
    path = tuning_spaces_dir() / f"{op}.yaml"
    if not path.is_file():
        raise ValueError(f"op: no tuning space for {op!r} (looked for {path})")
    return _parse(yaml.safe_load(path.read_text()))
