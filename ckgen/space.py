"""Tuning spaces: read tuning_spaces/<op>.yaml (ckgen.resources finds the folder), enumerate, sample, check constraints."""
from __future__ import annotations

import ast
import itertools
import numbers
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
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


# The constraint code is compiled with no builtins: an expression sees the knobs and nothing else.
_NO_BUILTINS = {"__builtins__": {}}
# Python nests at most 20 blocks in one function; the generated enumeration nests one loop per
# knob, so past this many knobs the leading ones share one loop over their product.
_MAX_LOOPS = 16


def _parse_expr(expr: str) -> ast.Expression:
    try:
        return ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"constraint {expr!r}: not a Python expression ({e.msg})") from None


def _rename(tree: ast.Expression, names: dict[str, str]) -> ast.expr:
    """The expression with every knob name replaced by its argument name in generated code."""
    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.Name:
            return ast.copy_location(ast.Name(names[node.id], node.ctx), node)

    return Rename().visit(ast.parse(ast.unparse(tree), mode="eval")).body


def _function(src: str, name: str) -> Callable[..., Any]:
    scope: dict[str, Any] = {}
    exec(compile(src, f"<ckgen.space {name}>", "exec"), dict(_NO_BUILTINS), scope)  # noqa: S102
    return scope[name]


@dataclass(frozen=True)
class Constraint:
    """A rule of a tuning space: `expr`, a Python expression over knob names, must hold."""

    expr: str
    reason: str
    # The knob names `expr` reads, each once, and `expr` compiled once into a function of them:
    # checking a config evaluates no string.
    names: tuple[str, ...] = field(init=False, compare=False, repr=False)
    _fn: Callable[..., Any] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        tree = _parse_expr(self.expr)
        names = tuple(dict.fromkeys(n.id for n in ast.walk(tree) if isinstance(n, ast.Name)))
        args = {n: f"_k{i}" for i, n in enumerate(names)}
        body = ast.unparse(_rename(tree, args))
        fn = _function(f"def _check({', '.join(args.values())}):\n    return True if ({body}) else False\n", "_check")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "_fn", fn)

    def check(self, values: dict[str, Any]) -> bool:
        return self._fn(*[values[n] for n in self.names])


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

    def __post_init__(self) -> None:
        self._memo["compiled"] = _CompiledSpace(self.params, self.constraints, self.op)

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
        compiled: _CompiledSpace = self._memo["compiled"]
        for name, value in values.items():
            if (type(value), value) in compiled.exact[name]:
                continue  # the common case: a value of the space itself
            if not any(_same_kind(value, v) and value == v for v in params[name]):
                return Support.no(f"{name}={value!r} ({type(value).__name__}) is not one of {list(params[name])}")
        failed = compiled.first_failing(*[values[n] for n in compiled.names])
        return Support.yes() if failed < 0 else Support.no(self.constraints[failed].reason)

    def enumerate(self) -> tuple[Config, ...]:
        """Every valid point, in declaration order (the order of `itertools.product` over the
        knobs as declared, filtered by the constraints)."""
        if "enumerate" not in self._memo:
            self._memo["enumerate"] = self._memo["compiled"].enumerate()
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


class _CompiledSpace:
    """A space's constraints compiled once into two generated functions: `first_failing` (the
    index of the first constraint a config breaks, -1 for none: `Space.check`) and an
    enumeration that walks the knobs as nested loops in declaration order and tests each
    constraint as soon as the knobs it names are bound, so a pruned branch is never expanded
    (groupnorm_fwd: 466,560 points in the product, a few percent of them valid)."""

    def __init__(self, params: dict[str, tuple[Any, ...]], constraints: tuple[Constraint, ...], op: str):
        self.names = list(params)
        self.params = params
        # (type, value) of every value of each knob: a value of the space's own type is found by
        # one lookup; any other (a numpy int, say) takes `_same_kind`'s slower walk
        self.exact = {n: {(type(v), v) for v in vs} for n, vs in params.items()}
        for c in constraints:
            unknown = [n for n in c.names if n not in params]
            if unknown:
                raise ValueError(f"tuning space {op}: constraint {c.expr!r} names {unknown}, which are not knobs "
                                 f"of the space ({self.names})")
        self.constraints = constraints
        arg = {n: f"_p{i}" for i, n in enumerate(self.names)}
        tests = [ast.unparse(_rename(_parse_expr(c.expr), arg)) for c in constraints]
        body = "".join(f"    if not ({t}):\n        return {i}\n" for i, t in enumerate(tests))
        self.first_failing = _function(f"def _first_failing({', '.join(arg.values())}):\n{body}    return -1\n",
                                       "_first_failing")
        # loops: the leading knobs share the first loop when there are more than _MAX_LOOPS
        head = max(1, len(self.names) - _MAX_LOOPS + 1)
        self.loops = [self.names[:head]] + [[n] for n in self.names[head:]] if self.names else []
        level = {n: i for i, names in enumerate(self.loops) for n in names}
        at: dict[int, list[str]] = {}
        for c, t in zip(constraints, tests):
            at.setdefault(max((level[n] for n in c.names), default=-1), []).append(t)
        lines = [f"def _enumerate(_out, _C, {', '.join(f'_V{i}' for i in range(len(self.loops)))}):"]
        lines += [f"    if not ({t}):\n        return" for t in at.get(-1, [])]
        indent = "    "
        for i, names in enumerate(self.loops):
            target = ", ".join(arg[n] for n in names)
            lines.append(f"{indent}for {target} in _V{i}:")
            indent += "    "
            lines += [f"{indent}if not ({t}):\n{indent}    continue" for t in at.get(i, [])]
        # a Config's items are sorted by name (Config.of): emit them in that order
        items = ", ".join(f"({n!r}, {arg[n]})" for n in sorted(self.names))
        lines.append(f"{indent}_out(_C(({items}{',' if len(self.names) == 1 else ''})))")
        self._enumerate = _function("\n".join(lines) + "\n", "_enumerate")

    def holds_many(self, columns: dict[str, Any]) -> Any:
        """Whether each point holds every constraint, on arrays of knob values (numpy: an int or
        str array per knob, values of the space): `first_failing(...) < 0` per element. None
        where a constraint is not of the forms `_array_test` translates."""
        if "many" not in self.__dict__:
            self.many = _array_function(self.names, self.params, self.constraints)
        if self.many is None:
            return None
        import numpy as np

        n = len(next(iter(columns.values()))) if columns else 0
        return np.broadcast_to(np.asarray(self.many(np, *[columns[k] for k in self.names]), dtype=bool), (n,))

    def enumerate(self) -> tuple[Config, ...]:
        out: list[Config] = []
        loops = [list(itertools.product(*(self.params[n] for n in names))) if len(names) > 1 else self.params[names[0]]
                 for names in self.loops]
        self._enumerate(out.append, Config, *loops)
        return tuple(out)


