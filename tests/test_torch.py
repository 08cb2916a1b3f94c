"""CPU tier of ckgen.torch: registration, fake (meta) kernels and shape inference, opcheck and
gradcheck against the ops' CPU kernels (PyTorch's computation), the modules' CPU fallback
against nn, state_dict round trips, convert and its report, torch.compile(fullgraph=True) on
the CPU, and that `import ckgen` does not import torch."""
from __future__ import annotations

import copy
import logging
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import ckgen.torch as ct  # noqa: E402
from ckgen.torch import functional as CF  # noqa: E402
from ckgen.torch import ops as O  # noqa: E402

CL = torch.channels_last
FORMATS = {"nchw": torch.contiguous_format, "nhwc": CL}
OP_NAMES = ["groupnorm_fwd", "groupnorm_fwd_fused", "groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta", "maxpool2d_fwd",
            "maxpool2d_fwd_with_indices", "maxpool2d_bwd", "avgpool2d_fwd", "avgpool2d_bwd"]


@pytest.fixture
def route_cpu(monkeypatch):
    """CPU tensors go through the ckgen custom ops (their CPU kernels) instead of nn's op."""
    monkeypatch.setattr(CF, "_ROUTE_CPU", True)
    ct.reset_fallbacks()
    yield
    ct.reset_fallbacks()


def _x(shape=(2, 8, 9, 11), dtype=torch.float32, layout="nchw", seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=FORMATS[layout])
    return x.requires_grad_(requires_grad)


def _distinct(shape=(2, 4, 9, 11), dtype=torch.float64, layout="nchw", seed=0):
    """Values with no ties (max pooling's gradient is then well defined for gradcheck)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    x = (torch.randperm(n, generator=g).to(torch.float64) / n).reshape(shape)
    return x.to(dtype).contiguous(memory_format=FORMATS[layout])


# ---------------------------------------------------------------------------------------------
# import boundary
# ---------------------------------------------------------------------------------------------
def test_import_ckgen_does_not_import_torch():
    code = ("import sys, ckgen, ckgen.cli, ckgen.runtime.dispatch, ckgen.runtime.api, ckgen.offline.opbench\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
            "import ckgen.torch\nassert 'torch' in sys.modules and hasattr(sys.modules['torch'], 'ops')\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# registration and schemas
# ---------------------------------------------------------------------------------------------
def test_every_op_is_registered_under_the_ckgen_namespace():
    for name in OP_NAMES:
        packet = getattr(torch.ops.ckgen, name)
        assert packet.default._schema.name == f"ckgen::{name}"
    s = str(torch.ops.ckgen.groupnorm_fwd.default._schema)
    assert s.startswith("ckgen::groupnorm_fwd(Tensor x, Tensor? gamma, Tensor? beta, SymInt groups, float eps=")
    assert s.endswith('str activation="none") -> (Tensor, Tensor, Tensor)')
    assert "Tensor? indices=None" in str(torch.ops.ckgen.maxpool2d_bwd.default._schema)
    assert "SymInt? divisor_override=None" in str(torch.ops.ckgen.avgpool2d_fwd.default._schema)
    assert set(O.ALL_OPS) == set(OP_NAMES)


# ---------------------------------------------------------------------------------------------
# fake (meta) kernels: shapes, strides, dtypes as the real op returns them
# ---------------------------------------------------------------------------------------------
def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _same_meta(a, b):
    """Same shape, dtype and strides of the dims of size > 1 (what inductor's assert_size_stride
    checks; fake empty_like normalizes the free strides of size-1 dims)."""
    def significant(t):
        return [st for st, n in zip(t.stride(), t.shape) if n != 1]

    assert a.shape == b.shape and significant(a) == significant(b) and a.dtype == b.dtype, \
        (a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype)


def _sample_calls(x):
    """(op name, args) for every op on x, args of the backward ops consistent with the forward."""
    C = x.shape[1]
    g = torch.randn(C, dtype=x.dtype)
    b = torch.randn(C, dtype=x.dtype)
    y, mean, rstd = torch.ops.ckgen.groupnorm_fwd(x, g, b, 4, 1e-5, "swish")
    dy = torch.randn_like(y)
    mp = ([3, 3], [2, 2], [1, 1], [1, 1], True)
    yp, idx = torch.ops.ckgen.maxpool2d_fwd_with_indices(x, *mp)
    dyp = torch.randn_like(yp)
    ap = ([3, 2], [2, 2], [1, 0], False, False, None)
    ya = torch.ops.ckgen.avgpool2d_fwd(x, *ap)
    return [
        ("groupnorm_fwd", (x, g, b, 4, 1e-5, "swish")),
        ("groupnorm_fwd", (x, None, None, 4, 1e-3, "none")),
        ("groupnorm_bwd", (dy, x, mean, rstd, g, 4, b, "swish")),
        ("groupnorm_bwd_data", (dy, x, mean, rstd, None, 4, None, "none")),
        ("groupnorm_bwd_gamma_beta", (dy, x, mean, rstd, 4, g, b, "swish")),
        ("maxpool2d_fwd", (x, *mp)),
        ("maxpool2d_fwd_with_indices", (x, *mp)),
        ("maxpool2d_bwd", (dyp, x, *mp, idx)),
        ("maxpool2d_bwd", (dyp, x, *mp, None)),
        ("avgpool2d_fwd", (x, *ap)),
        ("avgpool2d_bwd", (torch.randn_like(ya), x, *ap)),
    ]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_meta_outputs_match_the_real_kernel(layout, dtype):
    x = _x(dtype=dtype, layout=layout)
    for name, args in _sample_calls(x):
        op = getattr(torch.ops.ckgen, name)
        real = op(*args)
        fake = op(*[_meta(a) if isinstance(a, torch.Tensor) else a for a in args])
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        assert len(real) == len(fake)
        for r, f in zip(real, fake):
            assert f.device.type == "meta"
            _same_meta(r, f)


def test_meta_outputs_match_for_odd_strides_of_size_1_dims():
    """Outputs shaped like x are torch.empty_like(x), as ckgen allocates them (the real op keeps
    even the free stride of a size-1 dim; fake tensors normalize it, which inductor ignores)."""
    x = torch.randn(80).as_strided((2, 8, 1, 5), (40, 5, 7, 1))  # NCHW, with a free stride for H
    for name, args in _sample_calls(x):
        op = getattr(torch.ops.ckgen, name)
        real = op(*args)
        fake = op(*[_meta(a) if isinstance(a, torch.Tensor) else a for a in args])
        for r, f in zip(real if isinstance(real, tuple) else (real,), fake if isinstance(fake, tuple) else (fake,)):
            _same_meta(r, f)
    y = torch.ops.ckgen.groupnorm_fwd(x, None, None, 4, 1e-5, "none")[0]
    assert y.stride() == (40, 5, 7, 1)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_fake_shapes_layouts_and_dtypes(layout):
    fmt = FORMATS[layout]
    x = torch.empty(4, 64, 17, 16, device="meta", dtype=torch.bfloat16).contiguous(memory_format=fmt)
    y, mean, rstd = torch.ops.ckgen.groupnorm_fwd(x, None, None, 8, 1e-5, "swish")
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=fmt)
    assert mean.shape == rstd.shape == (4, 8) and mean.dtype == rstd.dtype == torch.float32 and mean.is_contiguous()
    dx, dg, db = torch.ops.ckgen.groupnorm_bwd(y, x, mean, rstd, None, 8)
    assert dx.is_contiguous(memory_format=fmt) and dg.shape == db.shape == (64,) and dg.dtype == torch.bfloat16
    for ceil, want in ((False, (9, 8)), (True, (9, 9))):
        y, idx = torch.ops.ckgen.maxpool2d_fwd_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], ceil)
        ref = F.max_pool2d(torch.empty(4, 64, 17, 16, device="meta"), 3, 2, 1, ceil_mode=ceil)
        assert y.shape == ref.shape == (4, 64, *want)
        assert idx.dtype == torch.int64 and idx.is_contiguous(memory_format=fmt) and y.is_contiguous(memory_format=fmt)
    y = torch.ops.ckgen.maxpool2d_fwd(x, [2, 2], [1, 1], [0, 0], [3, 2], False)  # dilation
    assert y.shape == (4, 64, 14, 14)
    y = torch.ops.ckgen.avgpool2d_fwd(x, [5, 3], [3, 2], [2, 1], True, False, 7)
    assert y.shape == F.avg_pool2d(torch.empty(4, 64, 17, 16, device="meta"), (5, 3), (3, 2), (2, 1), True).shape


def test_fake_tensor_mode_shape_inference():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    x = mode.from_tensor(_x((3, 32, 20, 20), torch.float16, "nhwc"))
    with mode:
        y = torch.ops.ckgen.maxpool2d_fwd(x, [3, 3], [2, 2], [1, 1], [1, 1], False)
        z = torch.ops.ckgen.avgpool2d_fwd(y, [2, 2], [2, 2], [0, 0], False, True, None)
        n, mean, _ = torch.ops.ckgen.groupnorm_fwd(z, None, None, 8, 1e-5, "none")
    assert y.shape == (3, 32, 10, 10) and z.shape == (3, 32, 5, 5) and n.shape == z.shape
    assert n.is_contiguous(memory_format=CL) and mean.shape == (3, 8)


@pytest.mark.parametrize("call,exc,word", [
    (lambda x: torch.ops.ckgen.groupnorm_fwd(x, None, None, 3), ValueError, "groups"),
    (lambda x: torch.ops.ckgen.groupnorm_fwd(x, None, None, 4, 1e-5, "relu"), ValueError, "activation"),
    (lambda x: torch.ops.ckgen.maxpool2d_fwd(x, [2, 2], [2, 2], [2, 2], [1, 1], False), ValueError, "padding"),
    (lambda x: torch.ops.ckgen.groupnorm_fwd(x[0], None, None, 4), ValueError, "x"),
])
def test_fake_kernels_reject_what_ckgen_rejects(call, exc, word):
    x = torch.empty(2, 8, 6, 6, device="meta")
    with pytest.raises(exc) as ei:
        call(x)
    assert str(ei.value).startswith(word + ":"), str(ei.value)


# ---------------------------------------------------------------------------------------------
# any strides: the ops copy what is neither NCHW-contiguous nor channels-last (fake and real alike)
# ---------------------------------------------------------------------------------------------
def _strided_inputs():
    """(name, x) of 4-D tensors that are neither NCHW-contiguous nor channels-last."""
    g = torch.Generator().manual_seed(3)
    cl = torch.randn(2, 8, 14, 14, generator=g).contiguous(memory_format=CL)
    nchw = torch.randn(2, 8, 12, 10, generator=g)
    return [
        ("7x7 crop of a 14x14 channels-last buffer", cl[:, :, :7, :7]),  # strides (1568, 1, 112, 8)
        ("every other row and column (channels-last)", cl[:, :, ::2, ::2]),
        ("channel slice of NCHW", nchw[:, 2:6]),
        ("W slice of NCHW", nchw[..., 1:8]),
        ("transposed H and W", nchw.transpose(2, 3)),
        ("expanded over N", nchw[:1].expand(3, -1, -1, -1)),
        ("expanded over H", torch.randn(2, 8, 1, 10, generator=g).expand(-1, -1, 6, -1)),
    ]


@pytest.mark.parametrize("case", range(7))
def test_ops_take_any_strides(case):
    """Every op on a strided x (and a strided dy, strided indices and strided vectors) returns
    what it returns on the dense copy, in the layout the fake kernel predicts."""
    what, x = _strided_inputs()[case]
    assert not (x.is_contiguous() or x.is_contiguous(memory_format=CL)), what
    fmt = O.layout_for(x)
    dense = x.contiguous(memory_format=fmt)
    torch.manual_seed(0)
    calls = _sample_calls(x)
    torch.manual_seed(0)  # the same gamma, beta and dy for the dense copy
    for (name, args), (_, dargs) in zip(calls, _sample_calls(dense)):
        op = getattr(torch.ops.ckgen, name)
        # strided companions: dy as a transposed copy, gamma/beta/mean/rstd as strided views
        args = [_restride(a, i, name) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
        got, want = op(*args), op(*dargs)
        fake = op(*[_meta(a) if isinstance(a, torch.Tensor) else a for a in args])
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        fake = fake if isinstance(fake, tuple) else (fake,)
        for gt, wt, ft in zip(got, want, fake):
            torch.testing.assert_close(gt, wt, msg=f"{what}: {name}")
            _same_meta(gt, ft)
            if gt.shape == x.shape:
                assert gt.is_contiguous(memory_format=fmt), (what, name, gt.stride())


def _restride(t, i, name):
    """t with the same values and other strides: a backward op's dy (argument 0) as a transposed
    copy's transposed view, vectors (gamma, beta, mean, rstd) as stride-2 views; x unchanged."""
    if t.dim() == 4 and i == 0 and "bwd" in name and t.shape[2] > 1:
        return t.transpose(2, 3).contiguous().transpose(2, 3)  # neither layout when H, W > 1 and differ
    if t.dim() in (1, 2) and t.numel() > 1:
        return torch.stack([t, torch.zeros_like(t)], -1)[..., 0]
    return t


