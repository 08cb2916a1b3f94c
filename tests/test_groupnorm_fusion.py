"""The forward's fusion menu on the CPU: problem keys, validation, the float64 reference, the
kernel arguments after eps, and slice_in=lean's register estimate against NVRTC's spills."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ckgen.ops import get_op
from ckgen.ops.groupnorm import ACTIVATIONS, GroupNormProblem, activation_reference, groupnorm_fwd_reference
from ckgen.types import Config, Target

FWD = get_op("groupnorm_fwd")
BWD = get_op("groupnorm_bwd")
SM90 = Target.named("sm_90")
KW = dict(N=2, C=64, H=6, W=5, G=8, dtype="bf16", layout="nhwc")


def _lean(**kw) -> Config:
    c = dict(threads=128, vec_bytes=16, items=2, groups_per_block=1, cluster=1, slice_in="lean",
             min_blocks=1, merge="cluster", global_split=1)
    return Config.of({**c, **kw})


def test_plain_keys_are_unchanged_and_fused_keys_round_trip() -> None:
    plain = FWD.parse_problem(**KW, activation="swish")
    assert plain.key() == "N=2,C=64,H=6,W=5,G=8,dtype=bf16,layout=nhwc,act=swish"
    fused = FWD.parse_problem(**KW, activation="relu", residual=True, bias_nc=True)
    assert fused.key() == "N=2,C=64,H=6,W=5,G=8,dtype=bf16,layout=nhwc,act=relu,res=1,bias=1"
    for p in (plain, fused, FWD.parse_problem(**KW, bias_nc=True)):
        assert GroupNormProblem.from_key(p.key()) == p
    assert not plain.fused and fused.fused and FWD.parse_problem(**KW, activation="gelu").fused


@pytest.mark.parametrize("key, word", [
    ("N=2,C=64,H=6,W=5,G=8,dtype=bf16,layout=nhwc,act=relu,res=2", "res='2'"),
    ("N=2,C=64,H=6,W=5,G=8,dtype=bf16,layout=nhwc,act=tanh", "activation"),
])
def test_bad_fused_keys_are_refused(key: str, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        GroupNormProblem.from_key(key)


def test_residual_and_bias_must_be_bools() -> None:
    with pytest.raises(ValueError, match="^residual: expected a bool"):
        FWD.parse_problem(**KW, residual="yes")


def test_only_lean_runs_a_fused_problem_and_the_backward_refuses_it() -> None:
    fused = FWD.parse_problem(**KW, activation="relu", residual=True)
    regs = Config.of({**_lean().as_dict(), "slice_in": "regs"})
    why = FWD.validate(fused, regs, SM90)
    assert not why and "only slice_in=lean fuses it" in why.reason
    assert FWD.validate(fused, _lean(), SM90)
    assert FWD.validate(FWD.parse_problem(**KW), regs, SM90), "a plain problem keeps every slice_in"
    bwd_cfg = next(c for c in BWD.space.enumerate() if BWD.validate(BWD.parse_problem(**KW), c, SM90))
    assert not BWD.validate(BWD.parse_problem(**KW, activation="relu"), bwd_cfg, SM90)
    # the array forms agree (the cost model's candidates)
    cols = {k: np.array([c[k] for c in (regs, _lean())]) for k in regs.as_dict()}
    assert FWD.class_check_many(fused, cols, SM90).tolist() == [False, True]


def test_instance_names_say_what_is_fused() -> None:
    p = FWD.parse_problem(**KW, activation="gelu_tanh", residual=True, bias_nc=True)
    assert FWD.instance_name(p, _lean()).startswith("ckgen_groupnorm_fwd_bf16_nhwc_gelu_tanh_res_bias_t128")
    assert "_res" not in FWD.instance_name(FWD.parse_problem(**KW, activation="gelu_tanh"), _lean())


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_activation_reference(act: str) -> None:
    y = np.linspace(-5, 5, 101)
    want = {"none": y, "swish": y / (1 + np.exp(-y)), "relu": np.maximum(y, 0),
            "gelu": np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in y]),
            "gelu_tanh": 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))}[act]
    np.testing.assert_allclose(activation_reference(y, act), want, atol=5e-7)  # erf to ~1.5e-7


def test_fused_reference_is_the_composition() -> None:
    rng = np.random.default_rng(0)
    x, r = rng.normal(size=(2, 8, 3, 3)), rng.normal(size=(2, 8, 3, 3))
    b, g, be = rng.normal(size=(2, 8)), rng.normal(size=8), rng.normal(size=8)
    out = groupnorm_fwd_reference(x, g, be, 4, 1e-5, "relu", r, b)
    plain = groupnorm_fwd_reference(x + b[:, :, None, None], g, be, 4, 1e-5)
    np.testing.assert_allclose(out["y"], np.maximum(plain["y"] + r, 0))
    np.testing.assert_allclose(out["mean"], plain["mean"])
    np.testing.assert_allclose(out["rstd"], plain["rstd"])


def test_fused_inputs_travel_after_eps() -> None:
    """Older kernels take (pointers, C, HW, G, eps); the fused inputs come after eps, so those
    kernels' parameters stay where they were."""
    p = FWD.parse_problem(**KW, residual=True, bias_nc=True)
    args = FWD.kernel_args(p, {"x": 1, "y": 4, "res": 8, "bias": 9}, eps=1e-5)
    head = len(FWD.arg_names) + len(FWD.scalar_args(p))
    assert [int(a) for a in args[head + 1:]] == [8, 9]
    assert np.float32(args[head]) == np.float32(1e-5)
    inputs = FWD.make_inputs(p, np.random.default_rng(0))
    packed = FWD.pack_inputs(p, inputs)
    assert packed["res"].size == p.numel and packed["bias"].size == p.N * p.C


