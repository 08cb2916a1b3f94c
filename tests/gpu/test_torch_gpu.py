"""GPU tier of ckgen.torch: every custom op against PyTorch's own op, forward and backward
(values, gradients of x/gamma/beta, indices), fp32/fp16/bf16, NCHW and channels-last, each held
to the op's per-dtype tolerance of a float64 PyTorch reference; torch.library.opcheck on every
op; torch.compile(fullgraph=True) and mode="reduce-overhead" (CUDA graphs) on a small converted
model trained a few steps against eager; state_dict round trips; the op-level fallback for a
problem the dispatcher cannot serve; streams; autocast.

Every test also checks that ckgen's kernels ran: `ckgen.torch.fallbacks()` must stay empty
(a fallback would run PyTorch's computation and hide a wrong kernel).

    python -m pytest -m gpu tests/gpu/test_torch_gpu.py
"""
from __future__ import annotations

import copy
import itertools

import pytest

from ckgen.ops import get_op

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import ckgen.torch as ct  # noqa: E402

TORCH_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPES = ("fp32", "fp16", "bf16")
LAYOUTS = ("nchw", "nhwc")
FMT = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}


@pytest.fixture(autouse=True)
def _no_fallback():
    """ckgen's kernels must run: no call may fall back to PyTorch (unless a test expects it)."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    ct.reset_fallbacks()
    yield
    assert ct.fallbacks() == {}, f"calls fell back to PyTorch: {ct.fallbacks()}"


@pytest.fixture(scope="module", autouse=True)
def _prewarm():
    """Compile (in parallel) and load every instance the op tests dispatch to, once: later
    loads hit the in-process kernel cache whatever cache dir a test runs with."""
    import warnings

    try:
        import ckgen
        from ckgen.runtime.compile import compile_many, load_kernel
        from ckgen.instance import render_instance
        from ckgen.runtime.target import current_target
        from ckgen.torch.ops import _pool_fields

        target = current_target()
        picks = []
        for (N, C, H, W, G), dt, lay, act in itertools.product(GN_SHAPES + [(2, 64, 9, 10, 8)], DTYPES, LAYOUTS,
                                                               ("none", "swish")):
            for name in ("groupnorm_fwd", "groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta"):
                picks.append((name, dict(N=N, C=C, H=H, W=W, G=G, dtype=dt, layout=lay, activation=act)))
        for kw, dt, lay in itertools.product(MAX_GEOS, DTYPES, LAYOUTS):
            k, st, p, d, ceil = _pairs(kw)
            f = dict(N=2, C=32, H=13, W=24, dtype=dt, layout=lay, **_pool_fields(k, st, p, d, ceil))
            picks += [("maxpool2d_fwd", dict(f, return_indices=ri)) for ri in (True, False)]
            picks += [("maxpool2d_bwd", dict(f, indices=ind)) for ind in ("stored", "recompute")]
        for kw, dt, lay in itertools.product(AVG_GEOS, DTYPES, LAYOUTS):
            k, st, p, _, ceil = _pairs(kw)
            f = dict(N=2, C=32, H=13, W=24, dtype=dt, layout=lay, count_include_pad=kw.get("count_include_pad", True),
                     divisor_override=kw.get("divisor_override"), **_pool_fields(k, st, p, None, ceil))
            picks += [("avgpool2d_fwd", f), ("avgpool2d_bwd", f)]
        todo = []
        for name, fields in picks:
            op = get_op(name)
            choice = ckgen.explain(name, arch=target.arch, **fields)
            problem = op.parse_problem(**fields)
            src = render_instance(op, problem, choice.config, target)
            todo.append((src, [launch.kernel for launch in op.launches(problem, choice.config, target)]))
        failures = compile_many([src for src, _ in todo], target)
        for src, symbols in todo:
            if src.name not in failures:
                for sym in symbols:
                    load_kernel(src, target, sym)
    except Exception as e:  # noqa: BLE001 - the tests then compile on demand
        warnings.warn(f"prewarm skipped: {e.__class__.__name__}: {e}")


def _close(got, want, tol, what=""):
    torch.testing.assert_close(got.double(), want.double(), atol=tol.atol, rtol=tol.rtol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def _rel(a, b):
    """||a - b|| / ||b|| (for whole-model gradients, where elementwise tolerances mislead)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# GroupNorm ops: forward, autograd backward (all three backward ops), against float64 PyTorch
# ---------------------------------------------------------------------------------------------
GN_SHAPES = [(2, 320, 8, 8, 32), (3, 96, 17, 19, 6), (4, 64, 1, 1, 16), (1, 64, 64, 64, 4)]


