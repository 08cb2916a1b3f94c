"""GPU tier: the forward's fusion menu (slice_in=lean): every activation x residual x per-(n, c)
bias on fp32/fp16/bf16 and both layouts, through the public function against PyTorch, and lean
configs (cluster sizes, vector widths, one-group and straddling vectors) against the float64
reference; the composed path where no kernel holds a slice; argument errors."""
from __future__ import annotations

import itertools
import random

import pytest

from ckgen.instance import render_instance
from ckgen.ops import get_op

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
F = torch.nn.functional

OP = get_op("groupnorm_fwd")
DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ACTS = ["none", "swish", "relu", "gelu", "gelu_tanh"]
MENU = [(d, lay, a, r, b) for d, lay, a, r, b in itertools.product(["fp32", "fp16", "bf16"], ["nchw", "nhwc"], ACTS,
                                                                    [False, True], [False, True])
        if a not in ("none", "swish") or r or b]  # the plain problems have their own tests
# C/G = 8 (a 16-byte bf16 vector inside one group) and C/G = 10 (vectors straddle groups)
SHAPES = [(2, 64, 12, 10, 8), (3, 320, 6, 8, 32)]


def _problem(dtype, layout, act, res, bias, shape):
    N, C, H, W, G = shape
    return OP.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=dtype, layout=layout, activation=act,
                            residual=res, bias_nc=bias)


def _shape(case) -> tuple:
    return SHAPES[MENU.index(case) % len(SHAPES)]


@pytest.fixture(scope="module", autouse=True)
def _prewarm():
    """Compile what the public calls below will pick (the dispatcher's choice) in parallel first."""
    import ckgen
    from ckgen.runtime.compile import compile_many
    from ckgen.runtime.target import current_target

    target = current_target()
    srcs = []
    for case in MENU:
        p = _problem(*case, _shape(case))
        choice = ckgen.explain("groupnorm_fwd", arch=target.arch, **OP.explain_fields(p))
        srcs.append(render_instance(OP, p, choice.config, target))
    failures = compile_many(srcs, target)
    assert not failures, list(failures.values())[:3]


def _inputs(p, fmt):
    dt = DT[p.dtype]
    x = torch.randn(p.N, p.C, p.H, p.W, device="cuda").add_(0.5).to(dt).contiguous(memory_format=fmt)
    gamma = (1 + 0.2 * torch.randn(p.C, device="cuda")).to(dt)
    beta = (0.2 * torch.randn(p.C, device="cuda")).to(dt)
    r = torch.randn_like(x) if p.residual else None
    b = torch.randn(p.N, p.C, device="cuda").to(dt) if p.bias_nc else None
    return x, gamma, beta, r, b