def test_plain_inputs_draw_what_they_drew() -> None:
    """The fused inputs are drawn after the others: a plain problem's inputs stay as they were."""
    p = FWD.parse_problem(**KW)
    a = FWD.make_inputs(p, np.random.default_rng(3))
    b = FWD.make_inputs(FWD.parse_problem(**KW, residual=True), np.random.default_rng(3))
    for k in ("x", "gamma", "beta"):
        np.testing.assert_array_equal(a[k], b[k])
    assert "residual" not in a and "residual" in b


@pytest.mark.parametrize("key, cfg, fits", [
    # measured with NVRTC for sm_90: the first of each pair compiles without a stack frame, the
    # second spills, and the estimate puts them on either side of the budget
    ("N=16,C=512,H=64,W=64,G=32,dtype=bf16,layout=nhwc,act=none", dict(threads=256, items=16, cluster=2, min_blocks=2), True),
    ("N=16,C=512,H=64,W=64,G=32,dtype=bf16,layout=nhwc,act=none", dict(threads=512, items=8, cluster=2, min_blocks=2), False),
    ("N=16,C=512,H=64,W=64,G=32,dtype=bf16,layout=nchw,act=none", dict(threads=512, items=8, cluster=2, min_blocks=2), True),
    ("N=2,C=320,H=64,W=64,G=32,dtype=fp16,layout=nchw,act=gelu,res=1,bias=1", dict(threads=256, items=8, cluster=4, min_blocks=4), False),
])
def test_lean_register_estimate_matches_spills(key: str, cfg: dict, fits: bool) -> None:
    from ckgen.runtime.spill import spill_bytes

    p = FWD.problem_from_key(key)
    c = _lean(vec_bytes=16, **cfg)
    budget = min(255, 65536 // (c["threads"] * c["min_blocks"]))
    assert (FWD.regs_used(p, c) <= budget) is fits
    if fits:
        assert FWD.validate(p, c, SM90)
        assert spill_bytes(FWD, p, c, SM90) == 0