def _gn_case(shape, dtype, layout, seed=0):
    N, C, H, W, G = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = TORCH_DT[dtype]
    x = (torch.randn(N, C, H, W, device="cuda", generator=gen) * 1.5 + 0.3).to(dt).contiguous(memory_format=FMT[layout])
    dy = torch.randn(N, C, H, W, device="cuda", generator=gen).to(dt).contiguous(memory_format=FMT[layout])
    gamma = (1 + 0.25 * torch.randn(C, device="cuda", generator=gen)).to(dt)
    beta = (0.25 * torch.randn(C, device="cuda", generator=gen)).to(dt)
    return x, dy, gamma, beta


@pytest.mark.parametrize("affine", ["both", "gamma", "none"])
@pytest.mark.parametrize("dtype,layout,act", list(itertools.product(DTYPES, LAYOUTS, ["none", "swish"])))
@pytest.mark.parametrize("shape", GN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_groupnorm_op_forward_backward_vs_pytorch(shape, dtype, layout, act, affine):
    N, C, H, W, G = shape
    x, dy, gamma, beta = _gn_case(shape, dtype, layout)
    gamma = gamma if affine in ("both", "gamma") else None
    beta = beta if affine == "both" else None
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, gamma, beta)]
    y, mean, rstd = torch.ops.ckgen.groupnorm_fwd(*leaves, G, 1e-5, act)
    y.backward(dy)
    # float64 PyTorch reference on the same (rounded) inputs
    ref_leaves = [t.detach().double().requires_grad_(True) if t is not None else None for t in (x, gamma, beta)]
    ref = F.group_norm(ref_leaves[0], G, ref_leaves[1], ref_leaves[2], 1e-5)
    ref = F.silu(ref) if act == "swish" else ref
    ref.backward(dy.double())

    fwd, bwd = get_op("groupnorm_fwd"), get_op("groupnorm_bwd")
    p = bwd.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=dtype, layout=layout, activation=act)
    assert y.dtype == x.dtype and y.is_contiguous(memory_format=FMT[layout])
    assert mean.shape == rstd.shape == (N, G) and mean.dtype == rstd.dtype == torch.float32
    _close(y, ref, fwd.tolerance(dtype, "y"), "y")
    xm = x.double().reshape(N, G, -1)
    torch.testing.assert_close(mean.double(), xm.mean(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(rstd.double(), 1 / torch.sqrt(xm.var(-1, unbiased=False) + 1e-5), atol=0, rtol=2e-3)
    gx = leaves[0].grad
    assert gx.dtype == x.dtype and gx.is_contiguous(memory_format=FMT[layout])
    _close(gx, ref_leaves[0].grad, bwd.problem_tolerance(p, "dx"), "dx")
    for leaf, rl, name in ((leaves[1], ref_leaves[1], "dgamma"), (leaves[2], ref_leaves[2], "dbeta")):
        if leaf is not None:
            assert leaf.grad.dtype == x.dtype and leaf.grad.shape == (C,)
            _close(leaf.grad, rl.grad, bwd.problem_tolerance(p, name), name)


@pytest.mark.parametrize("dtype,layout", list(itertools.product(DTYPES, LAYOUTS)))
def test_groupnorm_backward_ops_directly(dtype, layout):
    """groupnorm_bwd, groupnorm_bwd_data and groupnorm_bwd_gamma_beta agree with PyTorch, and
    autograd with only x (or only gamma/beta) needing a gradient takes the partial op."""
    shape = (2, 320, 8, 8, 32)
    N, C, H, W, G = shape
    x, dy, gamma, beta = _gn_case(shape, dtype, layout, seed=3)
    _, mean, rstd = torch.ops.ckgen.groupnorm_fwd(x, gamma, beta, G, 1e-5, "swish")
    xd, gd, bd = (t.detach().double().requires_grad_(True) for t in (x, gamma, beta))
    F.silu(F.group_norm(xd, G, gd, bd, 1e-5)).backward(dy.double())
    op = get_op("groupnorm_bwd")
    p = op.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=dtype, layout=layout, activation="swish")
    dx, dg, db = torch.ops.ckgen.groupnorm_bwd(dy, x, mean, rstd, gamma, G, beta, "swish")
    dx2 = torch.ops.ckgen.groupnorm_bwd_data(dy, x, mean, rstd, gamma, G, beta, "swish")
    dg2, db2 = torch.ops.ckgen.groupnorm_bwd_gamma_beta(dy, x, mean, rstd, G, gamma, beta, "swish")
    for got, ref, name in ((dx, xd.grad, "dx"), (dx2, xd.grad, "dx"), (dg, gd.grad, "dgamma"),
                           (dg2, gd.grad, "dgamma"), (db, bd.grad, "dbeta"), (db2, bd.grad, "dbeta")):
        _close(got, ref, op.problem_tolerance(p, name), name)
    # autograd with partial needs: same values
    for need_x in (True, False):
        leaves = [x.detach().clone().requires_grad_(need_x), gamma.detach().clone().requires_grad_(not need_x),
                  beta.detach().clone().requires_grad_(not need_x)]
        torch.ops.ckgen.groupnorm_fwd(*leaves, G, 1e-5, "swish")[0].backward(dy)
        if need_x:
            _close(leaves[0].grad, xd.grad, op.problem_tolerance(p, "dx"), "dx only")
            assert leaves[1].grad is None
        else:
            assert leaves[0].grad is None
            _close(leaves[1].grad, gd.grad, op.problem_tolerance(p, "dgamma"), "dgamma only")
            _close(leaves[2].grad, bd.grad, op.problem_tolerance(p, "dbeta"), "dbeta only")


# ---------------------------------------------------------------------------------------------
# pooling ops
# ---------------------------------------------------------------------------------------------
MAX_GEOS = [
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=2, stride=2),
    dict(kernel_size=3, stride=1, padding=1),
    dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1), ceil_mode=True),
]
AVG_GEOS = [
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    dict(kernel_size=2, stride=2),
    dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 1), ceil_mode=True),
    dict(kernel_size=4, stride=3, padding=2, ceil_mode=True, divisor_override=5),
]


