"""Argument checking of the Problem classes (GroupNormProblem, the pooling problems): every integer
that reaches a template or becomes an int32 kernel argument is bounded, with a ValueError naming
the argument; NumPy integers are ints. Regression cases first, then
Hypothesis properties over arbitrary (valid and hostile) arguments."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.ops.groupnorm import GroupNormProblem
from ckgen.ops.pool import AvgPoolProblem, MaxPoolBwdProblem, MaxPoolFwdProblem
from ckgen.ops.spec import INT32_MAX, Target

SM90 = Target.named("sm_90")
GN = get_op("groupnorm_fwd")
POOL_OPS = ("maxpool2d_fwd", "maxpool2d_bwd", "avgpool2d_fwd", "avgpool2d_bwd")
PROPS = settings(max_examples=300, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def gn(**kw):
    base = dict(N=2, C=32, H=8, W=8, G=4, dtype="bf16", layout="nhwc", activation="none")
    return GN.parse_problem(**{**base, **kw})


def pool(op="maxpool2d_fwd", **kw):
    base = dict(N=2, C=8, H=9, W=9, dtype="fp32", layout="nchw", kernel=3, stride=2, padding=1)
    return get_op(op).parse_problem(**{**base, **kw})


# ------------------------------------------------------------------ regressions (each failed before the fix)


def test_divisor_override_beyond_int32_is_refused_not_truncated():
    """2**32 rendered `constexpr int DIVISOR = 4294967296;`, i.e. 0: no override, wrong results."""
    for op in ("avgpool2d_fwd", "avgpool2d_bwd"):
        with pytest.raises(ValueError, match="^divisor_override: 4294967296 exceeds 2147483647"):
            pool(op, divisor_override=2**32)
        with pytest.raises(ValueError, match="^divisor_override"):
            pool(op, divisor_override=2**31)
    op = get_op("avgpool2d_fwd")
    p = pool("avgpool2d_fwd", divisor_override=INT32_MAX)
    src = render_instance(op, p, op.space.nearest_default(lambda c: bool(op.validate(p, c, SM90))), SM90)
    assert f"constexpr int DIVISOR = {INT32_MAX};" in src.code


@pytest.mark.parametrize("kw, word", [
    (dict(stride=2**31), "stride"),
    (dict(stride=(1, 2**40)), "stride"),
    (dict(dilation=2**31, kernel=1, padding=0), "dilation"),
    (dict(kernel=(1, 2**32 + 1), padding=(0, 2**31)), "kernel_size"),
    (dict(kernel=2**31 + 1, padding=0), "kernel_size"),
])
def test_pooling_params_beyond_int32_are_refused(kw, word):
    for op in POOL_OPS:
        if op.startswith("avg") and "dilation" in kw:
            continue
        with pytest.raises(ValueError, match=f"^{word}: .*(exceeds|beyond) 2147483647"):
            pool(op, **kw)


def test_window_coordinates_must_fit_an_int():
    """Each parameter fits, but the input plus paddings, stride and window do not."""
    with pytest.raises(ValueError, match="^H: window coordinates reach"):
        pool(H=2**31 - 100, W=1, kernel=(3, 1), padding=(1, 0), stride=(100, 1))
    with pytest.raises(ValueError, match="^dilation: window coordinates reach"):
        pool(H=5, W=5, kernel=3, padding=1, stride=1, dilation=(2**30 - 1, 1))
    with pytest.raises(ValueError, match="^stride: window coordinates reach"):
        pool(H=5, W=5, kernel=3, padding=1, stride=(2**31 - 10, 1))
    ok = pool(H=5, W=1, kernel=(3, 1), padding=(1, 0), stride=(2**31 - 20, 1))
    assert (ok.OH, ok.OW) == (1, 1)


def test_avg_window_area_must_fit_an_int():
    """The avg divisor is the window's area, an int in the kernel: 65537 x 65537 overflowed."""
    with pytest.raises(ValueError, match="^kernel_size: the window area 65537x65537"):
        pool("avgpool2d_fwd", H=1, W=1, kernel=65537, padding=32768, stride=1)
    pool("maxpool2d_fwd", H=1, W=1, kernel=65537, padding=32768, stride=1)  # max has no area


