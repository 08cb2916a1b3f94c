"""GPU tier of the plug-in op (the channel-wise scale of tests/plugin_chscale.py, registered
with `ckgen.ops.register`): every dtype x layout tuned for a few trials through the real tune
path (`tune.tune_problem`), its winner saved and then used by the dispatcher, the output
against the float64 reference; every valid config against the reference with poisoned
outputs; an untuned problem served by the dispatcher's fallback; the plug-in's public function
and PyTorch's product agree.

    python -m pytest -m gpu tests/gpu/test_plugin_op_gpu.py
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the plug-in's files
import plugin_chscale  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = ("fp32", "fp16", "bf16")
LAYOUTS = ("nchw", "nhwc")
SHAPE = dict(N=2, C=48, H=10, W=12)  # H*W = 120 and C = 48: every vector width fits both layouts


@pytest.fixture(scope="module")
def op(tmp_path_factory):
    spec = plugin_chscale.install(tmp_path_factory.mktemp("plugin"))
    yield spec
    plugin_chscale.uninstall()


@pytest.fixture(scope="module")
def info():
    from ckgen.runtime.target import device_info

    return device_info(None)


def _tensors(p, seed: int = 0):
    """x (in p's layout) and s as torch CUDA tensors, and their float64 values."""
    import torch

    from ckgen.ops.numeric import round_to

    rng = np.random.default_rng(seed)
    x = round_to(rng.standard_normal((p.N, p.C, p.H, p.W)) + 0.25, p.dtype)
    s = round_to(rng.uniform(0.5, 2.0, p.C) * rng.choice([-1.0, 1.0], p.C), p.dtype)
    dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[p.dtype]
    fmt = torch.channels_last if p.layout == "nhwc" else torch.contiguous_format
    xt = torch.tensor(x, dtype=torch.float64).to(dt).cuda().contiguous(memory_format=fmt)
    st = torch.tensor(s, dtype=torch.float64).to(dt).cuda()
    return xt, st, x, s


def _call(op, x, s):
    """y = x * s[c] through the dispatcher, as an op's public function calls it (plan_for)."""
    from ckgen.runtime.dispatch import Output, plan_for
    from ckgen.runtime.tensors import as_device_tensor, layout_of

    xt, st = as_device_tensor(x, "x"), as_device_tensor(s, "s")
    layout = layout_of(xt, "x")
    N, C, H, W = xt.shape
    p = op.parse_problem(N=N, C=C, H=H, W=W, dtype=xt.dtype, layout=layout)
    plan = plan_for(op, p, xt, {"x": xt.ptr, "s": st.ptr}, [Output("y", (N, C, H, W), layout, p.dtype)], ("x", "s"))
    return plan, plan.run((xt.ptr, st.ptr), 0.0, x)[0]


def _check(op, p, y, like, x, s) -> None:
    """y (a torch tensor in `like`'s shape and layout) against the reference of x and s."""
    want = op.reference(p, {"x": x, "s": s})["y"]
    tol = op.tolerance(p.dtype, "y")
    assert y.shape == like.shape and y.stride() == like.stride() and y.dtype == like.dtype
    got = y.double().cpu().numpy()
    assert np.all(np.abs(got - want) <= tol.atol + tol.rtol * np.abs(want)), (p.key(), np.abs(got - want).max())


@pytest.mark.parametrize("dtype,layout", list(itertools.product(DTYPES, LAYOUTS)))
def test_tune_then_dispatch(op, info, dtype, layout) -> None:
    import torch

    import ckgen
    from ckgen.runtime import db as dbmod
    from ckgen import settings
    from ckgen.tuner.tune import TuneRequest, db_entry, tune_problem

    p = op.parse_problem(**SHAPE, dtype=dtype, layout=layout)
    r = tune_problem(TuneRequest.on(op, p, info, trials=4, storage=None, seed=1), info)
    assert r.best is not None and op.validate(p, r.best.config, info.target)
    dbmod.save_entries(settings.user_db_path(), [db_entry(r, info)])
    ckgen.reload_db()
    x, s, xv, sv = _tensors(p)
    plan, y = _call(op, x, s)
    assert plan.choice.source == "tuned" and plan.choice.instance == r.best.instance, plan.choice
    _check(op, p, y, x, xv, sv)
    # the plug-in's public function takes the same plan; PyTorch's product agrees (one rounding each)
    assert torch.equal(sys.modules["chscale_op"].chscale(x, s), y)
    assert torch.equal(y, x * s.view(1, -1, 1, 1))


@pytest.mark.parametrize("dtype,layout", list(itertools.product(DTYPES, LAYOUTS)))
def test_untuned_call_and_every_config(op, info, dtype, layout) -> None:
    from ckgen.instance import render_instance
    from ckgen.runtime.verify import Harness

    p = op.parse_problem(N=3, C=40, H=7, W=8, dtype=dtype, layout=layout)
    x, s, xv, sv = _tensors(p, seed=1)
    plan, y = _call(op, x, s)
    assert plan.choice.source != "tuned"
    _check(op, p, y, x, xv, sv)
    h = Harness(op, p, seed=2)
    configs = [c for c in op.space.enumerate() if op.validate(p, c, info.target)]
    assert configs
    for c in configs:
        chk = h.check(h.runner(render_instance(op, p, c, info.target), c, info.target))
        assert chk.ok, (p.key(), c.key(), chk.detail)