def test_strided_opcheck_and_gradients():
    """opcheck (fake vs real strides, autograd registration) on a crop of a channels-last buffer, and
    gradients through the ops equal those of the dense copy."""
    base = _x((2, 8, 14, 14), layout="nhwc")
    x = base[:, :, :7, :7]
    for name, args in _sample_calls(x):
        res = torch.library.opcheck(getattr(torch.ops.ckgen, name).default, args)
        assert all(v == "SUCCESS" for v in res.values()), (name, res)
    xs = base.detach().clone()[:, :, :7, :7].requires_grad_(True)
    xd = xs.detach().contiguous(memory_format=CL).requires_grad_(True)
    g = torch.randn(8, requires_grad=True)
    for t in (xs, xd):
        y = torch.ops.ckgen.groupnorm_fwd(t, g, None, 4, 1e-5, "swish")[0]
        y = torch.ops.ckgen.maxpool2d_fwd(y, [2, 2], [2, 2], [0, 0], [1, 1], True)
        torch.ops.ckgen.avgpool2d_fwd(y, [2, 2], [1, 1], [0, 0], False, True, None).square().sum().backward()
    torch.testing.assert_close(xs.grad, xd.grad)


@pytest.mark.quality  # Inductor's first CPU compile in a process costs ~20 CPU-seconds (its C++ toolchain)
@pytest.mark.parametrize("view", ["crop", "transpose", "expand"])
def test_compile_inductor_passes_views_to_the_ops(view, route_cpu):
    """torch.compile (Inductor, CPU) of code that feeds the ops a view: compiles, runs and matches
    eager. The quality tier's: the fast tier traces the same ops with aot_eager."""
    torch._dynamo.reset()

    def f(base, g):
        x = {"crop": lambda: base[:, :, :7, :7], "transpose": lambda: base.transpose(2, 3),
             "expand": lambda: base[:1].expand(2, -1, -1, -1)}[view]()
        y = torch.ops.ckgen.groupnorm_fwd(x, g, None, 4, 1e-5, "swish")[0]
        y = torch.ops.ckgen.avgpool2d_fwd(y, [2, 2], [2, 2], [0, 0], True, False, None)
        return torch.ops.ckgen.maxpool2d_fwd(y, [2, 2], [1, 1], [0, 0], [1, 1], False)

    base = _x((2, 8, 14, 14), layout="nhwc").requires_grad_(True)
    g = torch.randn(8, requires_grad=True)
    out = torch.compile(f, fullgraph=True, backend="inductor")(base, g)
    ref = f(base.detach().requires_grad_(True), g.detach().requires_grad_(True))
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert base.grad is not None and g.grad is not None and base.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# opcheck (schema, autograd registration, fake tensor, AOT dispatch with dynamic shapes)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_opcheck_every_op(layout):
    x = _x((2, 8, 7, 9), torch.float32, layout)
    calls = _sample_calls(x)
    calls.append(("groupnorm_fwd", (x.detach().clone().requires_grad_(True), *calls[0][1][1:])))
    x2 = _distinct((2, 8, 7, 9), torch.float32, layout).requires_grad_(True)
    calls.append(("maxpool2d_fwd_with_indices", (x2, [3, 3], [2, 2], [1, 1], [1, 1], False)))
    calls.append(("maxpool2d_fwd", (x2, [2, 3], [1, 2], [1, 0], [1, 1], True)))
    calls.append(("avgpool2d_fwd", (x2, [3, 3], [2, 2], [1, 1], True, True, None)))
    xf = x.detach().clone().requires_grad_(True)
    r = torch.randn_like(xf).requires_grad_(True)
    bn = torch.randn(2, 8).requires_grad_(True)
    calls.append(("groupnorm_fwd_fused", (xf, torch.ones(8, requires_grad=True), torch.zeros(8), 4, 1e-5,
                                          "gelu_tanh", r, bn)))
    seen = set()
    for name, args in calls:
        res = torch.library.opcheck(getattr(torch.ops.ckgen, name).default, args)
        assert all(v == "SUCCESS" for v in res.values()), (name, res)
        seen.add(name)
    assert seen == set(OP_NAMES)