def test_tile_reach_beyond_int32_is_an_invalid_config():
    """Near the limit the tile's overhang past the last output (th rows) leaves int32: that tile
    is refused by validate, smaller tiles stay valid."""
    op = get_op("maxpool2d_fwd")
    p = op.parse_problem(N=1, C=8, H=2**31 - 6, W=1, dtype="fp32", layout="nhwc", kernel=(2, 1), stride=(2, 1))
    base = next(c for c in op.space.enumerate() if c["th"] == 4 and c["tw"] == 1 and c["vec_bytes"] == 16)
    why = op.validate(p, base, SM90)
    assert not why and "window coordinates reach 2147483648" in why.reason
    assert op.validate(p, base.replace(th=1), SM90)


@pytest.mark.parametrize("field, value", [("N", 2**31), ("C", 2**32), ("H", 2**31), ("G", 2**31)])
def test_groupnorm_ints_beyond_int32_are_refused(field, value):
    kw = {field: value}
    if field == "C":
        kw["G"] = 1  # divides any C
    with pytest.raises(ValueError, match=f"^{field}: {value} exceeds 2147483647"):
        gn(**kw)


def test_groupnorm_hw_is_an_int32_kernel_argument():
    with pytest.raises(ValueError, match="^H, W: H\\*W = 4294967296 exceeds"):
        gn(H=2**16, W=2**16)
    assert gn(H=2**15, W=2**16 - 1).HW < 2**31


def test_numpy_integers_are_accepted_as_python_ints():
    p = gn(N=np.int64(2), C=np.int32(32), H=np.uint16(8), W=np.int64(8), G=np.int64(4))
    assert all(type(getattr(p, f)) is int for f in "NCHWG")
    assert p == gn()
    q = pool("avgpool2d_fwd", N=np.int64(2), kernel=(np.int64(3), np.int32(3)), stride=np.int64(2),
             divisor_override=np.int64(5), ceil_mode=np.bool_(True), count_include_pad=np.bool_(False))
    assert all(type(v) is int for v in (q.N, *q.kernel, *q.stride, q.divisor_override))
    assert q.ceil_mode is True and q.count_include_pad is False
    assert q.key() == pool("avgpool2d_fwd", kernel=3, stride=2, divisor_override=5, ceil_mode=True,
                           count_include_pad=False).key()


@pytest.mark.parametrize("make, word", [
    (lambda: gn(N=True), "N"),
    (lambda: gn(G=4.0), "G"),
    (lambda: gn(dtype=["bf16"]), "dtype"),
    (lambda: gn(layout=None), "layout"),
    (lambda: gn(activation=1), "activation"),
    (lambda: pool(ceil_mode="no"), "ceil_mode"),
    (lambda: pool(ceil_mode=2), "ceil_mode"),
    (lambda: pool("maxpool2d_fwd", return_indices="yes"), "return_indices"),
    (lambda: pool("maxpool2d_bwd", indices=["stored"]), "indices"),
    (lambda: pool("avgpool2d_fwd", count_include_pad=None), "count_include_pad"),
    (lambda: pool(kernel="33"), "kernel_size"),
    (lambda: pool(stride={1: 2, 3: 4}), "stride"),
    (lambda: pool(C=8.0), "C"),
    (lambda: pool(dtype={"bf16": 1}), "dtype"),
])
def test_wrong_types_raise_value_error_naming_the_argument(make, word):
    with pytest.raises(ValueError, match=f"^{word}: "):
        make()


def test_problem_keys_refuse_out_of_range_flags():
    good = pool("maxpool2d_fwd", return_indices=True).key()
    assert MaxPoolFwdProblem.from_key(good).return_indices is True
    for bad in (good.replace("ceil=0", "ceil=5"), good.replace("idx=1", "idx=2")):
        with pytest.raises(ValueError, match="malformed"):
            MaxPoolFwdProblem.from_key(bad)


