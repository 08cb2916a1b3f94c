"""The model file's format and its checks: the format name and version, the bounds a model file's
numbers must keep (so that every prediction is a finite time), the errors a file that cannot be
used raises, and the validators `CostModel.from_doc` and the parse cache apply."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

FORMAT = "ckgen-costmodel"
VERSION = 1

# What a model file may hold (`CostModel.from_doc`): every prediction is then a finite time. The
# packaged model is far inside: weights and intercepts within 1.1, residuals within 1.8.
MAX_WEIGHT = 10.0
MAX_US = 1e4  # host times per call and launch floors
MAX_NEED_BYTES = 1e12
MAX_RESIDUAL = 20.0
MAX_CORRECTION = 1e6
# Bytes of a model file read at most: the packaged one is ~2.3 MB; a larger file (or /dev/zero
# named by $CKGEN_MODEL) is not a model of ours and is not read without bound.
MAX_MODEL_BYTES = 256 * 2**20


class ModelError(ValueError):
    """A model file that cannot be used (the message says why)."""


class ModelWarning(UserWarning):
    """The cost model is unavailable (missing or corrupt file); the dispatcher uses nearest-tuned."""


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