# ---------------------------------------------------------------------------------------------
# autograd: gradcheck in float64 (the CPU kernels take float64) and against PyTorch's autograd
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("act", ["none", "swish", "relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("res,bias", [(True, False), (False, True), (True, True)])
def test_groupnorm_fused_gradcheck_and_matches_the_pytorch_code(layout, act, res, bias):
    """ckgen::groupnorm_fwd_fused's value and gradients (its composed backward) against the
    PyTorch code it replaces, and gradcheck in float64."""
    x = _x((2, 6, 4, 5), torch.float64, layout).requires_grad_(True)
    g = (1 + 0.3 * torch.randn(6, dtype=torch.float64)).requires_grad_(True)
    b = (0.3 * torch.randn(6, dtype=torch.float64)).requires_grad_(True)
    r = torch.randn(2, 6, 4, 5, dtype=torch.float64).contiguous(memory_format=FORMATS[layout]).requires_grad_(res)
    bn = torch.randn(2, 6, dtype=torch.float64).requires_grad_(bias)
    rr, bb = (r if res else None), (bn if bias else None)
    ins = tuple(t for t in (x, g, b, rr, bb) if t is not None)

    def ours(*ts):
        it = iter(ts)
        xx, gg, be = next(it), next(it), next(it)
        return O.groupnorm_fwd_fused(xx, gg, be, 3, 1e-5, act, next(it) if res else None, next(it) if bias else None)[0]

    def theirs(*ts):
        it = iter(ts)
        xx, gg, be = next(it), next(it), next(it)
        rr2, bb2 = (next(it) if res else None), (next(it) if bias else None)
        h = xx + bb2[:, :, None, None] if bb2 is not None else xx
        y = torch.nn.functional.group_norm(h, 3, gg, be, 1e-5)
        return O._FUSED_ACTS[act](y + rr2 if rr2 is not None else y)

    assert torch.autograd.gradcheck(ours, ins)
    torch.testing.assert_close(ours(*ins), theirs(*ins))
    dy = torch.randn(2, 6, 4, 5, dtype=torch.float64)
    for a, b2 in zip(torch.autograd.grad(ours(*ins), ins, dy), torch.autograd.grad(theirs(*ins), ins, dy)):
        torch.testing.assert_close(a, b2, atol=1e-6, rtol=1e-5)  # mean/rstd are float32 outputs


def test_groupnorm_fused_refuses_what_it_cannot_take():
    x = _x((2, 6, 4, 5))
    with pytest.raises(ValueError, match="activation"):
        O.groupnorm_fwd_fused(x, None, None, 3, 1e-5, "tanh")
    with pytest.raises(ValueError, match="residual"):
        O.groupnorm_fwd_fused(x, None, None, 3, 1e-5, "relu", x[:, :, :2])
    with pytest.raises(ValueError, match="bias_nc"):
        O.groupnorm_fwd_fused(x, None, None, 3, 1e-5, "relu", None, torch.zeros(2, 5))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("act", ["none", "swish"])
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
def test_groupnorm_gradcheck(layout, act, affine):
    x = _x((2, 6, 4, 5), torch.float64, layout).requires_grad_(True)
    g = (1 + 0.3 * torch.randn(6, dtype=torch.float64)).requires_grad_(True) if affine[0] else None
    b = (0.3 * torch.randn(6, dtype=torch.float64)).requires_grad_(True) if affine[1] else None
    inputs = tuple(t for t in (x, g, b) if t is not None)

    def f(*ts):
        it = iter(ts)
        xx = next(it)
        gg = next(it) if g is not None else None
        bb = next(it) if b is not None else None
        return torch.ops.ckgen.groupnorm_fwd(xx, gg, bb, 3, 1e-5, act)[0]

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_pool_gradcheck(layout):
    """fast_mode: the Jacobian against the numerical one along random directions (two function
    calls per direction, not two per input element: the full check took 20 CPU-seconds); a wrong
    gradient element moves the projection all the same."""
    x = _distinct((2, 3, 7, 6), torch.float64, layout).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: torch.ops.ckgen.maxpool2d_fwd(t, [3, 3], [2, 2], [1, 1], [1, 1], True),
                                    (x,), eps=1e-7, fast_mode=True)
    assert torch.autograd.gradcheck(
        lambda t: torch.ops.ckgen.maxpool2d_fwd_with_indices(t, [2, 2], [1, 2], [0, 1], [2, 1], False)[0], (x,), eps=1e-7,
        fast_mode=True)
    assert torch.autograd.gradcheck(
        lambda t: torch.ops.ckgen.avgpool2d_fwd(t, [3, 2], [2, 1], [1, 1], True, False, None), (x,), fast_mode=True)
    assert torch.autograd.gradcheck(
        lambda t: torch.ops.ckgen.avgpool2d_fwd(t, [3, 3], [2, 2], [1, 1], False, True, 5), (x,), fast_mode=True)


def test_pool_gradcheck_fails_on_a_wrong_gradient():
    """The fast mode finds one wrong gradient element."""
    x = _distinct((2, 3, 7, 6), torch.float64, "nchw").requires_grad_(True)

    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return torch.ops.ckgen.avgpool2d_fwd(t, [3, 3], [2, 2], [1, 1], False, True, None)

        @staticmethod
        def backward(ctx, g):
            with torch.enable_grad():  # the op's own gradient, then one element of it off
                t = x.detach().requires_grad_(True)
                (gx,) = torch.autograd.grad(torch.ops.ckgen.avgpool2d_fwd(t, [3, 3], [2, 2], [1, 1], False, True, None),
                                            t, g)
            gx = gx.clone()
            gx.view(-1)[17] += 1e-3
            return gx

    from torch.autograd.gradcheck import GradcheckError

    with pytest.raises(GradcheckError):
        torch.autograd.gradcheck(Wrong.apply, (x,), fast_mode=True)


@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, True), (False, True, False),
                                   (True, False, True)])
