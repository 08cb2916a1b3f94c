"""The float64 pooling references (ckgen/ops/pool/problem.py) against independent direct loops written
after PyTorch's CUDA kernels, on small shapes with every option: padding, stride, dilation,
ceil_mode, count_include_pad, divisor_override, NaN, ties and all -inf windows. The backward
references are checked against finite differences (avg) and a direct scatter loop (max)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from ckgen.ops import get_op
from ckgen.ops.pool import (avgpool2d_bwd_reference, avgpool2d_reference, maxpool2d_bwd_reference,
                            maxpool2d_reference, pool_output_size)

MAXF, AVGF = get_op("maxpool2d_fwd"), get_op("avgpool2d_fwd")


def out_size(n, k, s, p, d, ceil):
    """PyTorch's pooling_output_shape, spelled out."""
    num = n + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil else 0)
    o = num // s + 1  # div_rtn: floor
    if ceil and (o - 1) * s >= n + p:
        o -= 1
    return o


def direct_max(x, k, s, p, d, ceil):
    N, C, H, W = x.shape
    OH, OW = out_size(H, k[0], s[0], p[0], d[0], ceil), out_size(W, k[1], s[1], p[1], d[1], ceil)
    y = np.zeros((N, C, OH, OW))
    idx = np.zeros((N, C, OH, OW), dtype=np.int64)
    for n, c, oh, ow in itertools.product(range(N), range(C), range(OH), range(OW)):
        hs, ws = oh * s[0] - p[0], ow * s[1] - p[1]
        he, we = min(hs + (k[0] - 1) * d[0] + 1, H), min(ws + (k[1] - 1) * d[1] + 1, W)
        while hs < 0:
            hs += d[0]
        while ws < 0:
            ws += d[1]
        m, mi = -np.inf, hs * W + ws  # PyTorch: the first in-bounds index
        for h in range(hs, he, d[0]):
            for w in range(ws, we, d[1]):
                v = x[n, c, h, w]
                if v > m or np.isnan(v):
                    m, mi = v, h * W + w
        y[n, c, oh, ow], idx[n, c, oh, ow] = m, mi
    return y, idx


def direct_avg(x, k, s, p, ceil, cip, div):
    N, C, H, W = x.shape
    OH, OW = out_size(H, k[0], s[0], p[0], 1, ceil), out_size(W, k[1], s[1], p[1], 1, ceil)
    y = np.zeros((N, C, OH, OW))
    for n, c, oh, ow in itertools.product(range(N), range(C), range(OH), range(OW)):
        hs, ws = oh * s[0] - p[0], ow * s[1] - p[1]
        he, we = min(hs + k[0], H + p[0]), min(ws + k[1], W + p[1])
        pool = (he - hs) * (we - ws)
        hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, H), min(we, W)
        tot = sum(x[n, c, h, w] for h in range(hs, he) for w in range(ws, we))
        y[n, c, oh, ow] = tot / (div or (pool if cip else (he - hs) * (we - ws)))
    return y


def ties(shape, rng):
    return np.round(rng.uniform(-2, 2, size=shape) * 2) / 2  # a coarse grid: many equal values


MAX_CASES = [  # (H, W, kernel, stride, padding, dilation, ceil_mode)
    (7, 9, (3, 3), (2, 2), (1, 1), (1, 1), False),
    (7, 9, (3, 3), (2, 2), (1, 1), (1, 1), True),
    (8, 8, (2, 2), (2, 2), (0, 0), (1, 1), False),
    (6, 7, (3, 2), (1, 2), (1, 0), (1, 1), True),
    (9, 10, (3, 3), (2, 3), (1, 1), (2, 2), False),
    (9, 10, (2, 3), (3, 2), (1, 1), (3, 1), True),
    (5, 5, (5, 5), (1, 1), (2, 2), (1, 1), False),
    (4, 11, (1, 3), (1, 1), (0, 1), (1, 2), True),
    (10, 10, (4, 4), (3, 3), (2, 2), (1, 1), True),
]


@pytest.mark.parametrize("case", MAX_CASES, ids=lambda c: "H{}W{}k{}s{}p{}d{}c{}".format(*c[:6], int(c[6])))
def test_maxpool_reference_matches_direct_loop(case):
    H, W, k, s, p, d, ceil = case
    rng = np.random.default_rng(1)
    x = ties((2, 3, H, W), rng)
    special = rng.random(x.shape)
    x[special < 0.06] = np.nan
    x[(special > 0.9)] = -np.inf
    x[1, 2] = -np.inf  # a plane of -inf: every window all -inf
    prob = MAXF.parse_problem(N=2, C=3, H=H, W=W, dtype="fp32", layout="nchw", kernel=k, stride=s, padding=p,
                              dilation=d, ceil_mode=ceil, return_indices=True)
    assert (prob.OH, prob.OW) == (out_size(H, k[0], s[0], p[0], d[0], ceil), out_size(W, k[1], s[1], p[1], d[1], ceil))
    y, idx = maxpool2d_reference(prob, x)
    ry, ridx = direct_max(x, k, s, p, d, ceil)
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_array_equal(y, ry)  # NaN == NaN and -inf == -inf here
    assert np.isnan(y).any() and np.isneginf(y[1, 2]).all()
    assert ((idx >= 0) & (idx < H * W)).all()


