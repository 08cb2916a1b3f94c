"""GPU tier of the pooling ops: every op x dtype x layout x a grid of pooling options, several
configs each (gather and scatter), against the float64 reference with poisoned outputs; the
public API against torch.nn.functional.max_pool2d / avg_pool2d and their autograd gradients
(max pooling exact, NaN / ties / -inf included); a tensor over 2^31 elements; bad inputs.

    python -m pytest -m gpu tests/gpu/test_pool_gpu.py
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.ops.pool import maxpool2d_reference

pytestmark = pytest.mark.gpu

DTYPES = ("fp32", "fp16", "bf16")
LAYOUTS = ("nchw", "nhwc")
SHAPE = dict(N=2, C=32, H=13, W=24)  # W = 24: NCHW row vectors of up to 8 fit; partial last tiles
MAX_GEOS = [
    dict(kernel=3, stride=2, padding=1),
    dict(kernel=3, stride=2, padding=1, ceil_mode=True),
    dict(kernel=2, stride=2),
    dict(kernel=3, stride=1, padding=1),
    dict(kernel=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1), ceil_mode=True),
    dict(kernel=5, stride=3, padding=2, dilation=(1, 2)),
]
AVG_GEOS = [
    dict(kernel=3, stride=2, padding=1),
    dict(kernel=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    dict(kernel=2, stride=2),
    dict(kernel=3, stride=1, padding=1, count_include_pad=False),
    dict(kernel=(3, 2), stride=(2, 1), padding=(1, 1), ceil_mode=True),
    dict(kernel=4, stride=3, padding=2, ceil_mode=True, divisor_override=5),
]
CASES = ([("maxpool2d_fwd", dict(g, return_indices=ri)) for g in MAX_GEOS for ri in (True, False)]
         + [("maxpool2d_bwd", dict(g, indices=ind)) for g in MAX_GEOS for ind in ("stored", "recompute")]
         + [("avgpool2d_fwd", g) for g in AVG_GEOS] + [("avgpool2d_bwd", g) for g in AVG_GEOS])
CONFIGS = 5


def _id(case) -> str:
    name, kw = case
    return name + "-" + "-".join(f"{k}{v}".replace(" ", "") for k, v in kw.items())


@pytest.fixture(scope="module")
def target():
    from ckgen.runtime.target import current_target

    return current_target()


def _problem(name, kw, dtype, layout):
    return get_op(name).parse_problem(**SHAPE, dtype=dtype, layout=layout, **kw)


def _configs(op, p, target, n=CONFIGS):
    """The default (or nearest valid), a scatter config (backward), an smem config (max backward,
    indices=None, NCHW), a fast-path config (NCHW row vectors / NHWC 16-byte vectors in the
    forward, a stride-aligned gather in the backward), then seeded random others."""
    valid = [c for c in op.space.enumerate() if op.validate(p, c, target)]
    first = op.space.nearest_default(lambda c: bool(op.validate(p, c, target)))
    picked = [first]
    rng = random.Random(p.key())
    if op.backward:
        picked += [c for c in valid if c["algo"] == "scatter"][:1]
        fast = [c for c in valid if op.aligned_gather(p, c) and c not in picked]
        xf = [c for c in fast if op.x_footprint(p, c) and op.row_vec_elems(p, c) > 1]
        fast = xf or fast  # indices=None NCHW: the x-footprint path with row vectors
        smem = [c for c in valid if c["algo"] == "smem"]
        picked += rng.sample(smem, min(1, len(smem)))  # indices=None NCHW: shared memory and a barrier
    else:
        fast = [c for c in valid if c["vec_bytes"] >= 8 and c["tw"] >= 2 and c not in picked]
    picked += rng.sample(fast, min(1, len(fast)))
    rest = [c for c in valid if c not in picked]
    rng.shuffle(rest)
    return (picked + rest)[:n]


def _inputs(op, p, rng, special=True):
    inputs = op.make_inputs(p, rng)
    if op.pool == "max" and special:
        x = inputs["x"]
        m = rng.random(x.shape)
        x[m < 0.03] = np.nan
        x[m > 0.9] = -np.inf
        x[0, -1] = -np.inf  # one whole plane of -inf: every window all -inf
        if "indices" in inputs:
            inputs["indices"] = maxpool2d_reference(p, x)[1]
    return inputs


@pytest.fixture(scope="module", autouse=True)
def _prewarm(target):
    """Compile every instance the harness tests use, in parallel, into the cubin cache."""
    from ckgen.runtime.compile import compile_many

    srcs = []
    for (name, kw), dt, lay in itertools.product(CASES, DTYPES, LAYOUTS):
        op = get_op(name)
        p = _problem(name, kw, dt, lay)
        srcs += [render_instance(op, p, c, target) for c in _configs(op, p, target)]
    failures = compile_many(srcs, target)
    assert not failures, list(failures.values())[:3]


@pytest.mark.parametrize("dtype,layout", list(itertools.product(DTYPES, LAYOUTS)))
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_configs_match_reference(case, dtype, layout, target):
    from ckgen.runtime.verify import Harness

    name, kw = case
    op = get_op(name)
    p = _problem(name, kw, dtype, layout)
    h = Harness(op, p, inputs=_inputs(op, p, np.random.default_rng()))
    bad = []
    configs = _configs(op, p, target)
    assert len(configs) >= 2
    for c in configs:
        src = render_instance(op, p, c, target)
        chk = h.check(h.runner(src, c, target))
        if not chk.ok:
            bad.append(f"{src.name}: {chk.detail}")
    assert not bad, "\n".join(bad)


torch = pytest.importorskip("torch")
F = torch.nn.functional
TORCH_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
API_GEOS_MAX = [MAX_GEOS[0], MAX_GEOS[1], MAX_GEOS[3], MAX_GEOS[4]]
API_GEOS_AVG = [AVG_GEOS[0], AVG_GEOS[1], AVG_GEOS[4], AVG_GEOS[5]]


def _fmt(layout):
    return torch.channels_last if layout == "nhwc" else torch.contiguous_format


def _x(layout, dtype, shape=(2, 32, 13, 15), special=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randint(-8, 9, shape, device="cuda", generator=g).float() / 4  # a coarse grid: ties
    if special:
        m = torch.rand(shape, device="cuda", generator=g)
        x[m < 0.03] = float("nan")
        x[m > 0.9] = float("-inf")
        x[0, -1] = float("-inf")
    return x.to(TORCH_DT[dtype]).contiguous(memory_format=_fmt(layout))


def _torch_max(kw):
    return dict(kernel_size=kw["kernel"], stride=kw.get("stride"), padding=kw.get("padding", 0),
                dilation=kw.get("dilation", 1), ceil_mode=kw.get("ceil_mode", False))


def _torch_avg(kw):
    return dict(kernel_size=kw["kernel"], stride=kw.get("stride"), padding=kw.get("padding", 0),
                ceil_mode=kw.get("ceil_mode", False), count_include_pad=kw.get("count_include_pad", True),
                divisor_override=kw.get("divisor_override"))


def _close(got, want, op, dtype, out):
    tol = op.tolerance(dtype, out)
    torch.testing.assert_close(got.double(), want.double(), atol=tol.atol, rtol=tol.rtol, equal_nan=True)


@pytest.mark.parametrize("dtype,layout", list(itertools.product(DTYPES, LAYOUTS)))
@pytest.mark.parametrize("kw", API_GEOS_MAX, ids=lambda kw: _id(("max", kw)))
def test_maxpool_api_matches_torch(kw, dtype, layout):
    import ckgen

    x = _x(layout, dtype, special=True)
    tk = _torch_max(kw)
    y, idx = ckgen.maxpool2d_fwd(x, **tk, return_indices=True)
    # PyTorch's NCHW kernel is the semantic reference (its NHWC kernel returns index 0 for an
    # all -inf window): compare against torch on the NCHW-contiguous copy.
    ref_y, ref_idx = F.max_pool2d(x.contiguous(), **tk, return_indices=True)
    assert y.shape == ref_y.shape and y.dtype == x.dtype and idx.dtype == torch.int64
    assert y.is_contiguous(memory_format=_fmt(layout)) and idx.is_contiguous(memory_format=_fmt(layout))
    torch.testing.assert_close(y, ref_y, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(idx, ref_idx), (idx != ref_idx).nonzero()[:5]
    y2 = ckgen.maxpool2d_fwd(x, **tk)
    torch.testing.assert_close(y2, ref_y, atol=0, rtol=0, equal_nan=True)

    # backward: stored indices and recomputed argmax, against autograd (overlaps accumulate)
    xr = x.detach().contiguous().requires_grad_(True)
    out = F.max_pool2d(xr, **tk)
    dy = torch.randn(out.shape, device="cuda").to(x.dtype).contiguous(memory_format=_fmt(layout))
    out.backward(dy.contiguous())
    op = get_op("maxpool2d_bwd")
    for ind in (idx, None):
        dx = ckgen.maxpool2d_bwd(dy, x, **tk, indices=ind)
        assert dx.shape == x.shape and dx.dtype == x.dtype and dx.is_contiguous(memory_format=_fmt(layout))
        _close(dx, xr.grad, op, dtype, "dx")


@pytest.mark.parametrize("dtype,layout", list(itertools.product(DTYPES, LAYOUTS)))
@pytest.mark.parametrize("kw", API_GEOS_AVG, ids=lambda kw: _id(("avg", kw)))
def test_avgpool_api_matches_torch(kw, dtype, layout):
    """Against PyTorch evaluated in float64 on the same (rounded) inputs: ckgen rounds once from
    fp32 sums, PyTorch's own fp16/bf16 result is another rounding, so the two low-precision
    results can differ by 2 ulps; each is held to the op's tolerance of the exact result."""
    import ckgen

    x = torch.randn(2, 32, 13, 15, device="cuda").to(TORCH_DT[dtype]).contiguous(memory_format=_fmt(layout))
    ta = _torch_avg(kw)
    y = ckgen.avgpool2d_fwd(x, **ta)
    xr = x.detach().double().contiguous().requires_grad_(True)
    ref = F.avg_pool2d(xr, **ta)
    assert y.shape == ref.shape and y.dtype == x.dtype and y.is_contiguous(memory_format=_fmt(layout))
    _close(y, ref, get_op("avgpool2d_fwd"), dtype, "y")
    dy = torch.randn(ref.shape, device="cuda").to(x.dtype).contiguous(memory_format=_fmt(layout))
    ref.backward(dy.double().contiguous())
    dx = ckgen.avgpool2d_bwd(dy, x, **ta)
    assert dx.shape == x.shape and dx.is_contiguous(memory_format=_fmt(layout))
    _close(dx, xr.grad, get_op("avgpool2d_bwd"), dtype, "dx")