def test_groupnorm_backward_picks_the_op_for_the_grads_needed(needs, route_cpu):
    """x only -> groupnorm_bwd_data; gamma/beta only -> groupnorm_bwd_gamma_beta; both -> groupnorm_bwd;
    the grads agree with PyTorch's autograd."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "ckgen":
                self.names.append(func._opname)
            return func(*args, **(kwargs or {}))

    x = _x((2, 8, 5, 5), layout="nhwc").requires_grad_(needs[0])
    g = torch.randn(8).requires_grad_(needs[1])
    b = torch.randn(8).requires_grad_(needs[2])
    with Calls() as calls:
        y = ct.group_norm(x, 4, g, b, activation="swish")
        y.backward(torch.ones_like(y))
    want = {(True, True): "groupnorm_bwd", (True, False): "groupnorm_bwd_data",
            (False, True): "groupnorm_bwd_gamma_beta"}[(needs[0], needs[1] or needs[2])]
    assert calls.names == ["groupnorm_fwd", want], calls.names
    # (NCHW reference: PyTorch's CPU channels-last GroupNorm backward crashes when x needs no grad)
    xr, gr, br = (t.detach().contiguous().requires_grad_(t.requires_grad) for t in (x, g, b))
    F.silu(F.group_norm(xr, 4, gr, br)).backward(torch.ones_like(y))
    for t, r in ((x, xr), (g, gr), (b, br)):
        if r.requires_grad:
            torch.testing.assert_close(t.grad, r.grad, atol=1e-5, rtol=1e-5)
        else:
            assert t.grad is None
    assert x.grad is None or x.grad.is_contiguous(memory_format=CL)


def test_double_backward_raises_a_clear_error():
    x = _x((2, 4, 5, 5), torch.float64).requires_grad_(True)
    y = torch.ops.ckgen.groupnorm_fwd(x, None, None, 2, 1e-5, "swish")[0]
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(ct.DoubleBackwardError, match="double backward"):
        gx.sum().backward()
    for fwd in (lambda t: torch.ops.ckgen.maxpool2d_fwd(t, [2, 2], [2, 2], [0, 0], [1, 1], False),
                lambda t: torch.ops.ckgen.avgpool2d_fwd(t, [2, 2], [2, 2], [0, 0], False, True, None)):
        (gx,) = torch.autograd.grad(fwd(x).square().sum(), x, create_graph=True)
        with pytest.raises(ct.DoubleBackwardError, match="ckgen::(maxpool2d|avgpool2d)_bwd has no backward"):
            gx.sum().backward()


def test_mean_rstd_and_indices_are_not_differentiable():
    x = _x((2, 4, 6, 6)).requires_grad_(True)
    y, mean, rstd = torch.ops.ckgen.groupnorm_fwd(x, None, None, 2, 1e-5, "none")
    assert y.requires_grad and not mean.requires_grad and not rstd.requires_grad
    y, idx = torch.ops.ckgen.maxpool2d_fwd_with_indices(x, [2, 2], [2, 2], [0, 0], [1, 1], False)
    assert y.requires_grad and not idx.requires_grad and idx.dtype == torch.int64


# ---------------------------------------------------------------------------------------------
# modules: CPU fallback = nn's op exactly; routed through the ops = nn within float tolerance
# ---------------------------------------------------------------------------------------------
def _pairs():
    return [
        (nn.GroupNorm(4, 16), ct.GroupNorm(4, 16), None),
        (nn.GroupNorm(4, 16, affine=False), ct.GroupNorm(4, 16, affine=False), None),
        (nn.Sequential(nn.GroupNorm(8, 16, eps=1e-3), nn.SiLU()), ct.GroupNormSwish(8, 16, eps=1e-3), None),
        (nn.MaxPool2d(3, 2, 1), ct.MaxPool2d(3, 2, 1), None),
        (nn.MaxPool2d((2, 3), (1, 2), (1, 0), dilation=(2, 1), ceil_mode=True),
         ct.MaxPool2d((2, 3), (1, 2), (1, 0), dilation=(2, 1), ceil_mode=True, indices="recompute"), None),
        (nn.MaxPool2d(2, return_indices=True), ct.MaxPool2d(2, return_indices=True), None),
        (nn.AvgPool2d(3, 2, 1), ct.AvgPool2d(3, 2, 1), None),
        (nn.AvgPool2d((3, 2), 2, (1, 1), ceil_mode=True, count_include_pad=False),
         ct.AvgPool2d((3, 2), 2, (1, 1), ceil_mode=True, count_include_pad=False), None),
        (nn.AvgPool2d(2, divisor_override=3), ct.AvgPool2d(2, divisor_override=3), None),
    ]


def _run(m, x):
    x = x.detach().clone().requires_grad_(True)
    out = m(x)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype))
    grads = [p.grad for p in m.parameters()]
    return out, x.grad, grads


def _load(ref, mine):
    sd = ref.state_dict() if not isinstance(ref, nn.Sequential) else ref[0].state_dict()
    mine.load_state_dict(sd, strict=True)
    with torch.no_grad():
        for p in mine.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    target = ref if not isinstance(ref, nn.Sequential) else ref[0]
    target.load_state_dict(mine.state_dict(), strict=True)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_modules_fall_back_to_nn_on_cpu(layout, caplog):
    ct.reset_fallbacks()
    x = _distinct((2, 16, 9, 10), torch.float32, layout)
    with caplog.at_level(logging.WARNING, logger="ckgen"):
        for ref, mine, _ in _pairs():
            _load(ref, mine)
            (out_r, gx_r, gp_r), (out_m, gx_m, gp_m) = _run(ref, x), _run(mine, x)
            for a, b in zip(out_m if isinstance(out_m, tuple) else (out_m,),
                            out_r if isinstance(out_r, tuple) else (out_r,)):
                assert torch.equal(a, b), type(mine).__name__
            assert torch.equal(gx_m, gx_r)
            for a, b in zip(gp_m, gp_r):
                assert torch.equal(a, b)
        mine(x)  # a second call of the same kind is not logged again
    notes = [r.getMessage() for r in caplog.records if "runs PyTorch's op" in r.getMessage()]
    assert len(notes) == len(set(notes)) == 4, notes  # group_norm, group_norm+silu, max_pool2d, avg_pool2d
    assert all("a CPU tensor" in n for n in notes)
    assert all(n >= 1 for n in ct.fallbacks().values())


# per dtype: (output and dx, dgamma/dbeta) against nn's module evaluated in float64
_TOL = {torch.float32: (dict(atol=1e-5, rtol=1e-5), dict(atol=1e-4, rtol=1e-4)),
        torch.bfloat16: (dict(atol=3e-2, rtol=1.6e-2), dict(atol=3e-2, rtol=1.6e-2))}


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modules_through_the_ops_match_nn(layout, dtype, route_cpu):
    x = _distinct((2, 16, 9, 10), dtype, layout)
    for ref, mine, _ in _pairs():
        _load(ref, mine)
        ref, mine = ref.double(), mine.to(dtype)
        (out_r, gx_r, gp_r), (out_m, gx_m, gp_m) = _run(ref, x.double()), _run(mine, x)
        tol, ptol = _TOL[dtype]
        outs_m = out_m if isinstance(out_m, tuple) else (out_m,)
        outs_r = out_r if isinstance(out_r, tuple) else (out_r,)
        for a, b in zip(outs_m, outs_r):
            assert a.is_contiguous(memory_format=FORMATS[layout]), type(mine).__name__
            if a.is_floating_point():
                assert a.dtype == dtype
                torch.testing.assert_close(a.double(), b, **tol)
            else:
                assert torch.equal(a, b)
        torch.testing.assert_close(gx_m.double(), gx_r, **tol)
        assert gx_m.is_contiguous(memory_format=FORMATS[layout])
        for a, b in zip(gp_m, gp_r):
            torch.testing.assert_close(a.double(), b, **ptol)
    assert ct.fallbacks() == {}


def test_max_pool_writes_indices_only_when_needed(route_cpu):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "ckgen":
                self.names.append(func._opname)
            return func(*args, **(kwargs or {}))

    x = _distinct((2, 4, 8, 8), torch.float32)
    for indices, grad, ret, want in [
        ("stored", True, False, ["maxpool2d_fwd_with_indices", "maxpool2d_bwd"]),
        ("stored", False, False, ["maxpool2d_fwd"]),
        ("recompute", True, False, ["maxpool2d_fwd", "maxpool2d_bwd"]),
        ("recompute", True, True, ["maxpool2d_fwd_with_indices", "maxpool2d_bwd"]),
        ("recompute", False, True, ["maxpool2d_fwd_with_indices"]),
    ]:
        m = ct.MaxPool2d(3, 2, 1, return_indices=ret, indices=indices)
        xx = x.clone().requires_grad_(grad)
        with Calls() as calls:
            out = m(xx)
            y = out[0] if ret else out
            if grad:
                y.sum().backward()
        assert calls.names == want, (indices, grad, ret, calls.names)
        ref = F.max_pool2d(x.clone().requires_grad_(True), 3, 2, 1)
        torch.testing.assert_close(y, ref, atol=0, rtol=0)
        if grad:
            ref.sum().backward()
    with torch.no_grad():
        with Calls() as calls:
            ct.MaxPool2d(2)(x.clone().requires_grad_(True))
        assert calls.names == ["maxpool2d_fwd"]


def _fallback_cases():
    return [  # (module, input, nn's result, the reason ckgen gives)
        (ct.GroupNorm(2, 4), torch.randn(2, 4, 10), lambda t: F.group_norm(t, 2), "a 3-D input"),
        (ct.GroupNormSwish(2, 4).double(), torch.randn(2, 4, 3, 3, dtype=torch.float64),
         lambda t: F.silu(F.group_norm(t, 2)), "dtype torch.float64"),
        (ct.MaxPool2d(2), torch.randn(4, 6, 6), lambda t: F.max_pool2d(t, 2), "a 3-D input"),
        (ct.AvgPool2d(2), torch.randn(2, 4, 6, 7).transpose(2, 3), lambda t: F.avg_pool2d(t, 2),
         "neither NCHW-contiguous nor channels-last"),
        (ct.MaxPool2d(2), torch.randn(0, 4, 6, 6), lambda t: F.max_pool2d(t, 2), "an empty input"),
        (ct.AvgPool2d(3, divisor_override=0), torch.randn(1, 2, 6, 6), None, "divisor_override=0"),
    ]


@pytest.mark.parametrize("route", [False, True])
def test_fallback_reasons_and_results(route, monkeypatch):
    """On CPU the reason is the device; with CPU routed to the ops, the other reasons show. The
    result is nn's (PyTorch's own error where PyTorch rejects the call)."""
    monkeypatch.setattr(CF, "_ROUTE_CPU", route)
    ct.reset_fallbacks()
    for m, x, ref, why in _fallback_cases():
        if ref is None:
            with pytest.raises(RuntimeError):
                m(x)
        else:
            torch.testing.assert_close(m(x), ref(x))
    reasons = {w for _, w in ct.fallbacks()}
    if not route:
        assert reasons == {"a CPU tensor (ckgen runs on CUDA GPUs)"}
    else:
        for *_, why in _fallback_cases():
            assert any(why in r for r in reasons), (why, reasons)
    ct.reset_fallbacks()


def test_pytorch_errors_come_from_pytorch(route_cpu):
    with pytest.raises(RuntimeError, match="pad should be at most half"):
        ct.MaxPool2d(2, padding=2)(torch.randn(1, 2, 8, 8))
    with pytest.raises((RuntimeError, ValueError)):
        ct.GroupNorm(2, 4)(torch.randn(1, 6, 3, 3))  # 6 channels for a 4-channel module


def test_mixed_dtype_parameters_are_cast_to_the_input(route_cpu):
    m = ct.GroupNormSwish(4, 16)  # float32 parameters
    x = _x((2, 16, 6, 6), torch.bfloat16, "nhwc").requires_grad_(True)
    y = m(x)
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=CL)
    y.float().sum().backward()
    assert m.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    ref = F.silu(F.group_norm(x.detach().float(), 4, m.weight.detach(), m.bias.detach()))
    torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=1.6e-2)


# ---------------------------------------------------------------------------------------------
# state_dict round trip
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [ct.GroupNorm, ct.GroupNormSwish])
@pytest.mark.parametrize("affine", [True, False])
def test_state_dict_round_trip_with_nn_groupnorm(cls, affine):
    ref = nn.GroupNorm(8, 32, eps=1e-6, affine=affine)
    if affine:
        with torch.no_grad():
            ref.weight.normal_()
            ref.bias.normal_()
    mine = cls(8, 32, eps=1e-6, affine=affine)
    assert list(mine.state_dict()) == list(ref.state_dict())
    assert mine.load_state_dict(ref.state_dict(), strict=True) is not None
    back = nn.GroupNorm(8, 32, eps=1e-6, affine=affine)
    back.load_state_dict(mine.state_dict(), strict=True)
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v) and torch.equal(mine.state_dict()[k], v)
    assert isinstance(mine, nn.GroupNorm) and mine.num_groups == 8 and mine.eps == 1e-6
    assert repr(mine).startswith(cls.__name__ + "(8, 32, eps=1e-06")
    # a whole model: nn -> convert -> state_dict -> a fresh nn model
    model = nn.Sequential(nn.Conv2d(3, 32, 1), nn.GroupNorm(8, 32, affine=affine), nn.SiLU(), nn.MaxPool2d(2))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    ct.convert(model)
    assert list(model.state_dict()) == list(sd)
    fresh = nn.Sequential(nn.Conv2d(3, 32, 1), nn.GroupNorm(8, 32, affine=affine), nn.SiLU(), nn.MaxPool2d(2))
    fresh.load_state_dict(model.state_dict(), strict=True)
    for k, v in sd.items():
        assert torch.equal(fresh.state_dict()[k], v)


# ---------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------
class ResBlock(nn.Module):
    """SD-style: norm1 -> act1 -> conv1 -> norm2 -> act2 -> conv2, plus the skip."""

    def __init__(self, c, g=4):
        super().__init__()
        self.norm1, self.act1, self.conv1 = nn.GroupNorm(g, c), nn.SiLU(), nn.Conv2d(c, c, 3, padding=1)
        self.norm2, self.act2, self.conv2 = nn.GroupNorm(g, c), nn.SiLU(), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(self.act2(self.norm2(self.conv1(self.act1(self.norm1(x))))))


class SharedActBlock(nn.Module):
    """One SiLU applied twice: fusing it into a norm would change the other use."""

    def __init__(self, c):
        super().__init__()
        self.norm, self.act, self.conv = nn.GroupNorm(4, c), nn.SiLU(), nn.Conv2d(c, c, 1)

    def forward(self, x):
        return self.act(self.conv(self.act(self.norm(x))))


class ResidualAct(nn.Module):
    """The SiLU takes norm(x) + x: not a GroupNorm -> SiLU pair."""

    def __init__(self, c):
        super().__init__()
        self.norm, self.act = nn.GroupNorm(4, c), nn.SiLU()

    def forward(self, x):
        return self.act(self.norm(x) + x)


class GroupNorm32(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


def _model():
    shared_gn = nn.GroupNorm(4, 16)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.GroupNorm(4, 16), nn.SiLU(),                      # 1, 2: fused (Sequential)
        nn.MaxPool2d(3, 2, 1),                               # 3
        ResBlock(16),                                        # 4: fused by the pattern
        SharedActBlock(16),                                  # 5: pattern refused (act used twice)
        ResidualAct(16),                                     # 6: pattern refused by the fx check
        nn.Sequential(shared_gn, nn.SiLU()),                 # 7: shared GroupNorm: not fused, replaced
        nn.Sequential(GroupNorm32(4, 16), nn.SiLU()),        # 8: subclass: left
        shared_gn,                                           # 9: the same module again
        nn.AvgPool2d(2, count_include_pad=False),            # 10
        nn.GroupNorm(2, 16, affine=False),                   # 11
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))


def test_convert_replaces_fuses_and_reports(route_cpu):
    torch.manual_seed(0)
    model = _model()
    ref = copy.deepcopy(model)
    params_before = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keys = list(model.state_dict())
    pats = [ct.FusePattern(ResBlock, "norm1", "act1"), ct.FusePattern(ResBlock, "norm2", "act2"),
            ct.FusePattern(SharedActBlock, "norm", "act"), ct.FusePattern(ResidualAct, "norm", "act")]
    report = ct.convert(model, patterns=pats, max_pool_indices="recompute")
    text = str(report)
    rep = {e.name: e for e in report.replaced}
    left = {e.name: e for e in report.left}
    assert type(model[1]) is ct.GroupNormSwish and type(model[2]) is ct.SiLUPlaceholder
    assert rep["1"].result == "GroupNormSwish" and "consecutive in an nn.Sequential" in rep["1"].reason
    assert type(model[3]) is ct.MaxPool2d and model[3].indices == "recompute"
    assert type(model[4].norm1) is type(model[4].norm2) is ct.GroupNormSwish
    assert type(model[4].act1) is type(model[4].act2) is ct.SiLUPlaceholder
    assert "checked on the torch.fx trace" in rep["4.norm1"].reason
    assert type(model[5].norm) is ct.GroupNorm and type(model[5].act) is nn.SiLU
    assert "calls norm 1x and act 2x" in left["5.norm"].reason
    assert type(model[6].norm) is ct.GroupNorm and "not applied to norm's output alone" in left["6.norm"].reason
    assert type(model[7][0]) is ct.GroupNorm and model[7][0] is model[9], "a shared module stays shared"
    assert "more than one place" in left["7.0"].reason
    assert type(model[8][0]) is GroupNorm32 and "subclass" in left["8.0"].reason
    assert type(model[10]) is ct.AvgPool2d and model[10].count_include_pad is False
    assert type(model[11]) is ct.GroupNorm and model[11].weight is None
    assert "adaptive pooling" in left["12"].reason
    assert "8.1" in left and "runs as PyTorch's SiLU" in left["8.1"].reason
    assert report.counts()["GroupNorm -> GroupNormSwish"] == 3
    assert "replaced" in text and "left" in text and "5.norm" in text
    # in the model's module order, whichever pass (Sequential fusions, patterns, plain) made them
    order = [n for n, _ in ref.named_modules(remove_duplicate=False)]
    for rows in (report.replaced, report.left):
        assert [order.index(e.name) for e in rows] == sorted(order.index(e.name) for e in rows), rows
    assert [e.name for e in report.replaced][:3] == ["1", "2", "3"]
    # parameters and buffers kept: same objects, same keys; the optimizer built before still works
    assert {n: p for n, p in model.named_parameters()} == params_before
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    x = _x((2, 3, 12, 12), layout="nhwc")
    torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    assert ct.fallbacks() == {}
    # idempotent: a second convert replaces nothing and says why
    again = ct.convert(model)
    assert not again.replaced and any(e.reason == "already a ckgen module" for e in again.left)


def _relu_pool_stack(relu2=None):
    torch.manual_seed(0)
    relu2 = relu2 or nn.ReLU()
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1), relu2, nn.MaxPool2d(3, 2, 1, ceil_mode=True),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 4))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("indices", ["stored", "recompute"])
@pytest.mark.parametrize("path", ["custom_ops", "eager_functions"])
def test_convert_fuses_relu_then_maxpool_with_the_same_values_and_gradients(layout, indices, path, monkeypatch):
    """nn.ReLU + nn.MaxPool2d in an nn.Sequential -> Identity + ReLUMaxPool2d (pool first, then
    the ReLU): outputs and every gradient equal the nn model's, also where whole windows are
    negative (a ReLU'd window of zeros) and with ceil_mode and padding."""
    from ckgen.torch import eager

    monkeypatch.setattr(CF, "_ROUTE_CPU", True)
    monkeypatch.setattr(eager, "_CPU_FOR_TESTS", path == "eager_functions")
    monkeypatch.setenv("CKGEN_QUIET", "1")
    ref = _relu_pool_stack()
    model = copy.deepcopy(ref)
    report = ct.convert(model, max_pool_indices=indices)
    assert report.counts() == {"ReLU -> Identity": 2, "MaxPool2d -> ReLUMaxPool2d": 2}, str(report)
    assert type(model[1]) is type(model[4]) is nn.Identity
    assert type(model[2]) is type(model[5]) is ct.ReLUMaxPool2d and model[5].ceil_mode and model[5].indices == indices
    assert "pools first" in {e.name: e.reason for e in report.replaced}["2"]
    assert list(model.state_dict()) == list(ref.state_dict())
    x = (_x((4, 3, 12, 12), layout=layout, seed=2) - 0.5).requires_grad_(True)  # many negative windows
    xr = x.detach().clone().requires_grad_(True)
    y, yr = model(x), ref(xr)
    if path == "eager_functions":
        assert "MaxPoolFnBackward" in str(model[2:6](model[:2](x)).grad_fn.next_functions)
    torch.testing.assert_close(y, yr)
    dy = torch.randn_like(y)
    y.backward(dy)
    yr.backward(dy)
    torch.testing.assert_close(x.grad, xr.grad)
    for (n, p), (_, pr) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, pr.grad, msg=n)
    h = model[:3](x.detach())  # the pooled block's output: relu'd
    assert (h >= 0).all() and (h == 0).any()


