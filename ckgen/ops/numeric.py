"""Host-side dtype helpers: round float64 data to fp32/fp16/bf16 and pack it for upload.
NumPy has no bfloat16, so bf16 travels as uint16 bit patterns."""
from __future__ import annotations

import numpy as np


def to_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """float64 -> the bits the kernels load (float32, float16, or uint16 for bf16, RNE)."""
    if dtype == "fp32":
        return np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "fp16":
        return np.ascontiguousarray(a, dtype=np.float16)
    if dtype == "bf16":
        u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
        return r
    raise ValueError(f"dtype: unknown {dtype!r}")


def from_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """The inverse of to_storage, to float64."""
    if dtype == "bf16":
        with np.errstate(invalid="ignore"):  # signalling-NaN bit patterns stay NaN
            return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)  # NumPy or CuPy alike


def round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded to what `dtype` can hold (still float64)."""
    return from_storage(to_storage(a, dtype), dtype)


def array_module(a):
    """numpy, or cupy for CuPy arrays (so checks can run where the data is)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def max_violation(out, ref, atol: float, rtol: float) -> float:
    """Largest |out-ref| / (atol + rtol*|ref|); <= 1 passes. NaN anywhere (not in ref) fails.
    Works on NumPy or CuPy arrays (both of one kind)."""
    xp = array_module(out)
    out = xp.asarray(out).astype(xp.float64)
    ref = xp.asarray(ref).astype(xp.float64)
    if out.shape != ref.shape:
        return float("inf")
    if bool((xp.isnan(out) != xp.isnan(ref)).any()):
        return float("inf")
    ok = ~xp.isnan(ref)
    if not bool(ok.any()):
        return 0.0
    o, r = out[ok], ref[ok]
    # Equal values (infinities included) pass even with a zero tolerance (exact outputs).
    with np.errstate(invalid="ignore", divide="ignore"):
        tol = atol + rtol * xp.abs(r)
        err = xp.where(o == r, 0.0, xp.abs(o - r) / tol)
    err = xp.where(xp.isnan(err), xp.inf, err)
    return float(err.max()) if err.size else 0.0
