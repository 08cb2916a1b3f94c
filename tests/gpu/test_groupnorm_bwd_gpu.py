"""GPU tier for the GroupNorm backward ops: every op x dtype x layout x activation x configs of
every scheme (single_pass, fused, multi_stage, pipelined; split 1 and > 1, single_pass/fused
at a grid-wide barrier past 8; pipelined over whole pixel rows too) on edge-case shapes, against
the float64 reference (poisoned outputs, fresh random inputs) and against PyTorch autograd;
dgamma/dbeta bitwise identical across runs."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.ops.spec import Config

pytestmark = pytest.mark.gpu

OPS = {name: get_op(name) for name in ("groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta")}
SHAPES = [  # (N, C, H, W, G)
    (2, 320, 8, 8, 32),      # C/G = 10 (not a multiple of the vector width)
    (4, 64, 1, 1, 16),       # HW = 1
    (2, 24, 12, 12, 1),      # G = 1 (layer-norm-like)
    (2, 32, 6, 6, 32),       # G = C (instance-norm-like)
    (1, 64, 16, 16, 8),      # N = 1
    (1, 64, 128, 128, 4),    # slice of 262144 elements: too large for one block
    (3, 96, 17, 19, 6),      # odd spatial size, masked tails
]
COMBOS = list(itertools.product(["fp32", "fp16", "bf16"], ["nchw", "nhwc"], ["none", "swish"]))
# groupnorm_bwd gets every shape and 8 configs; the two partial ops a subset.
PLAN = {"groupnorm_bwd": (SHAPES, 8), "groupnorm_bwd_data": (SHAPES[:3] + SHAPES[5:6], 5),
        "groupnorm_bwd_gamma_beta": (SHAPES[:3] + SHAPES[5:6], 5)}


@pytest.fixture(scope="module")
def target():
    from ckgen.runtime.target import current_target

    return current_target()


def _configs(op, problem, target, n, seed):
    """n valid configs covering every scheme, split 1 and > 1 (single_pass/fused: over a cluster
    and, past 8, at a grid-wide barrier; and pipelined over whole pixel rows, groups_per_block =
    G), then random others."""
    valid = [c for c in op.space.enumerate() if op.validate(problem, c, target)]
    rng = random.Random(seed)
    rng.shuffle(valid)
    picked: list[Config] = []
    schemes = ("single_pass", "fused", "multi_stage", "pipelined") if "scheme" in op.space.params else (None,)
    def kind(c):  # 0: one block per tile; 1: split over a cluster or the workspace; 2: a grid barrier
        return 0 if c["split"] == 1 else 2 if getattr(op, "grid_merge", lambda c: False)(c) else 1

    for scheme, k in itertools.product(schemes, (0, 1, 2)):
        for c in valid:
            if (scheme is None or c["scheme"] == scheme) and kind(c) == k:
                picked.append(c)
                break
    picked += [c for c in valid if c.as_dict().get("scheme") == "pipelined"
               and c["groups_per_block"] == problem.G and c not in picked][:1]
    families = len(picked)
    for c in valid:
        if len(picked) >= max(n, families):
            break
        if c not in picked:
            picked.append(c)
    return picked


def _problem(op, shape, dtype, layout, act):
    N, C, H, W, G = shape
    return op.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=dtype, layout=layout, activation=act)


@pytest.fixture(scope="module", autouse=True)
def _prewarm(target):
    """Compile every instance these tests use in parallel first (into the cubin cache)."""
    from ckgen.runtime.compile import compile_many

    srcs = []
    for name, (shapes, n) in PLAN.items():
        op = OPS[name]
        for (dt, lay, act), s in itertools.product(COMBOS, shapes):
            p = _problem(op, s, dt, lay, act)
            srcs += [render_instance(op, p, c, target) for c in _configs(op, p, target, n, hash(s))]
    failures = compile_many(srcs, target)
    assert not failures, list(failures.values())[:3]


CASES = [(name, s) for name, (shapes, _) in PLAN.items() for s in shapes]


@pytest.mark.parametrize("dtype,layout,act", COMBOS)
@pytest.mark.parametrize("name,shape", CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_configs_match_reference(name, dtype, layout, act, shape, target):
    from ckgen.runtime.verify import Harness

    op = OPS[name]
    p = _problem(op, shape, dtype, layout, act)
    configs = _configs(op, p, target, PLAN[name][1], hash(shape))
    assert len(configs) >= 3, f"only {len(configs)} valid configs"
    h = Harness(op, p)  # fresh random inputs
    bad = []
    for c in configs:
        src = render_instance(op, p, c, target)
        chk = h.check(h.runner(src, c, target))
        if not chk.ok:
            bad.append(f"{src.name}: {chk.detail}")
    assert not bad, "\n".join(bad)


GRID_SHAPES = [  # (N, C, H, W, G), layout: where split > 8 blocks per tile fit on the GPU at once
    ((2, 320, 16, 16, 32), "nhwc"),   # C/G = 10: vectors straddle groups
    ((1, 64, 128, 128, 4), "nhwc"),
    ((2, 24, 40, 40, 1), "nhwc"),     # G = 1
    ((3, 96, 17, 19, 6), "nhwc"),     # odd pixel count: the last block's share is short
    ((1, 64, 64, 64, 4), "nchw"),
]


@pytest.mark.parametrize("dtype,act", [("bf16", "swish"), ("fp16", "none"), ("fp32", "swish")])
@pytest.mark.parametrize("shape,layout", GRID_SHAPES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_grid_barrier_configs_match_reference(shape, layout, dtype, act, target):
    """single_pass/fused with split > 8: one cooperative launch, A/B merged through the workspace
    at a grid-wide barrier, dgamma/dbeta folded after it. Several configs (whole pixel rows among
    them), each run three times on one workspace: the barrier's counter resets itself."""
    from ckgen.runtime.verify import Harness

    checked = 0
    for name in ("groupnorm_bwd", "groupnorm_bwd_data"):
        op = OPS[name]
        p = _problem(op, shape, dtype, layout, act)
        grid = [c for c in op.space.enumerate() if op.grid_merge(c) and op.validate(p, c, target)]
        random.Random(repr(shape) + dtype + name).shuffle(grid)
        picks = [c for c in grid if c["groups_per_block"] == p.G][:1] + \
                [c for c in grid if c["scheme"] == "single_pass"][:1]
        picks += [c for c in grid if c not in picks][:4 - len(picks)]
        h = Harness(op, p)
        for c in picks:
            run = h.runner(render_instance(op, p, c, target), c, target)
            for _ in range(3):
                chk = h.check(run)
                assert chk.ok, f"{op.instance_name(p, c)}: {chk.detail}"
            checked += 1
    assert checked >= 2, f"only {checked} grid-barrier configs for {shape} {layout} {dtype}"


