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
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded to what `dtype` can hold (still float64)."""
    return from_storage(to_storage(a, dtype), dtype)


def max_violation(out: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> float:
    """Largest |out-ref| / (atol + rtol*|ref|); <= 1 passes. NaN anywhere (not in ref) fails."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        return float("inf")
    bad_nan = np.isnan(out) != np.isnan(ref)
    if bad_nan.any():
        return float("inf")
    ok = ~np.isnan(ref)
    if not ok.any():
        return 0.0
    err = np.abs(out[ok] - ref[ok]) / (atol + rtol * np.abs(ref[ok]))
    return float(err.max()) if err.size else 0.0