# ------------------------------------------------------------------ properties
# Arguments are drawn valid, then up to two of them are replaced by hostile values: junk of any
# type, NumPy ints, ints at and beyond the int32 edge.

JUNK = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=4),
                 st.lists(st.integers(), max_size=3), st.just(np.float32(2.0)), st.just(np.bool_(True)))
EDGE = st.one_of(st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**32, 2**63, -(2**31)]), st.integers(2**20, 2**33),
                 st.integers(-3, 40).map(np.int64), st.integers(1, 9).map(np.int32))
HOSTILE = st.one_of(JUNK, EDGE, st.tuples(EDGE, EDGE), st.tuples(st.integers(-2, 5), EDGE))


def mutated(base: dict, names: tuple[str, ...]):
    changes = st.dictionaries(st.sampled_from(names), HOSTILE, max_size=2)
    return st.tuples(st.just(base), changes).map(lambda bc: {**bc[0], **bc[1]})


@st.composite
def groupnorm_args(draw):
    G, Cg = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    big = draw(st.booleans()) and draw(st.booleans())  # a quarter: sizes at the int32 edge
    H = draw(st.integers(1, 2**16 if big else 20))
    base = dict(N=draw(st.integers(1, 2**31 - 1) if big else st.integers(1, 8)), C=G * Cg, H=H,
                W=draw(st.integers(1, max(1, (2**31 - 1) // H) + (1 if big else 0)) if big else st.integers(1, 20)),
                G=G, dtype=draw(st.sampled_from(["fp32", "fp16", "bf16"])),
                layout=draw(st.sampled_from(["nchw", "nhwc"])), activation=draw(st.sampled_from(["none", "swish"])))
    return draw(mutated(base, tuple(base)))


@st.composite
def pool_args(draw, op: str):
    def pair(lo, hi):
        return draw(st.one_of(st.integers(lo, hi), st.tuples(st.integers(lo, hi), st.integers(lo, hi))))

    kernel = pair(1, 5)
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    big = draw(st.booleans()) and draw(st.booleans())  # a quarter: huge strides, dilations, inputs
    base = dict(N=draw(st.integers(1, 4)), C=draw(st.integers(1, 16)),
                H=draw(st.integers(1, 2**30 if big else 24)), W=draw(st.integers(1, 24)),
                dtype=draw(st.sampled_from(["fp32", "fp16", "bf16"])), layout=draw(st.sampled_from(["nchw", "nhwc"])),
                kernel=kernel, stride=draw(st.one_of(st.none(), st.integers(1, 2**30 if big else 4))),
                padding=(draw(st.integers(0, kh // 2)), draw(st.integers(0, kw // 2))),
                ceil_mode=draw(st.sampled_from([False, True, 0, 1, np.bool_(True)])))
    if op.startswith("max"):
        base["dilation"] = draw(st.integers(1, 2**28 if big else 3))
    if op == "maxpool2d_fwd":
        base["return_indices"] = draw(st.booleans())
    elif op == "maxpool2d_bwd":
        base["indices"] = draw(st.sampled_from(["stored", "recompute"]))
    else:
        base.update(count_include_pad=draw(st.booleans()),
                    divisor_override=draw(st.one_of(st.none(), st.integers(1, 2**31 - 1))))
    return draw(mutated(base, tuple(base)))


GN_NAMES = ("N", "C", "H", "W", "G", "H, W", "groups", "dtype", "layout", "activation")
POOL_NAMES = ("N", "C", "H", "W", "dtype", "layout", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
              "return_indices", "indices", "count_include_pad", "divisor_override")


def _assert_names_an_argument(e: ValueError, names: tuple[str, ...]) -> None:
    msg = str(e)
    assert any(msg.startswith(n + ":") for n in names), msg
    event(f"refused: {msg.split(':')[0]}")
    assert len(msg) < 600, "messages stay short whatever the value"


def _template_ints(op, p) -> list[int]:
    """Every int the template of `p` sees (render_context, with the op's default config) and the
    int32 kernel arguments."""
    ctx = op.render_context(p, op.space.default, SM90)
    vals = [v for v in ctx.values() if isinstance(v, int) and not isinstance(v, bool)]
    args = op.kernel_args(p, {}, 1e-5)
    return vals + [int(a) for a in args if isinstance(a, np.int32)]


@PROPS
@given(kw=groupnorm_args())
def test_groupnorm_problem_is_valid_or_names_the_argument(kw):
    try:
        p = GN.parse_problem(**kw)
    except ValueError as e:
        _assert_names_an_argument(e, GN_NAMES)
        return
    event("valid")
    for f in "NCHWG":
        v = getattr(p, f)
        assert type(v) is int and 1 <= v <= INT32_MAX
    assert p.HW <= INT32_MAX and p.C % p.G == 0
    assert GroupNormProblem.from_key(p.key()) == p
    for name in ("groupnorm_fwd", "groupnorm_bwd"):
        args = get_op(name).kernel_args(p, {"x": 0, "y": 0, "mean": 0, "rstd": 0, "dy": 0}, 1e-5)
        assert {int(a) for a in args if isinstance(a, np.int32)} <= {p.N, p.C, p.HW, p.G}


@PROPS
@given(data=st.data(), op=st.sampled_from(POOL_OPS))
def test_pool_problem_is_valid_or_names_the_argument(data, op):
    spec = get_op(op)
    kw = data.draw(pool_args(op), "kwargs")
    try:
        p = spec.parse_problem(**kw)
    except ValueError as e:
        _assert_names_an_argument(e, POOL_NAMES)
        return
    event("valid")
    assert type(p) is spec.problem_cls
    for v in (p.N, p.C, p.H, p.W, *p.kernel, *p.stride, *p.padding, *p.dilation, p.OH, p.OW, *p.eff_kernel):
        assert type(v) is int and 0 <= v <= INT32_MAX
    assert p.OH >= 1 and p.OW >= 1
    for axis, size in ((0, p.H), (1, p.W)):
        assert size + 2 * p.padding[axis] + p.stride[axis] + p.eff_kernel[axis] <= INT32_MAX
    assert isinstance(p.ceil_mode, bool)
    if isinstance(p, AvgPoolProblem):
        assert type(p.divisor_override) is int and 0 <= p.divisor_override <= INT32_MAX
        assert p.kernel[0] * p.kernel[1] <= INT32_MAX and isinstance(p.count_include_pad, bool)
    if isinstance(p, MaxPoolFwdProblem):
        assert isinstance(p.return_indices, bool)
    if isinstance(p, MaxPoolBwdProblem):
        assert p.indices in ("stored", "recompute")
    assert spec.problem_from_key(p.key()) == p
    assert all(abs(v) <= INT32_MAX for v in _template_ints(spec, p))
    for c in spec.space.enumerate()[:: max(1, len(spec.space.enumerate()) // 40)]:  # validate never raises
        assert isinstance(bool(spec.validate(p, c, SM90)), bool)


@PROPS
@given(key=st.one_of(st.text(max_size=60),
                     st.lists(st.tuples(st.sampled_from(["N", "C", "H", "W", "G", "dtype", "layout", "act", "k", "s",
                                                         "p", "d", "ceil", "idx", "cip", "div", "indices", "x"]),
                                        st.one_of(st.integers(-5, 2**33).map(str), st.sampled_from(
                                            ["bf16", "nchw", "nhwc", "3x3", "1x0", "2x2x2", "swish", "", "stored"]))),
                              max_size=16).map(lambda kv: ",".join(f"{k}={v}" for k, v in kv))),
       op=st.sampled_from(("groupnorm_fwd",) + POOL_OPS))
def test_problem_from_key_is_a_problem_or_value_error(key, op):
    """What the DB relies on (finding 1): any key parses to a valid problem or raises ValueError."""
    spec = get_op(op)
    try:
        p = spec.problem_from_key(key)
    except ValueError as e:
        assert "malformed" in str(e)
        return
    assert spec.problem_from_key(p.key()) == p
