"""CPU tests of the float64 reference (groupnorm_fwd_reference), the host dtype helpers
(ckgen.ops.numeric) and the OpSpec's host-side packing."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ckgen.ops import get_op
from ckgen.ops.groupnorm import groupnorm_fwd_reference
from ckgen.ops.numeric import from_storage, max_violation, round_to, to_storage

OP = get_op("groupnorm_fwd")


def _loop_reference(x, gamma, beta, G, eps, activation):
    """Independent: per (n, g) loops with math.fsum, two-pass population variance."""
    N, C, H, W = x.shape
    Cg = C // G
    y = np.empty_like(x, dtype=np.float64)
    mean = np.empty((N, G))
    rstd = np.empty((N, G))
    for n in range(N):
        for g in range(G):
            vals = [float(v) for v in x[n, g * Cg:(g + 1) * Cg].ravel()]
            m = math.fsum(vals) / len(vals)
            var = math.fsum((v - m) ** 2 for v in vals) / len(vals)
            r = 1.0 / math.sqrt(var + eps)
            mean[n, g], rstd[n, g] = m, r
            for c in range(g * Cg, (g + 1) * Cg):
                for h in range(H):
                    for w in range(W):
                        v = (float(x[n, c, h, w]) - m) * r
                        if gamma is not None:
                            v *= float(gamma[c])
                        if beta is not None:
                            v += float(beta[c])
                        if activation == "swish":
                            v = v / (1.0 + math.exp(-v))
                        y[n, c, h, w] = v
    return y, mean, rstd


@pytest.mark.parametrize("activation", ["none", "swish"])
@pytest.mark.parametrize("affine", [True, False])
def test_reference_matches_fsum_loop(activation: str, affine: bool) -> None:
    rng = np.random.default_rng(7)
    N, C, H, W, G = 2, 12, 3, 5, 4
    x = rng.normal(0.3, 1.7, size=(N, C, H, W))
    gamma = 1.0 + 0.3 * rng.standard_normal(C) if affine else None
    beta = 0.2 * rng.standard_normal(C) if affine else None
    eps = 1e-5
    out = groupnorm_fwd_reference(x, gamma, beta, G, eps, activation)
    y, mean, rstd = _loop_reference(x, gamma, beta, G, eps, activation)
    np.testing.assert_allclose(out["mean"], mean, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(out["rstd"], rstd, rtol=1e-12)
    np.testing.assert_allclose(out["y"], y, rtol=1e-11, atol=1e-12)
    assert out["y"].dtype == np.float64 and out["y"].shape == x.shape


def test_reference_float32_input_is_computed_in_float64() -> None:
    rng = np.random.default_rng(3)
    x32 = rng.standard_normal((1, 8, 4, 4)).astype(np.float32)
    out = groupnorm_fwd_reference(x32, None, None, 2)
    y, mean, rstd = _loop_reference(x32.astype(np.float64), None, None, 2, 1e-5, "none")
    assert out["y"].dtype == np.float64
    np.testing.assert_allclose(out["y"], y, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(out["rstd"], rstd, rtol=1e-12)


@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_normalized_groups_have_zero_mean_and_shrunk_variance(eps: float) -> None:
    rng = np.random.default_rng(11)
    N, C, H, W, G = 3, 32, 4, 6, 8
    x = rng.normal(2.0, 3.0, size=(N, C, H, W)) * rng.uniform(0.1, 4.0, size=(1, C, 1, 1))
    out = groupnorm_fwd_reference(x, np.ones(C), np.zeros(C), G, eps)
    assert out["mean"].shape == (N, G) and out["rstd"].shape == (N, G)
    yg = out["y"].reshape(N, G, -1)
    var = x.reshape(N, G, -1).var(axis=2)
    np.testing.assert_allclose(yg.mean(axis=2), 0.0, atol=1e-12)
    np.testing.assert_allclose(yg.var(axis=2), var / (var + eps), rtol=1e-10)
    np.testing.assert_allclose(out["rstd"], 1.0 / np.sqrt(var + eps), rtol=1e-12)
    # gamma=1, beta=0 is the same as no affine at all
    plain = groupnorm_fwd_reference(x, None, None, G, eps)
    np.testing.assert_array_equal(plain["y"], out["y"])


def test_single_group_normalizes_the_whole_sample() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 6, 3, 3)) * 2 + 1
    out = groupnorm_fwd_reference(x, None, None, 1, 1e-5)
    assert out["mean"].shape == (2, 1) and out["rstd"].shape == (2, 1)
    for n in range(2):
        flat = x[n].ravel()
        assert out["mean"][n, 0] == pytest.approx(math.fsum(flat) / flat.size, rel=1e-14)
        np.testing.assert_allclose(out["y"][n], (x[n] - flat.mean()) / np.sqrt(flat.var() + 1e-5), rtol=1e-12)


def test_groups_equal_channels_is_instance_norm() -> None:
    rng = np.random.default_rng(6)
    N, C = 2, 5
    x = rng.standard_normal((N, C, 4, 3)) * rng.uniform(0.5, 3, size=(1, C, 1, 1))
    out = groupnorm_fwd_reference(x, None, None, C, 1e-5)
    assert out["mean"].shape == (N, C)
    np.testing.assert_allclose(out["mean"], x.mean(axis=(2, 3)), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(out["rstd"], 1 / np.sqrt(x.var(axis=(2, 3)) + 1e-5), rtol=1e-12)
    y = (x - x.mean(axis=(2, 3), keepdims=True)) / np.sqrt(x.var(axis=(2, 3), keepdims=True) + 1e-5)
    np.testing.assert_allclose(out["y"], y, rtol=1e-12, atol=1e-12)


def test_large_offset_keeps_rstd_accurate() -> None:
    """x = 1000 + noise: a one-pass E[x^2]-E[x]^2 would lose digits; the reference must not."""
    rng = np.random.default_rng(9)
    N, C, H, W, G = 2, 8, 16, 16, 4
    x = 1000.0 + 1e-3 * rng.standard_normal((N, C, H, W))
    eps = 1e-12
    out = groupnorm_fwd_reference(x, None, None, G, eps)
    for n in range(N):
        for g in range(G):
            vals = [float(v) for v in x[n, g * 2:(g + 1) * 2].ravel()]
            m = math.fsum(vals) / len(vals)
            var = math.fsum((v - m) ** 2 for v in vals) / len(vals)
            assert out["mean"][n, g] == pytest.approx(m, rel=1e-15)
            assert out["rstd"][n, g] == pytest.approx(1 / math.sqrt(var + eps), rel=1e-9)
    assert np.all(out["rstd"] > 500) and np.all(out["rstd"] < 2000)  # ~1/1e-3


def test_problem_reference_uses_the_problem_groups_and_activation() -> None:
    p = OP.parse_problem(N=2, C=8, H=3, W=3, G=4, dtype="fp32", layout="nchw", activation="swish")
    inputs = OP.make_inputs(p, np.random.default_rng(1))
    out = OP.reference(p, inputs)
    y, mean, rstd = _loop_reference(inputs["x"], inputs["gamma"], inputs["beta"], 4, 1e-5, "swish")
    np.testing.assert_allclose(out["y"], y, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(out["mean"], mean, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------ numeric: bf16 storage

# (float32 bits, expected bf16 bits under round-to-nearest-even)
BF16_CASES = [
    (0x3F800000, 0x3F80),  # 1.0 exact
    (0x3F800001, 0x3F80),  # just above 1.0: down
    (0x3F807FFF, 0x3F80),  # below the half-way point: down
    (0x3F808000, 0x3F80),  # tie, even (0) kept: down
    (0x3F818000, 0x3F82),  # tie, odd (1): up to even
    (0x3F808001, 0x3F81),  # above the tie: up
    (0xBF808000, 0xBF80),  # negative tie to even
    (0xBF818000, 0xBF82),  # negative tie to even, away from zero
    (0x3F80FFFF, 0x3F81),  # rounds up
    (0x3FFF8000, 0x4000),  # tie carries into the exponent
    (0x7F7FFFFF, 0x7F80),  # FLT_MAX rounds to +inf
    (0x7F800000, 0x7F80),  # +inf
    (0xFF800000, 0xFF80),  # -inf
    (0x80000000, 0x8000),  # -0.0
    (0x00000001, 0x0000),  # smallest subnormal: to +0
    (0x00018000, 0x0002),  # subnormal tie, odd: up
]


@pytest.mark.parametrize("bits, want", BF16_CASES, ids=[f"{b:08x}" for b, _ in BF16_CASES])
def test_bf16_to_storage_rounds_to_nearest_even(bits: int, want: int) -> None:
    f32 = np.array([bits], dtype=np.uint32).view(np.float32)
    got = to_storage(f32, "bf16")
    assert got.dtype == np.uint16
    assert int(got[0]) == want, f"{bits:08x} -> {int(got[0]):04x}, want {want:04x}"
    # and from_storage is the exact inverse on the stored bits
    back = from_storage(got, "bf16")
    assert back.dtype == np.float64
    assert np.array([back[0]], dtype=np.float32).view(np.uint32)[0] == want << 16


@pytest.mark.parametrize("bits", [0x7FC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7F80FFFF])
def test_bf16_nan_stays_nan(bits: int) -> None:
    f32 = np.array([bits], dtype=np.uint32).view(np.float32)
    got = int(to_storage(f32, "bf16")[0])
    assert (got & 0x7F80) == 0x7F80 and (got & 0x007F) != 0, f"{bits:08x} -> {got:04x} is not a NaN"
    assert (got & 0x8000) == (bits >> 16) & 0x8000, "sign lost"
    assert math.isnan(from_storage(np.array([got], dtype=np.uint16), "bf16")[0])


def test_bf16_round_trip_of_every_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):  # float32 signalling NaNs -> float64
        vals = from_storage(bits, "bf16")
    again = to_storage(vals, "bf16")
    nan = np.isnan(vals)
    assert nan.sum() == 2 * 127  # 2 signs x (2^7 - 1) mantissas
    np.testing.assert_array_equal(again[~nan], bits[~nan])
    assert np.isnan(from_storage(again[nan], "bf16")).all()


def test_bf16_rounding_of_float64_input_matches_a_slow_model() -> None:
    rng = np.random.default_rng(2)
    a = rng.standard_normal(2000) * 10.0 ** rng.integers(-5, 5, 2000)
    got = round_to(a, "bf16")
    for v, r in zip(a[:300], got[:300]):
        f = float(np.float32(v))
        # the two bf16 neighbours of f, picked by truncation
        lo = float(np.array([np.array([f], np.float32).view(np.uint32)[0] & 0xFFFF0000],
                            np.uint32).view(np.float32)[0])
        ulp = 2.0 ** (math.frexp(lo)[1] - 8) if lo != 0 else 0.0
        hi = lo + math.copysign(ulp, f)
        assert r in (lo, hi)
        assert abs(r - f) <= abs((lo if r == hi else hi) - f)
    assert np.all(np.abs(got - a) <= np.abs(a) * 2.0 ** -8 + 1e-45)


@pytest.mark.parametrize("dtype, np_dtype", [("fp32", np.float32), ("fp16", np.float16)])
def test_fp_storage_round_trip(dtype: str, np_dtype) -> None:
    a = np.array([0.1, -2.5, 65504.0, 1e-3, 3.0])
    s = to_storage(a, dtype)
    assert s.dtype == np_dtype and s.flags.c_contiguous
    np.testing.assert_array_equal(from_storage(s, dtype), a.astype(np_dtype).astype(np.float64))
    np.testing.assert_array_equal(round_to(round_to(a, dtype), dtype), round_to(a, dtype))


def test_unknown_dtype_raises() -> None:
    with pytest.raises(ValueError, match="fp8"):
        to_storage(np.zeros(2), "fp8")


# ------------------------------------------------------------------ numeric: max_violation


def test_max_violation() -> None:
    ref = np.array([1.0, -2.0, 100.0, 0.0])
    assert max_violation(ref.copy(), ref, 1e-3, 1e-3) == 0.0
    close = ref + np.array([5e-4, -1e-3, 0.05, -9e-4])
    v = max_violation(close, ref, 1e-3, 1e-3)
    assert 0.0 < v <= 1.0
    far = ref + np.array([0.0, 0.0, 1.0, 0.0])  # 1 / (1e-3 + 0.1) ~ 9.9
    assert max_violation(far, ref, 1e-3, 1e-3) == pytest.approx(1.0 / (1e-3 + 1e-3 * 100.0))
    assert max_violation(far, ref, 1e-3, 1e-3) > 1.0


def test_max_violation_nan_and_shape() -> None:
    ref = np.array([1.0, 2.0, 3.0])
    out = ref.copy()
    out[1] = np.nan
    assert max_violation(out, ref, 1.0, 1.0) == float("inf")  # NaN where ref has none
    ref_nan = ref.copy()
    ref_nan[1] = np.nan
    assert max_violation(ref, ref_nan, 1.0, 1.0) == float("inf")  # a number where ref is NaN
    assert max_violation(out, ref_nan, 1e-9, 0.0) == 0.0  # NaN where ref has NaN: fine
    assert max_violation(np.full(3, np.nan), np.full(3, np.nan), 1e-3, 0.0) == 0.0
    assert max_violation(ref[:2], ref, 1.0, 1.0) == float("inf")
    assert max_violation(np.array([np.inf]), np.array([1.0]), 1.0, 1.0) > 1.0


# ------------------------------------------------------------------ OpSpec host packing


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_pack_unpack_round_trip(dtype: str, layout: str) -> None:
    p = OP.parse_problem(N=2, C=6, H=3, W=5, G=3, dtype=dtype, layout=layout)
    inputs = OP.make_inputs(p, np.random.default_rng(4))
    x = inputs["x"]
    assert np.array_equal(x, round_to(x, dtype)), "make_inputs returns values dtype can hold"
    packed = OP.pack_inputs(p, inputs)
    bufs = OP.output_buffers(p)
    assert packed["x"].ndim == 1 and packed["x"].size == p.numel == bufs["y"][0]
    assert packed["x"].dtype == bufs["y"][1]
    assert packed["gamma"].size == p.C and packed["beta"].size == p.C
    # device memory order: NCHW as is, NHWC is the channels-last transpose
    flat = from_storage(packed["x"], dtype)
    if layout == "nchw":
        np.testing.assert_array_equal(flat.reshape(p.N, p.C, p.H, p.W), x)
    else:
        np.testing.assert_array_equal(flat.reshape(p.N, p.H, p.W, p.C), x.transpose(0, 2, 3, 1))
        n, c, h, w = 1, 4, 2, 3
        assert flat[((n * p.H + h) * p.W + w) * p.C + c] == x[n, c, h, w]
    mean = np.arange(p.N * p.G, dtype=np.float32)
    raw = {"y": packed["x"], "mean": mean, "rstd": mean + 0.5}
    out = OP.unpack_outputs(p, raw)
    assert out["y"].shape == (p.N, p.C, p.H, p.W)
    np.testing.assert_array_equal(out["y"], x)
    np.testing.assert_array_equal(out["mean"], mean.reshape(p.N, p.G))
    np.testing.assert_array_equal(out["rstd"], (mean + 0.5).reshape(p.N, p.G))


def test_pack_without_affine() -> None:
    p = OP.parse_problem(N=1, C=4, H=2, W=2, G=2, dtype="fp16", layout="nhwc")
    inputs = OP.make_inputs(p, np.random.default_rng(0))
    packed = OP.pack_inputs(p, {"x": inputs["x"], "gamma": None})
    assert set(packed) == {"x"}
