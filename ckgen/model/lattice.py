"""A tuning space's product of knob values as integer codes (`_Lattice`), on which the candidate
walk steps, dedups and checks configs with numpy, and the ops' class checks over codes
(`_class_filter`), each answer remembered per (op, problem class, target)."""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..ops.spec import Config, OpSpec, Problem, Target

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