def test_max_ties_take_the_first_index_and_nan_wins():
    x = np.array([[[[1.0, 3.0, 3.0], [3.0, 0.0, 3.0], [np.nan, 2.0, np.nan]]]])
    p = MAXF.parse_problem(N=1, C=1, H=3, W=3, dtype="fp32", layout="nchw", kernel=2, stride=1, return_indices=True)
    y, idx = maxpool2d_reference(p, x)
    assert idx[0, 0].tolist() == [[1, 1], [6, 8]]  # ties: first in window order; NaN: PyTorch's last NaN
    assert y[0, 0, 0].tolist() == [3.0, 3.0] and np.isnan(y[0, 0, 1]).all()


AVG_CASES = [  # (H, W, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    (7, 9, (3, 3), (2, 2), (1, 1), False, True, 0),
    (7, 9, (3, 3), (2, 2), (1, 1), True, True, 0),
    (7, 9, (3, 3), (2, 2), (1, 1), True, False, 0),
    (8, 8, (2, 2), (2, 2), (0, 0), False, True, 3),
    (6, 7, (3, 2), (1, 2), (1, 1), True, False, 0),
    (10, 10, (4, 4), (3, 3), (2, 2), True, True, 0),
    (5, 6, (5, 3), (2, 1), (2, 1), True, False, 7),
]


@pytest.mark.parametrize("case", AVG_CASES, ids=lambda c: "H{}W{}k{}s{}p{}c{}i{}d{}".format(*c))
def test_avgpool_reference_matches_direct_loop(case):
    H, W, k, s, p, ceil, cip, div = case
    x = np.random.default_rng(2).standard_normal((2, 3, H, W))
    prob = AVGF.parse_problem(N=2, C=3, H=H, W=W, dtype="fp32", layout="nchw", kernel=k, stride=s, padding=p,
                              ceil_mode=ceil, count_include_pad=cip, divisor_override=div)
    np.testing.assert_allclose(avgpool2d_reference(prob, x), direct_avg(x, k, s, p, ceil, cip, div), rtol=1e-13, atol=1e-13)


def test_ceil_mode_overhang_is_not_counted_with_count_include_pad():
    # H=6, k3 s2 p1, ceil: OH = 4 (last window starts at 5, inside the input), window rows 5..7
    # of which row 7 lies beyond the padded input (rows -1..6): it is not counted.
    p = AVGF.parse_problem(N=1, C=1, H=6, W=6, dtype="fp32", layout="nchw", kernel=3, stride=2, padding=1,
                           ceil_mode=True, count_include_pad=True)
    assert p.OH == 4
    y = avgpool2d_reference(p, np.ones((1, 1, 6, 6)))
    assert y[0, 0, 3, 3] == pytest.approx(1.0 / 4.0)  # 1 in-bounds element of a 2x2 padded window


def test_output_size_rules():
    assert pool_output_size(112, 3, 2, 1, 1, False) == 56
    assert pool_output_size(5, 2, 2, 0, 1, True) == 3 and pool_output_size(5, 2, 2, 0, 1, False) == 2
    # ceil_mode drops a last window starting in the right padding
    assert pool_output_size(4, 2, 2, 1, 1, True) == 3 == out_size(4, 2, 2, 1, 1, True)
    assert pool_output_size(10, 3, 1, 0, 4, False) == 2  # effective kernel 9
    for args in itertools.product(range(1, 9), range(1, 4), range(1, 4), range(0, 2), range(1, 3), (False, True)):
        n, k, s, p, d, c = args
        assert pool_output_size(n, k, s, p, d, c) == out_size(n, k, s, p, d, c)


@pytest.mark.parametrize("kw,word", [
    (dict(kernel=3, stride=2, padding=2), "padding"),
    (dict(kernel=0, stride=1), "kernel_size"),
    (dict(kernel=3, stride=0), "stride"),
    (dict(kernel=3, stride=1, dilation=0), "dilation"),
    (dict(kernel=3, stride=1, padding=-1), "padding"),
    (dict(kernel=9, stride=1), "kernel_size"),  # output size < 1 on a 4x4 input
    (dict(kernel=(2, 2, 2), stride=1), "kernel_size"),
])
def test_bad_pooling_params_raise_naming_the_argument(kw, word):
    with pytest.raises(ValueError) as ei:
        MAXF.parse_problem(N=1, C=1, H=4, W=4, dtype="fp32", layout="nchw", **kw)
    assert str(ei.value).startswith(word + ":"), str(ei.value)