def _pool_x(dtype, layout, shape=(2, 32, 13, 24), seed=0):
    """A coarse grid of values: ties in most windows (first-in-window-order wins, as in PyTorch)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randint(-8, 9, shape, device="cuda", generator=g).float() / 4
    return x.to(TORCH_DT[dtype]).contiguous(memory_format=FMT[layout])


def _pairs(kw):
    k = kw["kernel_size"]
    k = (k, k) if isinstance(k, int) else k
    s = kw.get("stride", k)
    s = (s, s) if isinstance(s, int) else s
    p = kw.get("padding", 0)
    p = (p, p) if isinstance(p, int) else p
    d = kw.get("dilation", 1)
    d = (d, d) if isinstance(d, int) else d
    return list(k), list(s), list(p), list(d), bool(kw.get("ceil_mode", False))


@pytest.mark.parametrize("dtype,layout", list(itertools.product(DTYPES, LAYOUTS)))
@pytest.mark.parametrize("kw", MAX_GEOS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()).replace(" ", ""))
def test_maxpool_ops_vs_pytorch(kw, dtype, layout):
    k, s, p, d, ceil = _pairs(kw)
    x = _pool_x(dtype, layout)
    # PyTorch's NCHW kernel is the semantic reference (as in test_pool_gpu.py)
    ref_y, ref_idx = F.max_pool2d(x.contiguous(), k, s, p, d, ceil, return_indices=True)
    xr = x.detach().double().contiguous().requires_grad_(True)
    ref_out = F.max_pool2d(xr, k, s, p, d, ceil)
    dy = torch.randn(ref_y.shape, device="cuda").to(x.dtype).contiguous(memory_format=FMT[layout])
    ref_out.backward(dy.double())
    tol = get_op("maxpool2d_bwd").tolerance(dtype, "dx")
    for op_name in ("maxpool2d_fwd_with_indices", "maxpool2d_fwd"):
        xl = x.detach().clone().requires_grad_(True)
        out = getattr(torch.ops.ckgen, op_name)(xl, k, s, p, d, ceil)
        y = out[0] if isinstance(out, tuple) else out
        assert y.dtype == x.dtype and y.is_contiguous(memory_format=FMT[layout])
        torch.testing.assert_close(y, ref_y, atol=0, rtol=0)
        if isinstance(out, tuple):
            assert out[1].dtype == torch.int64 and out[1].is_contiguous(memory_format=FMT[layout])
            assert torch.equal(out[1], ref_idx)
        y.backward(dy)  # stored indices / recomputed argmax
        assert xl.grad.is_contiguous(memory_format=FMT[layout])
        _close(xl.grad, xr.grad, tol, f"{op_name} dx")
    # the backward op directly, both ways
    _, idx = torch.ops.ckgen.maxpool2d_fwd_with_indices(x, k, s, p, d, ceil)
    for ind in (idx, None):
        _close(torch.ops.ckgen.maxpool2d_bwd(dy, x, k, s, p, d, ceil, ind), xr.grad, tol, "maxpool2d_bwd")


@pytest.mark.parametrize("dtype,layout", list(itertools.product(DTYPES, LAYOUTS)))
@pytest.mark.parametrize("kw", AVG_GEOS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()).replace(" ", ""))
def test_avgpool_ops_vs_pytorch(kw, dtype, layout):
    k, s, p, _, ceil = _pairs(kw)
    cip, dv = kw.get("count_include_pad", True), kw.get("divisor_override")
    x = torch.randn(2, 32, 13, 24, device="cuda").to(TORCH_DT[dtype]).contiguous(memory_format=FMT[layout])
    xr = x.detach().double().contiguous().requires_grad_(True)
    ref = F.avg_pool2d(xr, k, s, p, ceil, cip, dv)
    dy = torch.randn(ref.shape, device="cuda").to(x.dtype).contiguous(memory_format=FMT[layout])
    ref.backward(dy.double())
    xl = x.detach().clone().requires_grad_(True)
    y = torch.ops.ckgen.avgpool2d_fwd(xl, k, s, p, ceil, cip, dv)
    assert y.dtype == x.dtype and y.is_contiguous(memory_format=FMT[layout])
    _close(y, ref, get_op("avgpool2d_fwd").tolerance(dtype, "y"), "y")
    y.backward(dy)
    assert xl.grad.is_contiguous(memory_format=FMT[layout])
    tol = get_op("avgpool2d_bwd").tolerance(dtype, "dx")
    _close(xl.grad, xr.grad, tol, "dx")
    _close(torch.ops.ckgen.avgpool2d_bwd(dy, x, k, s, p, ceil, cip, dv), xr.grad, tol, "avgpool2d_bwd")


def test_gradient_in_another_layout_is_converted():
    """Autograd may hand the backward a gradient in another layout than x (here a contiguous
    one for a channels-last x): it is brought to x's layout before the backward kernels."""
    x = torch.randn(2, 64, 16, 16, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_(True)
    y = torch.ops.ckgen.groupnorm_fwd(x, None, None, 8, 1e-5, "none")[0]
    z = torch.ops.ckgen.maxpool2d_fwd(y, [2, 2], [2, 2], [0, 0], [1, 1], False)
    w = torch.ops.ckgen.avgpool2d_fwd(z, [2, 2], [2, 2], [0, 0], False, True, None)
    dw = torch.randn(w.shape, device="cuda")  # NCHW-contiguous
    w.backward(dw)
    xr = x.detach().double().requires_grad_(True)
    F.avg_pool2d(F.max_pool2d(F.group_norm(xr, 8), 2), 2).backward(dw.double())
    assert x.grad.is_contiguous(memory_format=torch.channels_last)
    _close(x.grad, xr.grad, get_op("groupnorm_bwd").tolerance("fp32", "dx"), "dx")


# ---------------------------------------------------------------------------------------------
# opcheck on every op (schema, autograd registration, fake vs real, AOT with dynamic shapes)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,layout", list(itertools.product(DTYPES, LAYOUTS)))
def test_opcheck_every_op(dtype, layout):
    x, dy, gamma, beta = _gn_case((2, 64, 9, 10, 8), dtype, layout)
    y, mean, rstd = torch.ops.ckgen.groupnorm_fwd(x, gamma, beta, 8, 1e-5, "swish")
    mp = ([3, 3], [2, 2], [1, 1], [1, 1], True)
    px = _pool_x(dtype, layout, (2, 64, 9, 10))
    yp, idx = torch.ops.ckgen.maxpool2d_fwd_with_indices(px, *mp)
    dyp = torch.randn(yp.shape, device="cuda").to(x.dtype).contiguous(memory_format=FMT[layout])
    ap = ([3, 2], [2, 2], [1, 0], False, False, None)
    ya = torch.ops.ckgen.avgpool2d_fwd(x, *ap)
    dya = torch.randn(ya.shape, device="cuda").to(x.dtype).contiguous(memory_format=FMT[layout])
    rg = lambda t: t.detach().clone().requires_grad_(True)  # noqa: E731
    calls = [
        ("groupnorm_fwd", (rg(x), rg(gamma), rg(beta), 8, 1e-5, "swish")),
        ("groupnorm_fwd", (rg(x), None, None, 8, 1e-3, "none")),
        ("groupnorm_bwd", (dy, x, mean, rstd, gamma, 8, beta, "swish")),
        ("groupnorm_bwd_data", (dy, x, mean, rstd, gamma, 8, beta, "swish")),
        ("groupnorm_bwd_gamma_beta", (dy, x, mean, rstd, 8, gamma, beta, "swish")),
        ("maxpool2d_fwd", (rg(px), *mp)),
        ("maxpool2d_fwd_with_indices", (rg(px), *mp)),
        ("maxpool2d_bwd", (dyp, px, *mp, idx)),
        ("maxpool2d_bwd", (dyp, px, *mp, None)),
        ("avgpool2d_fwd", (rg(x), *ap)),
        ("avgpool2d_bwd", (dya, x, *ap)),
    ]
    for name, args in calls:
        res = torch.library.opcheck(getattr(torch.ops.ckgen, name).default, args)
        assert all(v == "SUCCESS" for v in res.values()), (name, res)


# ---------------------------------------------------------------------------------------------
# modules against nn, and state_dict round trips
# ---------------------------------------------------------------------------------------------
def _module_pairs(C=64):
    return [
        (nn.GroupNorm(8, C), ct.GroupNorm(8, C)),
        (nn.GroupNorm(8, C, affine=False), ct.GroupNorm(8, C, affine=False)),
        (nn.Sequential(nn.GroupNorm(4, C, eps=1e-6), nn.SiLU()), ct.GroupNormSwish(4, C, eps=1e-6)),
        (nn.MaxPool2d(3, 2, 1), ct.MaxPool2d(3, 2, 1)),
        (nn.MaxPool2d(3, 2, 1, ceil_mode=True), ct.MaxPool2d(3, 2, 1, ceil_mode=True, indices="recompute")),
        (nn.AvgPool2d(3, 2, 1, count_include_pad=False), ct.AvgPool2d(3, 2, 1, count_include_pad=False)),
    ]


@pytest.mark.parametrize("dtype,layout", list(itertools.product(DTYPES, LAYOUTS)))
def test_modules_vs_nn(dtype, layout):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 64, 15, 16, device="cuda", generator=gen)
    x = x.to(TORCH_DT[dtype]).contiguous(memory_format=FMT[layout])
    for ref, mine in _module_pairs():
        src = ref[0] if isinstance(ref, nn.Sequential) else ref
        with torch.no_grad():
            for prm in src.parameters():
                prm.copy_(torch.randn_like(prm) * 0.2 + (1.0 if prm is getattr(src, "weight", None) else 0.0))
        mine = mine.cuda()
        mine.load_state_dict(src.state_dict())
        mine = mine.to(TORCH_DT[dtype])
        ref = ref.cuda().double()
        src.load_state_dict({k: v.double() for k, v in mine.state_dict().items()})  # the same rounded values
        xl = x.detach().clone().requires_grad_(True)
        # The float64 reference runs on NCHW copies: PyTorch's channels-last avg-pool backward is
        # wrong with padding > 0 (pytorch/pytorch#188344; see tests/gpu/test_pool_gpu.py).
        xr = x.detach().double().contiguous().requires_grad_(True)
        y, yr = mine(xl), ref(xr)
        dy = torch.randn(yr.shape, device="cuda", generator=gen).to(x.dtype).contiguous(memory_format=FMT[layout])
        y.backward(dy)
        yr.backward(dy.double().contiguous())
        name = type(mine).__name__
        assert y.dtype == x.dtype and y.is_contiguous(memory_format=FMT[layout]), name
        if isinstance(mine, nn.GroupNorm):
            N, C, H, W = x.shape
            G = mine.num_groups
            act = "swish" if isinstance(mine, ct.GroupNormSwish) else "none"
            op = get_op("groupnorm_bwd")
            p = op.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=dtype, layout=layout, activation=act)
            _close(y, yr, get_op("groupnorm_fwd").tolerance(dtype, "y"), name)
            _close(xl.grad, xr.grad, op.problem_tolerance(p, "dx"), name + " dx")
            for a, b, what in zip(mine.parameters(), ref.parameters(), ("dgamma", "dbeta")):
                _close(a.grad, b.grad, op.problem_tolerance(p, what), f"{name} {what}")
        elif isinstance(mine, nn.MaxPool2d):
            torch.testing.assert_close(y.double(), yr, atol=0, rtol=0)
            _close(xl.grad, xr.grad, get_op("maxpool2d_bwd").tolerance(dtype, "dx"), name + " dx")
        else:
            _close(y, yr, get_op("avgpool2d_fwd").tolerance(dtype, "y"), name)
            _close(xl.grad, xr.grad, get_op("avgpool2d_bwd").tolerance(dtype, "dx"), name + " dx")