def test_nan_tie_and_inf_semantics_exactly():
    import ckgen

    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[[[1.0, 3.0, 3.0, -inf], [3.0, nan, 3.0, -inf], [nan, 2.0, -inf, -inf],
                        [0.5, 0.5, -inf, -inf]]]], device="cuda")
    for layout in LAYOUTS:
        xl = x.contiguous(memory_format=_fmt(layout))
        y, idx = ckgen.maxpool2d_fwd(xl, 2, stride=1, return_indices=True)
        ry, ridx = F.max_pool2d(x, 2, stride=1, return_indices=True)
        assert torch.equal(idx, ridx), (layout, idx, ridx)
        torch.testing.assert_close(y, ry, atol=0, rtol=0, equal_nan=True)


def test_cupy_and_bf16_wrapper():
    import cupy

    import ckgen

    x = cupy.random.standard_normal((2, 16, 9, 9)).astype(cupy.float16)
    y = ckgen.avgpool2d_fwd(x, 3, stride=2, padding=1)
    assert isinstance(y, cupy.ndarray) and y.shape == (2, 16, 5, 5)
    ref = F.avg_pool2d(torch.from_dlpack(x).float(), 3, 2, 1)
    torch.testing.assert_close(torch.from_dlpack(y).float(), ref, atol=1e-3, rtol=1e-3)
    xb = torch.randn(2, 16, 9, 9, device="cuda", dtype=torch.bfloat16)
    bits = cupy.from_dlpack(xb.view(torch.int16)).view(cupy.uint16)
    yb, ib = ckgen.maxpool2d_fwd(ckgen.bfloat16(bits), 3, 2, 1, return_indices=True)
    assert isinstance(yb, ckgen.bfloat16) and isinstance(ib, cupy.ndarray) and ib.dtype == cupy.int64
    got = torch.from_dlpack(yb.data.view(cupy.int16)).view(torch.bfloat16)
    ry, ri = F.max_pool2d(xb, 3, 2, 1, return_indices=True)
    assert torch.equal(got, ry) and torch.equal(torch.from_dlpack(ib), ri)
    dx = ckgen.maxpool2d_bwd(ckgen.bfloat16(cupy.from_dlpack(ry.view(torch.int16)).view(cupy.uint16)),
                             ckgen.bfloat16(bits), 3, 2, 1, indices=ib)
    assert isinstance(dx, ckgen.bfloat16) and dx.shape == (2, 16, 9, 9)