def _torch_ref(p, x, gamma, beta, r, b, eps=1e-5):
    """The PyTorch code the fusion replaces, in float64."""
    h = x.double() + (b.double()[:, :, None, None] if b is not None else 0)
    y = F.group_norm(h, p.G, gamma.double(), beta.double(), eps)
    if r is not None:
        y = y + r.double()
    act = {"none": lambda t: t, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
           "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[p.activation]
    hm = h.reshape(p.N, p.G, -1)
    return act(y), hm.mean(-1), 1 / torch.sqrt(hm.var(-1, unbiased=False) + eps)


@pytest.mark.parametrize("case", MENU, ids=lambda c: "-".join(str(v) for v in c))
def test_fusion_menu_matches_torch(case):
    import ckgen

    p = _problem(*case, _shape(case))
    fmt = torch.channels_last if p.layout == "nhwc" else torch.contiguous_format
    x, gamma, beta, r, b = _inputs(p, fmt)
    y, mean, rstd = ckgen.groupnorm_fwd(x, gamma, beta, p.G, activation=p.activation, residual=r, bias_nc=b)
    ref, ref_mean, ref_rstd = _torch_ref(p, x, gamma, beta, r, b)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous(memory_format=fmt)
    tol = OP.tolerance(p.dtype, "y")
    scale = 2.0 if p.residual else 1.0  # y is one rounding of a sum of two terms of size ~1
    torch.testing.assert_close(y.double(), ref, atol=scale * tol.atol, rtol=scale * tol.rtol)
    torch.testing.assert_close(mean.double(), ref_mean, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(rstd.double(), ref_rstd, atol=0, rtol=2e-3)
    assert ckgen.explain("groupnorm_fwd", x, gamma, beta, p.G, activation=p.activation,
                         residual=r, bias_nc=b).config["slice_in"] == "lean"


def _lean_configs(p, target, n, seed):
    """n valid lean configs, every cluster size and vector width the problem allows first."""
    valid = [c for c in OP.space.enumerate() if c["slice_in"] == "lean" and OP.validate(p, c, target)]
    rng = random.Random(seed)
    rng.shuffle(valid)
    picked = []
    for key in itertools.product([1, 2, 4, 8], [16, 8, 4, 2]):
        c = next((c for c in valid if (c["cluster"], c["vec_bytes"]) == key), None)
        if c is not None:
            picked.append(c)
    return (picked + [c for c in valid if c not in picked])[:n]


@pytest.mark.parametrize("dtype,layout", list(itertools.product(["fp32", "fp16", "bf16"], ["nchw", "nhwc"])))
@pytest.mark.parametrize("shape", [(2, 64, 12, 10, 8), (2, 48, 7, 9, 4), (1, 64, 64, 64, 2), (4, 32, 1, 1, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_lean_configs_match_reference(dtype, layout, shape):
    """Several lean configs per problem (clusters of 1-8 blocks, every vector width) against the
    float64 reference on fresh inputs with poisoned outputs, the whole menu at once
    (gelu_tanh + residual + bias) and plain."""
    from ckgen.runtime.compile import compile_many
    from ckgen.runtime.target import current_target
    from ckgen.runtime.verify import Harness

    target = current_target()
    for act, res, bias in (("gelu_tanh", True, True), ("none", False, False)):
        p = _problem(dtype, layout, act, res, bias, shape)
        configs = _lean_configs(p, target, 6, hash(shape))
        assert configs, f"no lean config for {p.key()}"
        compile_many([render_instance(OP, p, c, target) for c in configs], target)
        h = Harness(OP, p)
        bad = []
        for c in configs:
            chk = h.check(h.runner(render_instance(OP, p, c, target), c, target))
            if not chk.ok:
                bad.append(f"{c.key()}: {chk.detail}")
        assert not bad, "\n".join(bad)


def test_composed_where_no_kernel_holds_a_slice():
    """A slice larger than any cluster holds (1 x 64 x 256 x 256, one group: 8 MB in bf16): no
    lean config; torch tensors run the plain kernel with PyTorch's add and activation around it."""
    import ckgen

    p = _problem("bf16", "nchw", "relu", True, True, (1, 64, 256, 256, 1))
    with pytest.raises(ckgen.NoConfigError):
        ckgen.explain("groupnorm_fwd", arch="sm_90", **OP.explain_fields(p))
    x, gamma, beta, r, b = _inputs(p, torch.contiguous_format)
    y, mean, rstd = ckgen.groupnorm_fwd(x, gamma, beta, p.G, activation="relu", residual=r, bias_nc=b)
    ref, ref_mean, _ = _torch_ref(p, x, gamma, beta, r, b)
    tol = OP.tolerance("bf16", "y")
    torch.testing.assert_close(y.double(), ref, atol=2 * tol.atol, rtol=2 * tol.rtol)
    torch.testing.assert_close(mean.double(), ref_mean, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kw,exc,word", [
    (dict(residual=lambda x: x[:, :, :-1]), ValueError, "residual"),
    (dict(residual=lambda x: x.float()), TypeError, "residual"),
    (dict(residual=lambda x: x.contiguous(memory_format=torch.channels_last)), ValueError, "residual"),
    (dict(bias_nc=lambda x: torch.zeros(x.shape[0], x.shape[1] + 1, device="cuda", dtype=x.dtype)), ValueError, "bias_nc"),
    (dict(bias_nc=lambda x: torch.zeros(x.shape[0], x.shape[1], device="cuda")), TypeError, "bias_nc"),
    (dict(bias_nc=lambda x: torch.zeros(x.shape[1], x.shape[0], device="cuda", dtype=x.dtype).t()), ValueError, "bias_nc"),
    (dict(activation=lambda x: "tanh"), ValueError, "activation"),
])
def test_bad_fused_inputs_raise_clear_errors(kw, exc, word):
    import ckgen

    x = torch.randn(2, 32, 8, 8, device="cuda", dtype=torch.bfloat16)
    args = {k: f(x) for k, f in kw.items()}
    with pytest.raises(exc, match=word):
        ckgen.groupnorm_fwd(x, None, None, 4, **args)


@pytest.mark.parametrize("dtype,layout,act,res,bias", [
    ("bf16", "nhwc", "relu", True, False),   # timm's Bottleneck: norm3, the shortcut, ReLU
    ("fp16", "nhwc", "swish", False, True),  # diffusers' ResnetBlock2D: the time embedding, norm2, SiLU
    ("fp32", "nchw", "gelu", True, True),
])
def test_torch_op_forward_and_gradients_match_pytorch(dtype, layout, act, res, bias):
    """ckgen::groupnorm_fwd_fused on CUDA, eager and under torch.compile: y and the gradients of
    x, gamma, beta, the residual and the bias against the PyTorch code it replaces (float64)."""
    from ckgen.torch import ops as O

    p = _problem(dtype, layout, act, res, bias, (2, 64, 12, 10, 8))
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x, gamma, beta, r, b = _inputs(p, fmt)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, gamma, beta) + tuple(t for t in (r, b) if t is not None)]

    def split(ts):
        it = iter(ts)
        return next(it), next(it), next(it), (next(it) if res else None), (next(it) if bias else None)

    def ours(*ts):
        xx, gg, be, rr, bb = split(ts)
        return O.groupnorm_fwd_fused(xx, gg, be, p.G, 1e-5, act, rr, bb)[0]

    dy = torch.randn_like(x)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    xx, gg, be, rr, bb = split(ref_leaves)
    ref = _torch_ref(p, xx, gg, be, rr, bb)[0]
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.double())
    tol = OP.tolerance(dtype, "y")
    for fn in (ours, torch.compile(ours, fullgraph=True)):
        y = fn(*leaves)
        assert y.is_contiguous(memory_format=fmt)
        torch.testing.assert_close(y.double(), ref.detach(), atol=2 * tol.atol, rtol=2 * tol.rtol)
        grads = torch.autograd.grad(y, leaves, dy)
        for name, g, want in zip(("x", "gamma", "beta", "residual", "bias"), grads, ref_grads):
            scale = want.abs().max().item() + 1e-6
            err = (g.double() - want).abs().max().item() / scale
            assert err < (1e-4 if dtype == "fp32" else 3e-2), (name, err)