def test_convert_leaves_relu_maxpool_it_cannot_fuse():
    shared = nn.ReLU()
    model = _relu_pool_stack(relu2=shared)
    model.append(shared)
    model.append(nn.MaxPool2d(1))
    hooked = nn.Sequential(nn.ReLU(), nn.MaxPool2d(2))
    hooked[0].register_forward_hook(lambda *a: None)
    with_idx = nn.Sequential(nn.ReLU(), nn.MaxPool2d(2, return_indices=True))
    left = {}
    for m in (model, hooked, with_idx):
        left.update({(id(m), e.name): e.reason for e in ct.convert(m).left})
    assert type(model[2]) is ct.ReLUMaxPool2d, "the unshared pair is fused"
    assert type(model[4]) is nn.ReLU and type(model[5]) is ct.MaxPool2d
    assert "more than one place" in left[(id(model), "4")]
    assert type(hooked[0]) is nn.ReLU and "has hooks" in left[(id(hooked), "0")]
    assert type(with_idx[1]) is ct.MaxPool2d and "returns indices" in left[(id(with_idx), "0")]
    only_pool = nn.Sequential(nn.ReLU(), nn.MaxPool2d(2))
    ct.convert(only_pool, ops=["maxpool2d"])
    assert type(only_pool[0]) is nn.ReLU and type(only_pool[1]) is ct.MaxPool2d, "no fusion without 'relu_maxpool2d'"
    with pytest.raises(ValueError, match="return_indices"):
        ct.ReLUMaxPool2d(2, return_indices=True)