@pytest.mark.parametrize("cls", [ct.GroupNorm, ct.GroupNormSwish])
def test_state_dict_round_trip_on_gpu(cls):
    ref = nn.GroupNorm(32, 320, eps=1e-6).cuda()
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    mine = cls(32, 320, eps=1e-6).cuda()
    mine.load_state_dict(ref.state_dict(), strict=True)
    back = nn.GroupNorm(32, 320, eps=1e-6).cuda()
    back.load_state_dict(mine.state_dict(), strict=True)
    for k, v in ref.state_dict().items():
        assert torch.equal(mine.state_dict()[k], v) and torch.equal(back.state_dict()[k], v)
    x = torch.randn(2, 320, 16, 16, device="cuda")
    want = back(x) if cls is ct.GroupNorm else F.silu(back(x))
    _close(mine(x), want, get_op("groupnorm_fwd").tolerance("fp32", "y"), cls.__name__)


# ---------------------------------------------------------------------------------------------
# a small converted model: eager vs nn, torch.compile(fullgraph=True), reduce-overhead, training
# ---------------------------------------------------------------------------------------------
class ResBlock(nn.Module):
    def __init__(self, c, g=8):
        super().__init__()
        self.norm1, self.act1, self.conv1 = nn.GroupNorm(g, c), nn.SiLU(), nn.Conv2d(c, c, 3, padding=1)
        self.norm2, self.act2, self.conv2 = nn.GroupNorm(g, c), nn.SiLU(), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(self.act2(self.norm2(self.conv1(self.act1(self.norm1(x))))))


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.SiLU(), nn.MaxPool2d(3, 2, 1),
        ResBlock(64), nn.AvgPool2d(2), ResBlock(64), nn.GroupNorm(8, 64), nn.SiLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 10))