def test_over_2_31_elements():
    """fp16 (1, 9, 16384, 16384): 2.4e9 elements; the last plane lies entirely beyond 2^31."""
    import ckgen

    shape = (1, 9, 16384, 16384)
    x = torch.empty(shape, device="cuda", dtype=torch.float16)
    x.normal_()
    assert x.numel() > 2**31
    y, idx = ckgen.maxpool2d_fwd(x, 2, 2, return_indices=True)
    for c in (0, 8):
        ry, ri = F.max_pool2d(x[:, c:c + 1].contiguous(), 2, 2, return_indices=True)
        assert torch.equal(y[:, c:c + 1], ry) and torch.equal(idx[:, c:c + 1], ri), c
    dy = torch.randn(y.shape, device="cuda", dtype=torch.float16)
    del y
    dx = ckgen.maxpool2d_bwd(dy, x, 2, 2, indices=idx)
    for c in (0, 8):
        xs = x[:, c:c + 1].contiguous().requires_grad_(True)
        F.max_pool2d(xs, 2, 2).backward(dy[:, c:c + 1].contiguous())
        assert torch.equal(dx[:, c:c + 1], xs.grad), c
    del dx, idx, dy
    torch.cuda.empty_cache()
    xl = x.contiguous(memory_format=torch.channels_last)
    del x
    ya = ckgen.avgpool2d_fwd(xl, 3, 2, 1)
    tail = xl[:, :, -64:, -64:].contiguous()  # the end of the channels-last buffer: offsets > 2^31
    ref = F.avg_pool2d(tail.float(), 3, 2, 1)[:, :, 1:, 1:]  # windows fully inside the tail
    torch.testing.assert_close(ya[:, :, -31:, -31:].float(), ref, atol=1e-3, rtol=1e-3)