@pytest.mark.parametrize("which", ["norm", "act", "relu", "pool"])
@pytest.mark.parametrize("hook", ["forward", "forward_pre", "full_backward", "full_backward_pre"])
def test_convert_does_not_fuse_modules_with_hooks(which, hook):
    """A hook on either module of a pair keeps the pair unfused (a forward hook on the GroupNorm
    would see the SiLU's output, a pre-hook on the MaxPool2d would run before the ReLU); each
    module is still replaced on its own, with its hooks, and the report says why."""
    model = nn.Sequential(nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 8, 1), nn.ReLU(), nn.MaxPool2d(2))
    target = model[{"norm": 0, "act": 1, "relu": 3, "pool": 4}[which]]
    fn = {"forward": lambda m, i, o: None, "forward_pre": lambda m, i: None,
          "full_backward": lambda m, gi, go: None, "full_backward_pre": lambda m, go: None}[hook]
    getattr(target, f"register_{hook}_hook")(fn)
    report = ct.convert(model)
    left = {e.name: e.reason for e in report.left}
    if which in ("norm", "act"):
        assert type(model[0]) is ct.GroupNorm and type(model[1]) is nn.SiLU, str(report)
        assert "has hooks" in left["0"], str(report)
        assert type(model[4]) is ct.ReLUMaxPool2d, "the other pair is fused"
    else:
        assert type(model[3]) is nn.ReLU and type(model[4]) is ct.MaxPool2d, str(report)
        assert "has hooks" in left["3"], str(report)
        assert type(model[0]) is ct.GroupNormSwish, "the other pair is fused"
    if which in ("norm", "pool"):  # the replaced module keeps the hook
        new = model[0] if which == "norm" else model[4]
        hooks = {"forward": new._forward_hooks, "forward_pre": new._forward_pre_hooks,
                 "full_backward": new._backward_hooks, "full_backward_pre": new._backward_pre_hooks}[hook]
        assert len(hooks) == 1


def test_convert_ops_subset_and_errors():
    model = nn.Sequential(nn.GroupNorm(2, 8), nn.SiLU(), nn.MaxPool2d(2), nn.AvgPool2d(2))
    report = ct.convert(model, ops=["maxpool2d"])
    assert type(model[0]) is nn.GroupNorm and type(model[1]) is nn.SiLU and type(model[3]) is nn.AvgPool2d
    assert type(model[2]) is ct.MaxPool2d
    assert {e.name: e.reason for e in report.left}["0"] == "'groupnorm' not in ops"
    report = ct.convert(model, ops=["groupnorm"])
    assert type(model[0]) is ct.GroupNorm and type(model[1]) is nn.SiLU, "no fusion without 'groupnorm_swish'"
    with pytest.raises(ValueError, match="ops: unknown"):
        ct.convert(model, ops=["conv"])
    with pytest.raises(ValueError, match="max_pool_indices"):
        ct.convert(model, max_pool_indices="maybe")
    root = nn.GroupNorm(2, 8)
    rep = ct.convert(root)
    assert not rep.replaced and "the model itself" in rep.left[0].reason
    assert type(ct.GroupNorm.from_module(root)) is ct.GroupNorm


def test_convert_keeps_mode_and_hooks():
    model = nn.Sequential(nn.GroupNorm(2, 8), nn.MaxPool2d(2)).eval()
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    ct.convert(model)
    assert not model[0].training and not model[1].training
    model(torch.randn(1, 8, 4, 4))
    assert seen == ["GroupNorm"] and type(model[0]) is ct.GroupNorm


# ---------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True) on the CPU, through the ops
# ---------------------------------------------------------------------------------------------
def _small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(), nn.MaxPool2d(3, 2, 1),
                         ResBlock(16), nn.AvgPool2d(2), nn.GroupNorm(4, 16), nn.Flatten(), nn.Linear(16 * 16, 4))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.quality)])
def test_compile_fullgraph_trains_like_eager(backend, route_cpu):
    """Inductor's run is the quality tier's (its C++ compiles take seconds): see the views test."""
    torch._dynamo.reset()
    ref = _small_model()
    model = copy.deepcopy(ref)
    report = ct.convert(model, patterns=[ct.FusePattern(ResBlock, "norm1", "act1"),
                                         ct.FusePattern(ResBlock, "norm2", "act2")])
    assert len(report.replaced) == 9
    model = model.to(memory_format=CL)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    opt, opt_r = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(3):
        x = _x((4, 3, 16, 16), layout="nhwc", seed=step)
        loss = compiled(x).square().mean()
        loss.backward()
        loss_r = ref(x).square().mean()
        loss_r.backward()
        torch.testing.assert_close(loss, loss_r, atol=1e-5, rtol=1e-4)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3)
        opt.step(), opt_r.step(), opt.zero_grad(), opt_r.zero_grad()
    assert ct.fallbacks() == {}