@pytest.mark.parametrize("dtype,layout", [("fp32", "nchw"), ("fp32", "nhwc"), ("bf16", "nhwc"), ("fp16", "nchw")])
def test_cancellation_large_mean(dtype, layout, target):
    """x = 1000 + small noise (fp32; fp16/bf16 at the largest offset they resolve): xhat comes from
    x - mean with the forward's fp32 mean, so nothing cancels catastrophically."""
    from ckgen.runtime.verify import Harness

    op = OPS["groupnorm_bwd"]
    p = op.parse_problem(N=2, C=64, H=32, W=32, G=8, dtype=dtype, layout=layout, activation="swish")
    offset = {"fp32": 1000.0, "fp16": 100.0, "bf16": 30.0}[dtype]
    h = Harness(op, p, inputs=op.make_inputs(p, np.random.default_rng(), offset=offset))
    for c in _configs(op, p, target, 6, 7):
        chk = h.check(h.runner(render_instance(op, p, c, target), c, target))
        assert chk.ok, f"{c.key()}: {chk.detail}"


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_deterministic_bitwise(layout, target):
    """dgamma/dbeta (and dx) are bitwise identical across runs, for every scheme and split."""
    import cupy

    from ckgen.runtime.verify import Harness

    op = OPS["groupnorm_bwd"]
    p = op.parse_problem(N=8, C=256, H=32, W=32, G=32, dtype="fp32", layout=layout)
    h = Harness(op, p)
    for c in _configs(op, p, target, 9, 3):
        run = h.runner(render_instance(op, p, c, target), c, target)
        seen = None
        for _ in range(5):
            h.poison()
            run()
            cupy.cuda.get_current_stream().synchronize()
            got = {k: cupy.asnumpy(v).tobytes() for k, v in h.dev_out.items()}
            assert seen is None or got == seen, f"{c.key()}: results differ between runs"
            seen = got


torch = pytest.importorskip("torch")
TORCH_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _torch_case(shape, dtype, layout, seed=0):
    N, C, H, W, G = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    dt = TORCH_DT[dtype]
    x = (torch.randn(N, C, H, W, device="cuda", generator=gen) * 1.5 + 0.3).to(dt).contiguous(memory_format=fmt)
    dy = torch.randn(N, C, H, W, device="cuda", generator=gen).to(dt).contiguous(memory_format=fmt)
    gamma = (1 + 0.25 * torch.randn(C, device="cuda", generator=gen)).to(dt)
    beta = (0.25 * torch.randn(C, device="cuda", generator=gen)).to(dt)
    return x, dy, gamma, beta