def _bad_calls():
    import ckgen

    x = torch.randn(2, 8, 10, 10, device="cuda")
    dy = torch.randn(2, 8, 5, 5, device="cuda")
    idx = torch.zeros(2, 8, 5, 5, device="cuda", dtype=torch.int64)
    x4 = torch.randn(2, 4, 10, 10, device="cuda")
    return [
        (lambda: ckgen.maxpool2d_fwd(x[0], 2), ValueError, "x"),
        (lambda: ckgen.maxpool2d_fwd(x, 3, padding=2), ValueError, "padding"),
        (lambda: ckgen.maxpool2d_fwd(x, 0), ValueError, "kernel_size"),
        (lambda: ckgen.maxpool2d_fwd(x, 2, stride=0), ValueError, "stride"),
        (lambda: ckgen.maxpool2d_fwd(x, 2, dilation=0), ValueError, "dilation"),
        (lambda: ckgen.maxpool2d_fwd(x, 11), ValueError, "kernel_size"),
        (lambda: ckgen.maxpool2d_fwd(x, (2, 2, 2)), ValueError, "kernel_size"),
        (lambda: ckgen.maxpool2d_fwd(x, 2, return_indices="yes"), TypeError, "return_indices"),
        (lambda: ckgen.maxpool2d_fwd(x.cpu(), 2), TypeError, "x"),
        (lambda: ckgen.maxpool2d_fwd(x.int(), 2), TypeError, "x"),
        (lambda: ckgen.maxpool2d_fwd(x[:, :, ::2], 2), ValueError, "x"),
        (lambda: ckgen.maxpool2d_bwd(dy[:, :, :4], x, 2), ValueError, "dy"),
        (lambda: ckgen.maxpool2d_bwd(dy.half(), x, 2), TypeError, "dy"),
        (lambda: ckgen.maxpool2d_bwd(dy, x, 2, indices=idx.int()), TypeError, "indices"),
        (lambda: ckgen.maxpool2d_bwd(dy, x, 2, indices=idx[:, :4]), ValueError, "indices"),
        (lambda: ckgen.maxpool2d_bwd(dy, x, 2, indices=idx.cpu()), TypeError, "indices"),
        (lambda: ckgen.maxpool2d_bwd(dy.transpose(2, 3), x, 2), ValueError, "dy"),
        (lambda: ckgen.avgpool2d_fwd(x, 2, divisor_override=0), ValueError, "divisor_override"),
        (lambda: ckgen.avgpool2d_fwd(x, 2, count_include_pad=None), TypeError, "count_include_pad"),
        (lambda: ckgen.avgpool2d_fwd(x, 2, ceil_mode="no"), TypeError, "ceil_mode"),
        (lambda: ckgen.avgpool2d_bwd(dy, x, 3), ValueError, "dy"),
        (lambda: ckgen.avgpool2d_bwd(dy, x4, 2), ValueError, "dy"),
    ]