PATTERNS = [ct.FusePattern(ResBlock, "norm1", "act1"), ct.FusePattern(ResBlock, "norm2", "act2")]
# Whole-model training is compared through a float64 reference: a model under test must be about
# as accurate as the baseline in the same dtype, err <= 2 * err(baseline) + floor, for the losses
# of every step and the gradients of the first (relative errors; floors per dtype: loss, grads).
FLOOR = {"fp32": (1e-4, 2e-3), "fp16": (3e-3, 1e-2), "bf16": (1e-2, 3e-2)}


def _batches(dtype, layout, n):
    gen = torch.Generator(device="cuda").manual_seed(7)
    return [(torch.randn(8, 3, 32, 32, device="cuda", generator=gen).to(TORCH_DT[dtype])
             .contiguous(memory_format=FMT[layout]), torch.randint(0, 10, (8,), device="cuda", generator=gen))
            for _ in range(n)]


def _train(model, fn, batches):
    """A few SGD steps; the losses of every step and the gradients of the first."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, first = [], None
    for x, t in batches:
        torch.compiler.cudagraph_mark_step_begin()  # a new iteration (reduce-overhead; a no-op otherwise)
        out = fn(x)
        loss = F.cross_entropy(out if out.dtype == torch.float64 else out.float(), t)
        loss.backward()
        if first is None:
            first = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return torch.stack(losses), first


def _reference(model, batches):
    """The same weights, trained in float64, NCHW."""
    ref = copy.deepcopy(model).double().to(memory_format=torch.contiguous_format)
    return _train(ref, ref, [(x.double().contiguous(), t) for x, t in batches])


def _errors(run, ref):
    (losses, grads), (ref_losses, ref_grads) = run, ref
    loss_err = ((losses.double() - ref_losses) / ref_losses.abs()).abs().max().item()
    return loss_err, max(_rel(a, b) for a, b in zip(grads, ref_grads))


def _as_accurate(got, base, dtype, what):
    fl, fg = FLOOR[dtype]
    assert got[0] <= 2 * base[0] + fl and got[1] <= 2 * base[1] + fg, \
        f"{what}: (loss, grad) errors {got} vs the baseline's {base} (float64 reference)"


@pytest.mark.parametrize("dtype,layout", [("bf16", "nhwc"), ("fp32", "nchw"), ("fp16", "nhwc")])
def test_converted_model_eager_matches_nn(dtype, layout):
    model = _model().cuda().to(TORCH_DT[dtype]).to(memory_format=FMT[layout])
    mine = copy.deepcopy(model)
    report = ct.convert(mine, patterns=PATTERNS)
    assert report.counts() == {"GroupNorm -> GroupNormSwish": 6, "SiLU -> SiLUPlaceholder": 6, "MaxPool2d -> MaxPool2d": 2,
                               "AvgPool2d -> AvgPool2d": 1}, str(report)
    batches = _batches(dtype, layout, 3)
    ref = _reference(model, batches)
    nn_run = _train(model, model, batches)
    ck_run = _train(mine, mine, batches)
    _as_accurate(_errors(ck_run, ref), _errors(nn_run, ref), dtype, "converted eager vs nn eager")


@pytest.mark.parametrize("compiled", [None, "inductor", "ckgen"])
@pytest.mark.parametrize("dtype,layout", [("bf16", "nhwc"), ("fp32", "nchw"), ("fp16", "nhwc"), ("bf16", "nchw")])
def test_converted_relu_maxpool_stack_matches_nn(dtype, layout, compiled):
    """A VGG-like conv-ReLU-pool stack: convert fuses each ReLU + MaxPool2d into ReLUMaxPool2d
    (pool first); output and input gradient match the nn model in the same dtype, in eager and
    under torch.compile(fullgraph=True) with the pools left to Inductor (the default) or traced
    as ckgen's ops."""
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1, ceil_mode=True),
                        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    ref = ref.cuda().to(TORCH_DT[dtype]).to(memory_format=FMT[layout])
    mine = copy.deepcopy(ref)
    report = ct.convert(mine, max_pool_under_compile=compiled or "inductor")
    assert report.counts() == {"ReLU -> Identity": 3, "MaxPool2d -> ReLUMaxPool2d": 3}, str(report)
    run = torch.compile(mine, fullgraph=True) if compiled else mine
    x = (torch.randn(4, 3, 40, 40, device="cuda") - 0.3).to(TORCH_DT[dtype]).contiguous(memory_format=FMT[layout])
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y1, y2 = run(x1), ref(x2)
    assert y1.is_contiguous(memory_format=FMT[layout])
    dy = torch.randn_like(y2)
    y1.backward(dy)
    y2.backward(dy)
    tol = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 2e-2}[dtype]
    assert _rel(y1, y2) <= tol and _rel(x1.grad, x2.grad) <= 2 * tol, (_rel(y1, y2), _rel(x1.grad, x2.grad))
    assert (y1 == 0).any() and (y1 > 0).any()


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("dtype,layout", [("bf16", "nhwc"), ("fp32", "nchw")])
def test_compiled_converted_model_trains_like_eager(dtype, layout, mode):
    """torch.compile(fullgraph=True) (inductor; with mode="reduce-overhead" in CUDA graphs) of
    the converted model: a few training steps as accurate as the converted model in eager. The
    max pools are traced as ckgen's ops here (max_pool_under_compile="ckgen"), so every ckgen op
    runs in the compiled graph and its CUDA graphs."""
    torch._dynamo.reset()
    base = _model().cuda().to(TORCH_DT[dtype]).to(memory_format=FMT[layout])
    batches = _batches(dtype, layout, 4)
    ref = _reference(base, batches)
    ct.convert(base, patterns=PATTERNS, max_pool_under_compile="ckgen")
    eager, comp = copy.deepcopy(base), copy.deepcopy(base)
    compiled = torch.compile(comp, fullgraph=True, mode=mode)
    eager_run = _train(eager, eager, batches)
    comp_run = _train(comp, compiled, batches)
    _as_accurate(_errors(comp_run, ref), _errors(eager_run, ref), dtype, f"compiled ({mode}) vs eager")
    # and close to each other directly (TF32 convolutions in fp32, on both sides)
    lt = {"fp32": 5e-3, "bf16": 5e-2}[dtype]
    torch.testing.assert_close(comp_run[0], eager_run[0], atol=lt, rtol=lt)
    # inference under no_grad, compiled too (max pooling writes no indices there)
    with torch.no_grad():
        x = batches[0][0]
        torch.compiler.cudagraph_mark_step_begin()
        got = compiled(x).clone()
        want = comp(x)
    # a whole network's output (TF32 convolutions, inductor's own fused elementwise code), so the
    # model-level tolerance above, not one op's
    torch.testing.assert_close(got, want, atol=lt, rtol=lt, msg=lambda m: f"inference: {m}")