@pytest.mark.parametrize("dtype,layout,act", COMBOS)
@pytest.mark.parametrize("shape", [(2, 320, 8, 8, 32), (1, 64, 128, 128, 4), (4, 64, 1, 1, 16), (2, 24, 12, 12, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_public_api_matches_torch_autograd(dtype, layout, act, shape):
    """ckgen.groupnorm_bwd (and the dx-only / dgamma-dbeta-only ops) against PyTorch autograd of
    F.group_norm (then F.silu), evaluated in float64 on the same inputs."""
    import torch.nn.functional as F

    import ckgen

    N, C, H, W, G = shape
    x, dy, gamma, beta = _torch_case(shape, dtype, layout)
    swish = act == "swish"
    _, mean, rstd = ckgen.groupnorm_fwd(x, gamma, beta, G, activation=act if swish else None)
    xd, gd, bd = (t.detach().double().requires_grad_() for t in (x, gamma, beta))
    y = F.group_norm(xd, G, gd, bd, 1e-5)
    if swish:
        y = F.silu(y)
    y.backward(dy.double())
    dx, dgamma, dbeta = ckgen.groupnorm_bwd(dy, x, mean, rstd, gamma, G, beta, activation=act if swish else None)
    op = OPS["groupnorm_bwd"]
    p = _problem(op, shape, dtype, layout, act)
    assert dx.shape == x.shape and dx.dtype == x.dtype and dgamma.shape == (C,) and dgamma.dtype == x.dtype
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    assert dx.is_contiguous(memory_format=fmt), "dx must keep x's layout"
    # mean/rstd are fp32 (as PyTorch keeps them): their rounding moves dx by ~1e-7 relative
    for got, ref, name in ((dx, xd.grad, "dx"), (dgamma, gd.grad, "dgamma"), (dbeta, bd.grad, "dbeta")):
        tol = op.problem_tolerance(p, name)
        torch.testing.assert_close(got.double(), ref, atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{name}: {m}")
    dx2 = ckgen.groupnorm_bwd_data(dy, x, mean, rstd, gamma, G, beta, activation=act if swish else None)
    dg2, db2 = ckgen.groupnorm_bwd_gamma_beta(dy, x, mean, rstd, G, gamma, beta, activation=act if swish else None)
    tol = op.problem_tolerance(p, "dx")
    torch.testing.assert_close(dx2.double(), xd.grad, atol=tol.atol, rtol=tol.rtol)
    for got, ref, name in ((dg2, gd.grad, "dgamma"), (db2, bd.grad, "dbeta")):
        tol = op.problem_tolerance(p, name)
        torch.testing.assert_close(got.double(), ref, atol=tol.atol, rtol=tol.rtol)


def test_cupy_inputs_and_no_gamma():
    """CuPy arrays in, CuPy arrays out; gamma=None means gamma = 1."""
    import cupy

    import ckgen

    op = OPS["groupnorm_bwd"]
    p = op.parse_problem(N=2, C=64, H=8, W=8, G=8, dtype="fp32", layout="nchw")
    inp = op.make_inputs(p, np.random.default_rng(5))
    x, dy = cupy.asarray(inp["x"], cupy.float32), cupy.asarray(inp["dy"], cupy.float32)
    mean = cupy.asarray(inp["mean"], cupy.float32)
    rstd = cupy.asarray(inp["rstd"], cupy.float32)
    dx, dg, db = ckgen.groupnorm_bwd(dy, x, mean, rstd, None, 8)
    assert isinstance(dx, cupy.ndarray) and dx.dtype == cupy.float32
    ref = op.reference(p, {**inp, "gamma": None, "beta": None})
    np.testing.assert_allclose(cupy.asnumpy(dx), ref["dx"], atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(cupy.asnumpy(dg), ref["dgamma"], atol=1e-3, rtol=2e-5)
    np.testing.assert_allclose(cupy.asnumpy(db), ref["dbeta"], atol=1e-3, rtol=2e-5)


@pytest.mark.parametrize("change,exc,word", [
    (lambda a: {"dy": a["dy"][:1]}, ValueError, "dy"),
    (lambda a: {"dy": a["dy"].float()}, TypeError, "dy"),
    (lambda a: {"dy": a["dy"].contiguous(memory_format=torch.channels_last)}, ValueError, "dy"),
    (lambda a: {"mean": a["mean"].half()}, TypeError, "mean"),
    (lambda a: {"rstd": a["rstd"][:, :4]}, ValueError, "rstd"),
    (lambda a: {"groups": 7}, ValueError, "groups"),
    (lambda a: {"gamma": a["gamma"][:10]}, ValueError, "gamma"),
    (lambda a: {"x": a["x"].cpu()}, TypeError, "x"),
    (lambda a: {"activation": "gelu"}, ValueError, "activation"),
])
def test_bad_inputs_raise_clear_errors(change, exc, word):
    import ckgen

    x = torch.randn(2, 64, 8, 8, device="cuda", dtype=torch.float16)
    args = dict(dy=torch.randn_like(x), x=x, mean=torch.zeros(2, 8, device="cuda"),
                rstd=torch.ones(2, 8, device="cuda"), gamma=torch.ones(64, device="cuda", dtype=x.dtype), groups=8)
    args.update(change(args))
    with pytest.raises(exc) as ei:
        ckgen.groupnorm_bwd(**args)
    assert str(ei.value).startswith(word + ":"), str(ei.value)