def test_avg_has_no_dilation():
    with pytest.raises(ValueError, match="^dilation:"):
        AVGF.parse_problem(N=1, C=1, H=4, W=4, dtype="fp32", layout="nchw", kernel=2, stride=2, dilation=2)


@pytest.mark.parametrize("case", AVG_CASES[:5], ids=lambda c: "H{}W{}k{}s{}p{}c{}i{}d{}".format(*c))
def test_avgpool_bwd_reference_matches_finite_differences(case):
    H, W, k, s, p, ceil, cip, div = case
    prob = AVGF.parse_problem(N=1, C=2, H=H, W=W, dtype="fp32", layout="nchw", kernel=k, stride=s, padding=p,
                              ceil_mode=ceil, count_include_pad=cip, divisor_override=div)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, H, W))
    dy = rng.standard_normal((1, 2, prob.OH, prob.OW))
    dx = avgpool2d_bwd_reference(prob, dy)
    h = 1e-3
    num = np.zeros_like(x)
    for i in np.ndindex(x.shape):  # avg pooling is linear: central differences are exact up to rounding
        e = np.zeros_like(x)
        e[i] = h
        num[i] = ((avgpool2d_reference(prob, x + e) - avgpool2d_reference(prob, x - e)) * dy).sum() / (2 * h)
    np.testing.assert_allclose(dx, num, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("case", MAX_CASES, ids=lambda c: "H{}W{}k{}s{}p{}d{}c{}".format(*c[:6], int(c[6])))
def test_maxpool_bwd_reference_matches_direct_scatter(case):
    H, W, k, s, p, d, ceil = case
    prob = MAXF.parse_problem(N=2, C=2, H=H, W=W, dtype="fp32", layout="nchw", kernel=k, stride=s, padding=p,
                              dilation=d, ceil_mode=ceil)
    rng = np.random.default_rng(4)
    x = ties((2, 2, H, W), rng)
    _, idx = direct_max(x, k, s, p, d, ceil)
    dy = rng.standard_normal(idx.shape)
    want = np.zeros(x.shape)
    for n, c, oh, ow in itertools.product(*map(range, idx.shape)):
        i = idx[n, c, oh, ow]
        want[n, c, i // W, i % W] += dy[n, c, oh, ow]  # overlapping windows accumulate
    np.testing.assert_allclose(maxpool2d_bwd_reference(prob, dy, idx), want, rtol=1e-13, atol=1e-13)


def test_make_inputs_have_ties_and_no_zeros_everywhere():
    op = get_op("maxpool2d_bwd")
    p = op.parse_problem(N=2, C=4, H=16, W=16, dtype="bf16", layout="nhwc", kernel=3, stride=2, padding=1)
    inp = op.make_inputs(p, np.random.default_rng())
    x = inp["x"]
    assert np.abs(x).sum() > 0 and np.abs(inp["dy"]).sum() > 0
    y, idx = maxpool2d_reference(p, x)
    np.testing.assert_array_equal(inp["indices"], idx)
    # some window holds its maximum twice (so first-index tie-breaking is exercised)
    tied = 0
    for oh, ow in itertools.product(range(p.OH), range(p.OW)):
        win = x[0, 0, max(oh * 2 - 1, 0):oh * 2 + 2, max(ow * 2 - 1, 0):ow * 2 + 2]
        tied += (win == win.max()).sum() > 1
    assert tied > 0


def test_canonical_stride_keeps_every_output_size():
    """Along an axis with one output a stride below the effective kernel is raised to it; PyTorch's
    output size is the same for every size, kernel, stride, padding, dilation and ceil_mode."""
    from ckgen.ops.pool.problem import canonical_stride

    changed = 0
    for n, k, s, d, ceil in itertools.product(range(1, 12), range(1, 7), range(1, 9), (1, 2), (False, True)):
        for p in range(k // 2 + 1):
            o = out_size(n, k, s, p, d, ceil)
            if o < 1:
                continue
            cs = canonical_stride(n, n, (k, k), (s, s), (p, p), (d, d), ceil)
            ek = (k - 1) * d + 1
            assert cs[0] == cs[1] == (ek if o == 1 and s < ek else s)
            assert out_size(n, k, cs[0], p, d, ceil) == o, (n, k, s, p, d, ceil)
            changed += cs[0] != s
    assert changed > 100  # the rule does apply


ONE_OUTPUT = [  # (H, W, kernel, stride, padding, dilation, ceil): one output along H and/or W, stride < window
    (7, 7, 7, 1, 0, 1, False),  # a global pool written with stride 1
    (5, 8, (5, 3), (2, 1), (0, 1), 1, False),  # one output along H only
    (5, 5, 3, 2, 1, (3, 1), True),  # dilation and ceil_mode
    (3, 9, (3, 2), (1, 3), (0, 0), 1, True),
]


@pytest.mark.parametrize("case", ONE_OUTPUT, ids=str)
def test_canonical_stride_problems_match_the_direct_loop_with_the_given_stride(case):
    H, W, k, s, p, d, ceil = case
    pair = lambda v: (v, v) if isinstance(v, int) else v  # noqa: E731
    k, s, p, d = map(pair, (k, s, p, d))
    rng = np.random.default_rng(5)
    x = ties((2, 3, H, W), rng)
    prob = MAXF.parse_problem(N=2, C=3, H=H, W=W, dtype="fp32", layout="nchw", kernel=k, stride=s, padding=p,
                              dilation=d, ceil_mode=ceil)
    assert prob.stride != s  # canonicalized
    y, idx = maxpool2d_reference(prob, x)
    wy, widx = direct_max(x, k, s, p, d, ceil)
    np.testing.assert_array_equal(y, wy)
    np.testing.assert_array_equal(idx, widx)
    if d == (1, 1):
        for cip in (True, False):
            ap = AVGF.parse_problem(N=2, C=3, H=H, W=W, dtype="fp32", layout="nchw", kernel=k, stride=s,
                                    padding=p, ceil_mode=ceil, count_include_pad=cip)
            np.testing.assert_allclose(avgpool2d_reference(ap, x), direct_avg(x, k, s, p, ceil, cip, None),
                                       rtol=1e-14, atol=1e-14)


def test_maxpool_bwd_fp32_tolerance_covers_an_fp32_accumulation_of_overlapping_windows():
    """The fp32 backward sums, per input element, the dy of every window whose argmax it is. The
    verification tolerance grows with how many windows can cover one element
    (`PoolProblem.windows_per_element`):
    the sum done in float32, one window at a time in output order (as a gather kernel adds
    them), passes it on tie-heavy inputs, and that count is the direct count's maximum."""
    from ckgen.ops.numeric import max_violation

    op = get_op("maxpool2d_bwd")
    for kw in (dict(kernel=5, stride=1, padding=2), dict(kernel=3, stride=2, padding=1),
               dict(kernel=(3, 2), stride=(1, 2), padding=(1, 0), dilation=(2, 1))):
        p = op.parse_problem(N=2, C=8, H=20, W=20, dtype="fp32", layout="nchw", indices="stored", **kw)
        inputs = op.make_inputs(p, np.random.default_rng(3))
        idx, dy = inputs["indices"].reshape(p.N * p.C, -1), inputs["dy"].reshape(p.N * p.C, -1)
        covered = np.zeros((p.N * p.C, p.H * p.W), dtype=np.int64)
        dx32 = np.zeros((p.N * p.C, p.H * p.W), dtype=np.float32)
        for o in range(idx.shape[1]):  # one window at a time: float32 adds, like the kernel's
            rows = np.arange(idx.shape[0])
            ok = idx[:, o] >= 0
            dx32[rows[ok], idx[ok, o]] += dy[ok, o].astype(np.float32)
        # every window covering an element: a direct count over the window positions
        for oh in range(p.OH):
            for ow in range(p.OW):
                for i in range(p.kernel[0]):
                    for j in range(p.kernel[1]):
                        h = oh * p.stride[0] - p.padding[0] + i * p.dilation[0]
                        w = ow * p.stride[1] - p.padding[1] + j * p.dilation[1]
                        if 0 <= h < p.H and 0 <= w < p.W:
                            covered[0, h * p.W + w] += 1
        assert covered.max() == p.windows_per_element, (kw, covered.max(), p.windows_per_element)
        ref = op.reference(p, inputs)["dx"]
        tol = op.problem_tolerance(p, "dx")
        assert max_violation(dx32.reshape(ref.shape), ref, tol.atol, tol.rtol) <= 1.0, kw
    fp16 = op.parse_problem(N=1, C=1, H=20, W=20, dtype="fp16", layout="nchw", kernel=5, stride=1, padding=2)
    assert op.problem_tolerance(fp16, "dx") == op.tolerance("fp16", "dx")
    k2s2 = op.parse_problem(N=1, C=1, H=20, W=20, dtype="fp32", layout="nchw", kernel=2, stride=2)
    assert k2s2.windows_per_element == 1 and op.problem_tolerance(k2s2, "dx") == op.tolerance("fp32", "dx")