@pytest.mark.parametrize("pools", ["ckgen", "inductor"])
def test_compiled_graph_holds_the_ckgen_ops(pools):
    """fullgraph=True succeeds and the AOT graphs hold ckgen's ops, forward and backward; the max
    pools are PyTorch's (for Inductor) unless max_pool_under_compile="ckgen"."""
    torch._dynamo.reset()
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    seen = []

    def backend(gm, inputs):
        def keep(g, _):
            seen.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep)

    m = _model().cuda().to(memory_format=torch.channels_last)
    ct.convert(m, patterns=PATTERNS, max_pool_under_compile=pools)
    x = torch.randn(2, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    torch.compile(m, fullgraph=True, backend=backend)(x).sum().backward()
    ck_pools = ("maxpool2d_fwd_with_indices", "maxpool2d_bwd") if pools == "ckgen" else ()
    for name in ("groupnorm_fwd", "groupnorm_bwd", "avgpool2d_fwd", "avgpool2d_bwd") + ck_pools:
        assert f"ckgen.{name}.kernel" in seen, (name, seen)
    assert not [t for t in seen if t.startswith("ckgen.") and not t.endswith(".kernel")], seen
    assert not any("native_group_norm" in t for t in seen), seen
    aten_pools = [t for t in seen if "max_pool2d" in t and "ckgen" not in t]
    if pools == "ckgen":
        assert not aten_pools and not any("avg_pool2d" in t and "ckgen" not in t for t in seen), seen
    else:
        assert not any("ckgen.maxpool2d" in t for t in seen), seen
        assert any(t.startswith("aten.max_pool2d_with_indices.") for t in aten_pools), seen
        assert any(t.startswith("aten.max_pool2d_with_indices_backward.") for t in aten_pools), seen


# ---------------------------------------------------------------------------------------------
# the rest: double backward, fallback inside the op, streams, autocast
# ---------------------------------------------------------------------------------------------
def test_double_backward_raises():
    x = torch.randn(2, 64, 8, 8, device="cuda", requires_grad=True)
    y = torch.ops.ckgen.groupnorm_fwd(x, None, None, 8, 1e-5, "swish")[0]
    (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(ct.DoubleBackwardError, match="double backward"):
        g.sum().backward()


def test_problem_the_dispatcher_cannot_serve_falls_back_inside_the_op():
    """4096 channels in one group, channels-last: no GroupNorm config takes it; the op runs
    PyTorch's computation (logged once, counted), with the same output layout and values."""
    import ckgen
    from ckgen.runtime.target import current_target

    try:
        ckgen.explain("groupnorm_fwd", N=1, C=4096, H=4, W=4, G=1, dtype="fp32", layout="nhwc",
                      arch=current_target().arch)
        pytest.skip("the dispatcher now serves this problem: pick one it cannot")
    except ValueError:
        pass
    x = torch.randn(1, 4096, 4, 4, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_(True)
    y, mean, rstd = torch.ops.ckgen.groupnorm_fwd(x, None, None, 1, 1e-5, "none")
    y.backward(torch.ones_like(y))
    assert y.is_contiguous(memory_format=torch.channels_last) and mean.shape == (1, 1)
    torch.testing.assert_close(y, F.group_norm(x.detach(), 1), atol=1e-4, rtol=1e-4)
    notes = ct.fallbacks()
    assert any(op == "ckgen::groupnorm_fwd" and "no config" in why for op, why in notes), notes
    ct.reset_fallbacks()  # expected here


def test_side_stream_and_autocast():
    m = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.SiLU(), nn.MaxPool2d(2)).cuda()
    ref = copy.deepcopy(m)
    ct.convert(m)
    x = torch.randn(4, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = m(x)
    torch.cuda.current_stream().wait_stream(s)
    _close(y, ref(x), get_op("groupnorm_fwd").tolerance("fp32", "y"), "side stream")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ya, yr = m(x), ref(x)
    assert ya.dtype == torch.bfloat16  # ckgen keeps the conv's bf16; nn.GroupNorm autocasts to float32
    _close(ya.float(), yr.float(), get_op("groupnorm_fwd").tolerance("bf16", "y"), "autocast")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eager_modules_take_the_fast_path_and_match_pytorch(layout):
    """In eager mode the modules run the autograd Functions of ckgen.torch.eager (not the custom
    ops' per-call glue); values and gradients still match PyTorch's, and a double backward
    still raises DoubleBackwardError."""
    torch.manual_seed(0)
    fmt = FMT[layout]
    x = torch.randn(4, 64, 17, 19, device="cuda").contiguous(memory_format=fmt).requires_grad_(True)
    # The reference runs on an NCHW copy: PyTorch's own channels-last avg_pool2d backward on CUDA
    # is wrong for some shapes (bench/results/logs/avg_bwd_nhwc_check.log), ckgen's is not.
    xr = x.detach().contiguous().requires_grad_(True)
    gn, gn_ref = ct.GroupNormSwish(8, 64).cuda(), nn.GroupNorm(8, 64).cuda()
    with torch.no_grad():
        gn.weight.normal_(1, 0.1), gn.bias.normal_(0, 0.1)
        gn_ref.weight.copy_(gn.weight), gn_ref.bias.copy_(gn.bias)
    for mine, ref, fn in ((gn, lambda t: F.silu(gn_ref(t)), "GroupNormFnBackward"),
                          (ct.MaxPool2d(3, 2, 1), nn.MaxPool2d(3, 2, 1), "MaxPoolFnBackward"),
                          (ct.MaxPool2d(3, 2, 1, indices="recompute"), nn.MaxPool2d(3, 2, 1), "MaxPoolFnBackward"),
                          (ct.AvgPool2d(3, 2, 1), nn.AvgPool2d(3, 2, 1), "AvgPoolFnBackward")):
        y, yr = mine(x), ref(xr)
        assert type(y.grad_fn).__name__ == fn, (fn, y.grad_fn)
        assert y.is_contiguous(memory_format=fmt)
        dy = torch.randn_like(yr)
        (gx,) = torch.autograd.grad(y, x, dy)
        (gr,) = torch.autograd.grad(yr, xr, dy)
        torch.testing.assert_close(y, yr, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(gx, gr, atol=1e-4, rtol=1e-4)
        assert gx.is_contiguous(memory_format=fmt)
    y = gn(x)
    y.backward(torch.ones_like(y))
    yr = F.silu(gn_ref(xr))
    yr.backward(torch.ones_like(yr))
    torch.testing.assert_close(gn.weight.grad, gn_ref.weight.grad, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(gn.bias.grad, gn_ref.bias.grad, atol=1e-3, rtol=1e-4)
    (g,) = torch.autograd.grad(gn(x).square().sum(), x, create_graph=True)
    with pytest.raises(ct.DoubleBackwardError, match="has no backward"):
        g.sum().backward()