def _traced_targets(m, x):
    """The call_function targets of the forward and backward AOT graphs of torch.compile(m)(x)."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        def keep(g, _):
            seen.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    out = torch.compile(m, fullgraph=True, backend=backend)(x)
    out.sum().backward()
    return out, seen


def test_compile_sees_the_custom_ops(route_cpu):
    """The traced graph holds the ckgen ops, forward and backward, and no graph break."""
    m = nn.Sequential(ct.GroupNormSwish(4, 16), ct.MaxPool2d(2, under_compile="ckgen"), ct.AvgPool2d(2))
    _, targets = _traced_targets(m, _x((2, 16, 8, 8), requires_grad=True))
    for name in ("groupnorm_fwd", "maxpool2d_fwd_with_indices", "avgpool2d_fwd", "groupnorm_bwd", "maxpool2d_bwd",
                 "avgpool2d_bwd"):
        assert f"ckgen.{name}.kernel" in targets, (name, targets)
    # the AOT graphs call the overloads with no Python autograd kernel (see ops._Op)
    assert not [t for t in targets if t.startswith("ckgen.") and not t.endswith(".kernel")], targets


@pytest.mark.parametrize("fused", [False, True])
def test_compile_leaves_max_pools_to_inductor_by_default(route_cpu, fused):
    """under_compile="inductor" (the default): a compiled graph holds PyTorch's max pool (forward
    and backward; with the ReLU before it for ReLUMaxPool2d) and no ckgen max pool op, the
    GroupNorm and avg pool stay ckgen's; eager calls still run ckgen's op (the CPU route here).
    The values and x's gradient match nn's either way."""
    pool = ct.ReLUMaxPool2d(3, 2, 1) if fused else ct.MaxPool2d(3, 2, 1)
    m = nn.Sequential(ct.GroupNormSwish(4, 16), pool, ct.AvgPool2d(2))
    ref = nn.Sequential(nn.GroupNorm(4, 16), nn.SiLU(), *([nn.ReLU()] if fused else []), nn.MaxPool2d(3, 2, 1),
                        nn.AvgPool2d(2))
    ref[0].load_state_dict(m[0].state_dict())
    x = _x((2, 16, 9, 9), requires_grad=True)
    out, seen = _traced_targets(m, x)
    assert any("ckgen.groupnorm_fwd" in t for t in seen) and any("ckgen.avgpool2d_fwd" in t for t in seen), seen
    assert not any("ckgen.maxpool2d" in t for t in seen), seen
    assert any(t.startswith("aten.max_pool2d_with_indices.") for t in seen), seen
    assert any(t.startswith("aten.max_pool2d_with_indices_backward.") for t in seen), seen
    assert any(t.startswith("aten.relu.") for t in seen) == fused, seen
    xr = x.detach().clone().requires_grad_(True)
    want = ref(xr)
    want.sum().backward()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)
    # the same module in eager runs ckgen's op
    with torch.no_grad():
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            m(x)
    assert any("ckgen::maxpool2d_fwd" in e.key for e in prof.key_averages()), [e.key for e in prof.key_averages()]


def test_compile_traces_ckgen_max_pools_when_asked(route_cpu):
    m = nn.Sequential(ct.ReLUMaxPool2d(2, under_compile="ckgen"))
    _, seen = _traced_targets(m, _x((2, 8, 8, 8), requires_grad=True))
    assert "ckgen.maxpool2d_fwd_with_indices.kernel" in seen and "ckgen.maxpool2d_bwd.kernel" in seen, seen
    assert not any(t.startswith("aten.max_pool2d") for t in seen), seen


def test_under_compile_is_checked_and_carried_by_convert():
    for bad in (lambda: ct.MaxPool2d(2, under_compile="triton"), lambda: ct.ReLUMaxPool2d(2, under_compile=None),
                lambda: ct.max_pool2d(torch.randn(1, 2, 4, 4), 2, under_compile="eager")):
        with pytest.raises(ValueError, match="under_compile: expected 'inductor' or 'ckgen'"):
            bad()
    with pytest.raises(ValueError, match="max_pool_under_compile: expected"):
        ct.convert(nn.Sequential(nn.MaxPool2d(2)), max_pool_under_compile="aten")
    model = nn.Sequential(nn.Conv2d(2, 2, 1), nn.ReLU(), nn.MaxPool2d(2), nn.MaxPool2d(2))
    ct.convert(model, max_pool_under_compile="ckgen")
    assert [type(model[i]).__name__ for i in (2, 3)] == ["ReLUMaxPool2d", "MaxPool2d"]
    assert model[2].under_compile == model[3].under_compile == "ckgen"
    assert "under_compile=ckgen" in repr(model[3])
    model = nn.Sequential(nn.MaxPool2d(2))
    model[0] = nn.Sequential(nn.MaxPool2d(2))
    ct.convert(model)
    assert model[0][0].under_compile == "inductor"


def test_the_kernel_overload_has_no_autograd_kernel_of_its_own():
    """`.default` has ckgen's Python autograd kernel; `.kernel` leaves the Autograd key to
    PyTorch's C++ fallback, and has the same schema and CPU, CUDA and fake kernels."""
    for name, op in O.ALL_OPS.items():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.default._name, "Autograd"), name
        kern = op.kernel
        assert str(kern._schema).replace(f"{name}.kernel(", f"{name}(", 1) == str(op.default._schema), name
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(kern.name(), key), (name, key)
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(kern.name(), "Autograd"), name
    x = _x((2, 8, 6, 6))
    with torch.no_grad():
        torch.testing.assert_close(O.maxpool2d_fwd.kernel(x, [2, 2], [2, 2], [0, 0], [1, 1], False),
                                   O.maxpool2d_fwd.default(x, [2, 2], [2, 2], [0, 0], [1, 1], False))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fx = torch.empty(2, 8, 6, 6).contiguous(memory_format=CL)
        for overload in (O.maxpool2d_fwd_with_indices.kernel, O.maxpool2d_fwd_with_indices.default):
            y, idx = overload(fx, [2, 2], [2, 2], [0, 0], [1, 1], False)
            assert y.shape == idx.shape == (2, 8, 3, 3) and idx.dtype == torch.int64
            assert y.is_contiguous(memory_format=CL)


# ---------------------------------------------------------------------------------------------
# the op-level fallback: problems ckgen's dispatcher cannot serve (no GPU needed to decide)
# ---------------------------------------------------------------------------------------------
def test_not_served_names_the_dispatchers_reason(monkeypatch):
    from ckgen.runtime import target as target_mod
    from ckgen.ops.spec import Target

    monkeypatch.setattr(target_mod, "device_info",
                        lambda i=None: target_mod.DeviceInfo(Target.named("sm_90"), "fake H100", 132, 50 << 20))
    O._served.clear()
    ok = torch.empty(2, 64, 8, 8, dtype=torch.bfloat16).contiguous(memory_format=CL)
    assert O._not_served("groupnorm_fwd", ok, G=8, activation="none") is None
    wide = torch.empty(1, 8192, 4, 4, dtype=torch.bfloat16).contiguous(memory_format=CL)
    why = O._not_served("groupnorm_fwd", wide, G=1, activation="swish")
    assert why and "no config of the tuning space can run" in why
    assert O._not_served("maxpool2d_fwd", ok, return_indices=True,
                         **O._pool_fields([3, 3], [2, 2], [1, 1], [1, 1], False)) is None
    # argument errors are not "not served": the ckgen call raises them itself
    assert O._not_served("maxpool2d_fwd", ok, return_indices=False,
                         **O._pool_fields([2, 2], [2, 2], [2, 2], [1, 1], False)) is None
    monkeypatch.setattr(target_mod, "device_info", lambda i=None: (_ for _ in ()).throw(target_mod.NoGPUError("no")))
    O._served.clear()
    assert "ckgen cannot use this GPU" in O._not_served("groupnorm_fwd", ok, G=8, activation="none")
    O._served.clear()


# ---------------------------------------------------------------------------------------------
# the eager fast path (ckgen/torch/eager.py): autograd Functions over the ops' implementations
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def eager_cpu(monkeypatch):
    """CPU tensors take the eager Functions; the ops' CUDA implementations then fall back to the
    PyTorch computation (no GPU here), so the Functions' autograd wiring runs for real."""
    from ckgen.torch import eager

    monkeypatch.setattr(CF, "_ROUTE_CPU", True)
    monkeypatch.setattr(eager, "_CPU_FOR_TESTS", True)
    monkeypatch.setenv("CKGEN_QUIET", "1")
    ct.reset_fallbacks()
    yield eager
    ct.reset_fallbacks()


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("act", [None, "swish"])
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_eager_group_norm_function_matches_autograd_of_pytorch(layout, act, needs, eager_cpu):
    x = _x((2, 8, 5, 7), layout=layout, seed=3).requires_grad_(needs[0])
    g = (1 + 0.1 * torch.randn(8)).requires_grad_(needs[1])
    b = (0.1 * torch.randn(8)).requires_grad_(needs[1])
    y = ct.group_norm(x, 4, g, b, 1e-5, activation=act)
    assert type(y.grad_fn).__name__ == "GroupNormFnBackward", y.grad_fn  # the eager Function ran
    assert y.is_contiguous(memory_format=FORMATS[layout])
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, gr, br = (t.detach().contiguous().requires_grad_(t.requires_grad) for t in (x, g, b))
    yr = F.group_norm(xr, 4, gr, br, 1e-5)
    yr = F.silu(yr) if act else yr
    yr.backward(dy.contiguous())
    torch.testing.assert_close(y, yr, atol=1e-5, rtol=1e-5)
    for t, r in ((x, xr), (g, gr), (b, br)):
        if r.requires_grad:
            torch.testing.assert_close(t.grad, r.grad, atol=1e-4, rtol=1e-4)
        else:
            assert t.grad is None
    if x.grad is not None:
        assert x.grad.is_contiguous(memory_format=FORMATS[layout])


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("indices", ["stored", "recompute"])
def test_eager_pool_functions_match_autograd_of_pytorch(layout, indices, eager_cpu):
    x = _distinct((2, 4, 9, 8), torch.float32, layout).requires_grad_(True)
    y = ct.max_pool2d(x, 3, 2, 1, ceil_mode=True, indices=indices)
    assert type(y.grad_fn).__name__ == "MaxPoolFnBackward"
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, dy)
    xr = x.detach().contiguous().requires_grad_(True)
    yr = F.max_pool2d(xr, 3, 2, 1, ceil_mode=True)
    (gr,) = torch.autograd.grad(yr, xr, dy.contiguous())
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(gx, gr)
    assert gx.is_contiguous(memory_format=FORMATS[layout])
    y = ct.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False)
    assert type(y.grad_fn).__name__ == "AvgPoolFnBackward"
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, dy)
    yr = F.avg_pool2d(xr, 3, 2, 1, ceil_mode=True, count_include_pad=False)
    (gr,) = torch.autograd.grad(yr, xr, dy.contiguous())
    torch.testing.assert_close(y, yr, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gx, gr, atol=1e-6, rtol=1e-5)
    assert gx.is_contiguous(memory_format=FORMATS[layout])


def test_eager_path_without_grad_builds_no_graph(eager_cpu):
    x = _x((2, 8, 6, 6))
    g = torch.ones(8, requires_grad=True)
    with torch.no_grad():
        assert ct.group_norm(x, 4, g, None).grad_fn is None
    assert ct.max_pool2d(x, 2).grad_fn is None and ct.avg_pool2d(x, 2).grad_fn is None
    assert type(ct.group_norm(x, 4, g, None).grad_fn).__name__ == "GroupNormFnBackward"  # gamma needs a grad


