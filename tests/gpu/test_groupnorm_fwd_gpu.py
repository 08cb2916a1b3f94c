"""GPU tier: every dtype x layout x activation, >= 10 configs each, on edge-case shapes,
against the float64 reference (poisoned outputs, fresh random inputs) and against PyTorch."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.ops.spec import Config

pytestmark = pytest.mark.gpu

OP = get_op("groupnorm_fwd")
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
CONFIGS_PER_SHAPE = 10


@pytest.fixture(scope="module")
def target():
    from ckgen.runtime.target import current_target

    return current_target()


def _configs(problem, target, n, seed):
    """n valid configs, spread over both slice modes and cluster sizes."""
    valid = [c for c in OP.space.enumerate() if OP.validate(problem, c, target)]
    rng = random.Random(seed)
    rng.shuffle(valid)
    picked: list[Config] = []
    for key in (("slice_in", "regs"), ("slice_in", "reload"), ("slice_in", "rows"), ("cluster", 2), ("cluster", 4), ("cluster", 8),
                ("merge", "global"), ("merge", "grid"), ("global_split", 16), ("merge", "grid", "slice_in", "regs")):
        for c in valid:
            if all(c[k] == v for k, v in zip(key[::2], key[1::2])) and c not in picked:
                picked.append(c)
                break
    for c in valid:
        if len(picked) >= n:
            break
        if c not in picked:
            picked.append(c)
    return picked[:n]


@pytest.fixture(scope="module", autouse=True)
def _prewarm(target):
    """Compile every instance these tests use in parallel first (into the cubin cache)."""
    from ckgen.runtime.compile import compile_many

    srcs = []
    for (dt, lay, act), s in itertools.product(COMBOS, SHAPES):
        p = OP.parse_problem(N=s[0], C=s[1], H=s[2], W=s[3], G=s[4], dtype=dt, layout=lay, activation=act)
        srcs += [render_instance(OP, p, c, target) for c in _configs(p, target, CONFIGS_PER_SHAPE, hash(s))]
    failures = compile_many(srcs, target)
    assert not failures, list(failures.values())[:3]


def _check_all(p, configs, target):
    """Every config against the float64 reference, on one set of fresh random inputs."""
    from ckgen.runtime.verify import Harness

    h = Harness(OP, p)
    bad = []
    for c in configs:
        src = render_instance(OP, p, c, target)
        chk = h.check(h.runner(src, c, target))
        if not chk.ok:
            bad.append(f"{src.name}: {chk.detail}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype,layout,act", COMBOS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_configs_match_reference(dtype, layout, act, shape, target):
    N, C, H, W, G = shape
    p = OP.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=dtype, layout=layout, activation=act)
    configs = _configs(p, target, CONFIGS_PER_SHAPE, hash(shape))
    assert len(configs) >= min(CONFIGS_PER_SHAPE, 4), f"only {len(configs)} valid configs"
    _check_all(p, configs, target)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 4, 96, 96, 2), (2, 8, 33, 31, 8), (2, 64, 40, 40, 16), (1, 1536, 6, 6, 32)],
                         ids=lambda s: "x".join(map(str, s)))
def test_rows_channel_sums_match_reference(dtype, shape, target):
    """slice_in=rows sums each channel over the block's R = threads / (C / VEC) pixel rows: every
    threads x vector width, few and many channels (R from 1 to 1024)."""
    N, C, H, W, G = shape
    p = OP.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=dtype, layout="nhwc", activation="none")
    configs = [c for c in OP.space.enumerate() if c["slice_in"] == "rows" and c["items"] == 2
               and c["global_split"] in (4, 64) and c["min_blocks"] == 1 and OP.validate(p, c, target)]
    assert len({(c["threads"], c["vec_bytes"]) for c in configs}) >= 3, configs
    _check_all(p, configs, target)


@pytest.mark.parametrize("dtype,layout", [("fp32", "nchw"), ("bf16", "nhwc"), ("fp16", "nchw")])
def test_cancellation_large_mean(dtype, layout, target):
    """x = 1000 + small noise: the variance must not cancel. mean and rstd are held to the usual
    tolerance. y = x*scale + shift with |shift| ~ |mean|*rstd loses log2(|mean|/std) ~ 10 bits of
    fp32 in that one FMA (PyTorch's kernel has the same form), so y's tolerance is widened 8x for
    fp32 only; a cancelling variance would be off by orders of magnitude, not by 8x."""
    from ckgen.runtime.verify import Harness

    p = OP.parse_problem(N=2, C=64, H=32, W=32, G=8, dtype=dtype, layout=layout)
    rng = np.random.default_rng()
    inputs = OP.make_inputs(p, rng, offset=1000.0)
    if dtype != "fp32":  # fp16/bf16 cannot hold 1000 + small noise; use the largest offset they resolve
        inputs = OP.make_inputs(p, rng, offset=100.0 if dtype == "fp16" else 30.0)
    h = Harness(OP, p, inputs=inputs)
    for c in _configs(p, target, 6, 7):
        run = h.runner(render_instance(OP, p, c, target), c, target)
        chk = h.check(run, widen={"y": 8.0} if dtype == "fp32" else None)
        assert chk.ok, f"{c.key()}: {chk.detail}"


torch = pytest.importorskip("torch")
TORCH_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype,layout,act", COMBOS)
@pytest.mark.parametrize("shape", [(2, 320, 8, 8, 32), (1, 64, 128, 128, 4), (4, 64, 1, 1, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_public_api_matches_torch(dtype, layout, act, shape):
    import torch.nn.functional as F

    import ckgen

    N, C, H, W, G = shape
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x = torch.randn(N, C, H, W, device="cuda", dtype=TORCH_DT[dtype]).contiguous(memory_format=fmt)
    gamma = (1 + 0.2 * torch.randn(C, device="cuda")).to(TORCH_DT[dtype])
    beta = (0.2 * torch.randn(C, device="cuda")).to(TORCH_DT[dtype])
    y, mean, rstd = ckgen.groupnorm_fwd(x, gamma, beta, G, eps=1e-5, activation=None if act == "none" else act)
    ref = F.group_norm(x.double(), G, gamma.double(), beta.double(), 1e-5)
    if act == "swish":
        ref = F.silu(ref)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert y.is_contiguous(memory_format=fmt), "output must keep the input's layout"
    tol = OP.tolerance(dtype, "y")
    torch.testing.assert_close(y.double(), ref, atol=tol.atol, rtol=tol.rtol)
    xm = x.double().reshape(N, G, -1)
    torch.testing.assert_close(mean.double(), xm.mean(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(rstd.double(), 1 / torch.sqrt(xm.var(-1, unbiased=False) + 1e-5), atol=0, rtol=2e-3)


def test_cupy_inputs_and_bf16_wrapper():
    import cupy

    import ckgen

    x = cupy.random.standard_normal((2, 64, 8, 8)).astype(cupy.float16)
    g = cupy.ones(64, cupy.float16)
    b = cupy.zeros(64, cupy.float16)
    y, mean, rstd = ckgen.groupnorm_fwd(x, g, b, 8)
    assert isinstance(y, cupy.ndarray) and y.dtype == cupy.float16
    ref = OP.reference(OP.parse_problem(N=2, C=64, H=8, W=8, G=8, dtype="fp16", layout="nchw"),
                       {"x": cupy.asnumpy(x).astype(np.float64), "gamma": None, "beta": None})
    np.testing.assert_allclose(cupy.asnumpy(y).astype(np.float64), ref["y"], atol=4e-3, rtol=4e-3)
    xb = torch.randn(2, 64, 8, 8, device="cuda", dtype=torch.bfloat16)
    bits = cupy.from_dlpack(xb.view(torch.int16)).view(cupy.uint16)
    yb, _, _ = ckgen.groupnorm_fwd(ckgen.bfloat16(bits), None, None, 8)
    assert isinstance(yb, ckgen.bfloat16)
    got = torch.from_dlpack(yb.data.view(cupy.int16)).view(torch.bfloat16).double()
    torch.testing.assert_close(got, torch.nn.functional.group_norm(xb.double(), 8), atol=3e-2, rtol=1.6e-2)


@pytest.mark.parametrize("call,exc,word", [
    (lambda x, g, b: __import__("ckgen").groupnorm_fwd(x[0], g, b, 8), ValueError, "x"),
    (lambda x, g, b: __import__("ckgen").groupnorm_fwd(x, g, b, 7), ValueError, "groups"),
    (lambda x, g, b: __import__("ckgen").groupnorm_fwd(x, g.float(), b, 8), TypeError, "gamma"),
    (lambda x, g, b: __import__("ckgen").groupnorm_fwd(x, g[:10], b, 8), ValueError, "gamma"),
    (lambda x, g, b: __import__("ckgen").groupnorm_fwd(x.cpu(), g, b, 8), TypeError, "x"),
    (lambda x, g, b: __import__("ckgen").groupnorm_fwd(x.cpu().numpy(), g, b, 8), TypeError, "x"),
    (lambda x, g, b: __import__("ckgen").groupnorm_fwd(x[:, :, ::2], g, b, 8), ValueError, "x"),
    (lambda x, g, b: __import__("ckgen").groupnorm_fwd(x, g, b, 8, activation="tanh"), ValueError, "activation"),
    (lambda x, g, b: __import__("ckgen").groupnorm_fwd(x, g, b, 8, eps=-1.0), ValueError, "eps"),
    (lambda x, g, b: __import__("ckgen").groupnorm_fwd(x.int(), g, b, 8), TypeError, "x"),
])
def test_bad_inputs_raise_clear_errors(call, exc, word):
    x = torch.randn(2, 64, 8, 8, device="cuda", dtype=torch.float16)
    g = torch.ones(64, device="cuda", dtype=torch.float16)
    b = torch.zeros(64, device="cuda", dtype=torch.float16)
    with pytest.raises(exc) as ei:
        call(x, g, b)
    assert str(ei.value).startswith(word + ":"), str(ei.value)


def test_dispatch_uses_db_entry_after_tune(tmp_path):
    """A tuned entry for this shape is what the next call uses."""
    import ckgen
    from ckgen.runtime import db as dbmod
    from ckgen.runtime.target import device_info
    from ckgen.tuner.tune import TuneRequest, db_entry, tune_problem

    info = device_info(None)
    p = OP.parse_problem(N=2, C=64, H=16, W=16, G=8, dtype="fp16", layout="nhwc")
    r = tune_problem(TuneRequest.on(OP, p, info, trials=6, storage=None, seed=1), info)
    from ckgen import settings

    dbmod.save_entries(settings.user_db_path(), [db_entry(r, info)])
    ckgen.reload_db()
    x = torch.randn(2, 64, 16, 16, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    choice = ckgen.explain("groupnorm_fwd", x, None, None, 8)
    assert choice.source == "tuned" and choice.instance == r.best.instance
    # Another shape: the tuned config is used as "nearest" exactly when it is valid there.
    other = torch.randn(2, 64, 16, 32, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    q = OP.parse_problem(N=2, C=64, H=16, W=32, G=8, dtype="fp16", layout="nhwc")
    near = ckgen.explain("groupnorm_fwd", other, None, None, 8)
    if OP.validate(q, r.best.config, info.target):
        assert near.source == "nearest" and near.config == r.best.config, near
    else:
        assert near.source == "default", near