def test_bad_inputs_raise_before_launch():
    for call, exc, word in _bad_calls():
        with pytest.raises(exc) as ei:
            call()
        assert str(ei.value).startswith(word + ":"), (word, str(ei.value))


def test_dispatch_uses_tuned_entry():
    import ckgen
    from ckgen.runtime import db as dbmod
    from ckgen import settings
    from ckgen.runtime.target import device_info
    from ckgen.tuner.tune import TuneRequest, db_entry, tune_problem

    info = device_info(None)
    op = get_op("maxpool2d_fwd")
    p = op.parse_problem(N=4, C=64, H=28, W=28, dtype="bf16", layout="nhwc", kernel=3, stride=2, padding=1)
    r = tune_problem(TuneRequest.on(op, p, info, trials=6, storage=None, seed=1), info)
    dbmod.save_entries(settings.user_db_path(), [db_entry(r, info)])
    ckgen.reload_db()
    choice = ckgen.explain("maxpool2d_fwd", N=4, C=64, H=28, W=28, dtype="bf16", layout="nhwc", kernel=3, stride=2,
                           padding=1, arch=info.target.arch)
    assert choice.source == "tuned" and choice.instance == r.best.instance
    other = ckgen.explain("maxpool2d_fwd", N=4, C=64, H=28, W=28, dtype="bf16", layout="nhwc", kernel=2, stride=2,
                          arch=info.target.arch)
    assert other.source != "tuned"