def test_eager_double_backward_raises_a_clear_error(eager_cpu):
    x = _x((2, 4, 6, 6), seed=1).requires_grad_(True)
    for fwd in (lambda t: ct.group_norm(t, 2, None, None, activation="swish"),
                lambda t: ct.max_pool2d(t, 2), lambda t: ct.avg_pool2d(t, 2)):
        (gx,) = torch.autograd.grad(fwd(x).square().sum(), x, create_graph=True)
        with pytest.raises(ct.DoubleBackwardError, match="has no backward"):
            gx.sum().backward()


def test_eager_path_is_not_taken_where_something_traces(eager_cpu):
    from torch._subclasses.fake_tensor import FakeTensorMode

    eager = eager_cpu
    x = _x((2, 8, 4, 4))
    assert eager.usable(x)
    assert not eager.usable(x.to("meta"))
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        assert not eager.usable(fx)
        y = ct.group_norm(fx, 4)  # the custom op's fake kernel: shapes only
        assert y.shape == x.shape
    eager._CPU_FOR_TESTS = False
    assert not eager.usable(x)  # a CPU tensor outside the tests


def test_compile_still_traces_the_custom_ops_when_the_eager_path_is_on(eager_cpu):
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    m = nn.Sequential(ct.GroupNormSwish(4, 16), ct.MaxPool2d(2, under_compile="ckgen"), ct.AvgPool2d(2))
    x = _x((2, 16, 8, 8), requires_grad=True)
    out = torch.compile(m, fullgraph=True, backend=backend)(x)
    assert any("ckgen.groupnorm_fwd" in t for t in seen), seen
    assert any("ckgen.maxpool2d_fwd" in t for t in seen) and any("ckgen.avgpool2d_fwd" in t for t in seen), seen
    torch.testing.assert_close(out, m(x), atol=1e-5, rtol=1e-5)


def test_not_served_answers_a_repeated_signature_from_its_cache(monkeypatch):
    """The per-signature cache: a repeated call does no problem work; another layout of the same
    shape, or another option, is its own signature with its own answer."""
    from ckgen.runtime import target as target_mod
    from ckgen.ops.spec import Target

    monkeypatch.setattr(target_mod, "device_info",
                        lambda i=None: target_mod.DeviceInfo(Target.named("sm_90"), "fake H100", 132, 50 << 20))
    O._served.clear()
    calls = []
    real = O._not_served_problem
    monkeypatch.setattr(O, "_not_served_problem", lambda *a: calls.append(a[0]) or real(*a))
    wide = torch.empty(1, 8192, 4, 4, dtype=torch.bfloat16).contiguous(memory_format=CL)
    for _ in range(3):
        assert "no config of the tuning space can run" in O._not_served("groupnorm_fwd", wide, G=1, activation="swish")
    assert calls == ["groupnorm_fwd"]
    assert O._not_served("groupnorm_fwd", wide.contiguous(), G=1, activation="swish") is None  # NCHW: served
    assert O._not_served("groupnorm_fwd", wide, G=8192, activation="swish") is None  # C/G = 1: served
    assert len(calls) == 3
    O._served.clear()


def test_pool_call_cache_keeps_the_answers_of_the_checks():
    """functional's pooling checks, cached per signature, give what the checks give: for int and
    tuple arguments (cached: the same Call again), list arguments (checked every call), a CPU
    tensor with and without the CPU test route, and arguments PyTorch rejects."""
    x = torch.empty(2, 8, 9, 9).contiguous(memory_format=CL)
    route = CF._ROUTE_CPU

    def pairs(c):
        return c.why, c.k, c.s, c.p, c.d

    try:
        CF._ROUTE_CPU = True
        first = CF._pool_call("max", x, 3, None, 1, 1, False)
        for _ in range(2):
            c = CF._pool_call("max", x, 3, None, 1, 1, False)
            assert c is first and pairs(c) == (None, (3, 3), (3, 3), (1, 1), (1, 1))
            assert c.fmt == CL and c.ceil is False
            listed = CF._pool_call("max", x, [3, 2], (2, 1), [1, 0], 1, True)
            assert pairs(listed) == (None, (3, 2), (2, 1), (1, 0), (1, 1)) and listed.ceil is True
            assert listed is not CF._pool_call("max", x, [3, 2], (2, 1), [1, 0], 1, True)  # not cached
            assert "PyTorch rejects" in CF._pool_call("max", x, 2, 2, 2, 1, False).why
            assert CF._pool_call("avg", x, 2, 2, 0, 1, False).why is None
            assert "divisor_override=0" in CF._pool_call("avg", x, 2, 2, 0, 1, False, True, 0).why
            assert CF._pool_call("avg", x, 2, 2, 0, 1, False, False, 3).div == 3
        CF._ROUTE_CPU = False
        assert "CPU tensor" in CF._pool_call("avg", x, 2, 2, 0, 1, False).why
    finally:
        CF._ROUTE_CPU = route


def test_pool_ops_cache_the_answer_by_their_arguments(monkeypatch):
    """The pooling ops' CUDA implementations ask `_not_served` once per argument signature
    (kernel sizes as lists or tuples alike), and clearing `_served` forgets those answers too."""
    from ckgen.runtime import target as target_mod
    from ckgen.ops.spec import Target

    monkeypatch.setattr(target_mod, "device_info",
                        lambda i=None: target_mod.DeviceInfo(Target.named("sm_90"), "fake H100", 132, 50 << 20))
    O._served.clear()
    asked = []
    real = O._not_served
    monkeypatch.setattr(O, "_not_served", lambda op, x, **f: asked.append((op, f)) or real(op, x, **f))
    x = torch.empty(2, 64, 8, 8, dtype=torch.bfloat16).contiguous(memory_format=CL)
    for k in ([3, 3], (3, 3), [3, 3]):
        assert O._pool_not_served("maxpool2d_fwd", x, tuple(k), (2, 2), (1, 1), (1, 1), False,
                                  (("return_indices", True),)) is None
    assert len(asked) == 1 and asked[0][1]["kernel"] == (3, 3) and asked[0][1]["return_indices"] is True
    O._pool_not_served("maxpool2d_fwd", x, (3, 3), (2, 2), (1, 1), (1, 1), False, (("return_indices", False),))
    O._pool_not_served("avgpool2d_fwd", x, (3, 3), (2, 2), (1, 1), None, False,
                       (("count_include_pad", True), ("divisor_override", None)))
    assert len(asked) == 3 and "dilation" not in asked[2][1] and asked[2][1]["count_include_pad"] is True
    O._served.clear()
    O._pool_not_served("maxpool2d_fwd", x, (3, 3), (2, 2), (1, 1), (1, 1), False, (("return_indices", True),))
    assert len(asked) == 4
    O._served.clear()


def test_a_plane_beyond_the_kernels_indexing_is_a_fallback_not_an_error():
    """A pooling plane of 2^31 elements or more is ckgen's limit (32-bit plane indexing), not
    PyTorch's: ckgen.torch gives the reason to fall back on, while ckgen's own API refuses it."""
    from ckgen.ops import get_op
    from ckgen.torch import ops as ckops
    from ckgen.types import KernelLimitError

    x = torch.empty((1, 1, 65536, 32768), device="meta", dtype=torch.bfloat16)
    fields = dict(kernel=(2, 2), stride=(2, 2), padding=(0, 0), dilation=(1, 1), ceil_mode=False, return_indices=False)
    why = ckops._not_served_problem("maxpool2d_fwd", x, fields)
    assert why is not None and "2^31" in why and why.startswith("H: ")
    with pytest.raises(KernelLimitError, match="^H: "):
        get_op("maxpool2d_fwd").parse_problem(N=1, C=1, H=65536, W=32768, dtype="bf16", layout="nchw", **fields)
    small = torch.empty((1, 1, 64, 64), device="meta", dtype=torch.bfloat16)
    bad = dict(fields, kernel=(0, 2))  # an argument error stays the ckgen call's to raise
    assert ckops._not_served_problem("maxpool2d_fwd", small, bad) is None


def test_group_norm_with_one_value_per_group_raises_as_pytorch_does(route_cpu):
    """`ct.group_norm(x of (1, 6, 1, 1), 6)` returned beta where F.group_norm raises: each
    group's statistics come from one value."""
    x = torch.randn(1, 6, 1, 1)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        F.group_norm(x, 6)
    for call in (lambda: ct.group_norm(x, 6, torch.ones(6), torch.arange(6.0)), lambda: ct.GroupNorm(6, 6)(x),
                 lambda: ct.GroupNormSwish(6, 6)(x), lambda: ct.group_norm(x.view(1, 6, 1), 6)):
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            call()
    for ok in (torch.randn(2, 6, 1, 1), torch.randn(1, 6, 2, 1)):  # PyTorch's condition exactly
        torch.testing.assert_close(ct.group_norm(ok, 6), F.group_norm(ok, 6))
    torch.testing.assert_close(ct.group_norm(x, 3), F.group_norm(x, 3))