_CMP = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
_ARITH = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}


def _array_test(tree: ast.expr, kinds: dict[str, type], arg: dict[str, str]) -> str | None:
    """A constraint as an expression over knob arrays (`_np` is numpy): and / or / not of
    comparisons become & / | / ~ of boolean arrays, a chain a < b < c the & of its pairs; the
    values are knobs, int or str constants and + - * of ints, each comparison between values of
    one kind (as the constraint compares them in Python). None for anything else."""
    def value(n: ast.expr) -> tuple[str, type] | None:
        if isinstance(n, ast.Name) and n.id in kinds:
            return arg[n.id], kinds[n.id]
        if isinstance(n, ast.Constant) and type(n.value) in (int, str):
            return repr(n.value), type(n.value)
        if isinstance(n, ast.BinOp) and type(n.op) in _ARITH:
            a, b = value(n.left), value(n.right)
            if a is None or b is None or a[1] is not int or b[1] is not int:
                return None
            return f"({a[0]} {_ARITH[type(n.op)]} {b[0]})", int
        return None

    def test(n: ast.expr) -> str | None:
        if isinstance(n, ast.BoolOp):
            parts = [test(v) for v in n.values]
            if any(p is None for p in parts):
                return None
            return "(" + (" & " if isinstance(n.op, ast.And) else " | ").join(parts) + ")"  # type: ignore[arg-type]
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            inner = test(n.operand)
            return None if inner is None else f"(~{inner})"
        if isinstance(n, ast.Compare) and all(type(o) in _CMP for o in n.ops):
            vals = [value(x) for x in [n.left, *n.comparators]]
            if any(v is None for v in vals) or len({v[1] for v in vals}) != 1:  # type: ignore[index]
                return None
            pairs = [f"_np.asarray({a[0]} {_CMP[type(o)]} {b[0]}, dtype=_np.bool_)"  # type: ignore[index]
                     for a, o, b in zip(vals, n.ops, vals[1:])]
            return "(" + " & ".join(pairs) + ")"
        return None

    return test(tree)


def _array_function(names: list[str], params: dict[str, tuple[Any, ...]],
                    constraints: tuple[Constraint, ...]) -> Callable[..., Any] | None:
    """`_CompiledSpace.holds_many`'s generated function: the & of every constraint's `_array_test`
    (True without constraints); None if a knob's values are not all ints or all strs, or a
    constraint does not translate."""
    kinds: dict[str, type] = {}
    for n in names:
        types = {type(v) for v in params[n]}
        if types not in ({int}, {str}):
            return None
        kinds[n] = types.pop()
    arg = {n: f"_p{i}" for i, n in enumerate(names)}
    tests = [_array_test(_parse_expr(c.expr).body, kinds, arg) for c in constraints]
    if any(t is None for t in tests):
        return None
    body = " & ".join(f"({t})" for t in tests) if tests else "True"  # type: ignore[misc]
    return _function(f"def _holds(_np, {', '.join(arg.values())}):\n    return {body}\n", "_holds")


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
    """ckgen's tuning space of `op` (tuning_spaces/<op>.yaml), read once."""
    path = tuning_spaces_dir() / f"{op}.yaml"
    if not path.is_file():
        raise ValueError(f"op: no tuning space for {op!r} (looked for {path})")
    return _read(path)


@lru_cache(maxsize=None)
def load_space_file(path: str) -> Space:
    """The tuning space in the YAML file `path` (an op's own, outside ckgen: OpSpec.space_path), read once."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"op: no tuning space at {file}")
    return _read(file)


def _read(path: Path) -> Space:
    """The space in the file at `path`; ValueError naming the file (and the line, for bad YAML)
    for one that does not read as a tuning space: a plug-in's file is the user's own."""
    try:
        # libyaml's safe loader where PyYAML has it: ~2 ms for a space instead of ~15 (the first
        # pick of an op in a process reads its space)
        doc = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ValueError(f"tuning space {path}: not valid YAML ({where}{getattr(e, 'problem', None) or e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"tuning space {path}: cannot be read ({e})") from None
    try:
        return _parse(doc)
    except ValueError as e:
        raise ValueError(str(e) if str(path) in str(e) else f"tuning space {path}: {e}") from None
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a field missing, or of another kind
        what = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"tuning space {path}: not a tuning space ({what})") from None
