"""The pooling kernels themselves, run on the CPU (tests/pool_emu.py: the HIP render compiled as
C++ with a shim, threads run serially) against the float64 reference with poisoned outputs:
every op, both layouts, the three dtypes, gather and scatter, and the edge cases (ceil_mode,
dilation, padding, count_include_pad, divisor_override, NaN, ties, -inf windows)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from ckgen.ops import get_op
from ckgen.ops.numeric import max_violation
from ckgen.ops.pool import maxpool2d_reference
from tiers import SWEEP

pool_emu = pytest.importorskip("pool_emu")
pytestmark = pytest.mark.skipif(pool_emu.compiler() is None, reason="no C++ compiler (clang++-19, clang++ or g++)")


def check(op, p, config, inputs):
    ref = op.reference(p, inputs)
    got = pool_emu.run(op, p, config, inputs)
    for k, r in ref.items():
        tol = op.tolerance(p.dtype, k)
        v = max_violation(got[k], r, tol.atol, tol.rtol)
        assert v <= 1.0, f"{op.instance_name(p, config)} {p.key()} {k}: error {v:.3g}x tolerance"


def specials(p, inputs, rng):
    """NaN, -inf and a whole -inf plane in x (max pooling); indices recomputed to match."""
    x = inputs["x"]
    m = rng.random(x.shape)
    x[m < 0.04] = np.nan
    x[m > 0.85] = -np.inf
    x[0, -1] = -np.inf
    if "indices" in inputs:
        inputs["indices"] = maxpool2d_reference(p, x)[1]
    return inputs


CASES = [  # (op, extra, geometry)
    ("maxpool2d_fwd", dict(return_indices=True), dict(kernel=3, stride=2, padding=1)),
    ("maxpool2d_fwd", dict(return_indices=False), dict(kernel=3, stride=2, padding=1, ceil_mode=True)),
    ("maxpool2d_fwd", dict(return_indices=True), dict(kernel=(3, 2), stride=(1, 2), padding=(1, 1), dilation=(2, 3))),
    ("maxpool2d_fwd", dict(return_indices=True), dict(kernel=2, stride=2, padding=0, ceil_mode=True)),
    ("maxpool2d_bwd", dict(indices="stored"), dict(kernel=3, stride=2, padding=1)),
    ("maxpool2d_bwd", dict(indices="stored"), dict(kernel=3, stride=1, padding=1, ceil_mode=True, dilation=2)),
    ("maxpool2d_bwd", dict(indices="recompute"), dict(kernel=3, stride=2, padding=1, ceil_mode=True)),
    ("maxpool2d_bwd", dict(indices="stored"), dict(kernel=2, stride=2, padding=1)),
    ("avgpool2d_fwd", dict(count_include_pad=True), dict(kernel=3, stride=2, padding=1, ceil_mode=True)),
    ("avgpool2d_fwd", dict(count_include_pad=False), dict(kernel=3, stride=2, padding=1, ceil_mode=True)),
    ("avgpool2d_fwd", dict(divisor_override=5), dict(kernel=(2, 3), stride=(2, 1), padding=(1, 1))),
    ("avgpool2d_bwd", dict(count_include_pad=True), dict(kernel=3, stride=2, padding=1, ceil_mode=True)),
    ("avgpool2d_bwd", dict(count_include_pad=False), dict(kernel=3, stride=1, padding=1)),
    ("avgpool2d_bwd", dict(divisor_override=3), dict(kernel=2, stride=2, padding=1, ceil_mode=True)),
]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in {**c[1], **c[2]}.items())}")
def test_kernels_match_reference(case, layout):
    name, extra, geo = case
    op = get_op(name)
    rng = np.random.default_rng()
    r = random.Random(f"{case}{layout}")
    dtype = r.choice(["fp32", "fp16", "bf16"])
    p = op.parse_problem(N=2, C=16, H=r.randint(5, 12), W=r.randint(5, 12), dtype=dtype, layout=layout, **geo, **extra)
    inputs = op.make_inputs(p, rng)
    if op.pool == "max":
        inputs = specials(p, inputs, rng)
    t = pool_emu.EMU_TARGET
    cfgs = [c for c in op.space.enumerate() if op.validate(p, c, t)]
    default = op.space.nearest_default(lambda c: bool(op.validate(p, c, t)))
    picked = [default] + r.sample(cfgs, 2)
    if op.backward:
        picked.append(r.choice([c for c in cfgs if c["algo"] == "scatter"]))
    pool_emu.prebuild([(op, p, c) for c in picked])
    for c in picked:
        check(op, p, c, inputs)


def test_scatter_variants_all_dtypes():
    """Scatter: plain stores (no overlap), fp32 atomics on dx, fp32 workspace + convert (16-bit)."""
    rng = np.random.default_rng()
    for name in ("maxpool2d_bwd", "avgpool2d_bwd"):
        op = get_op(name)
        for dtype, geo in [("bf16", dict(kernel=2, stride=2)), ("fp32", dict(kernel=3, stride=2, padding=1)),
                           ("fp16", dict(kernel=3, stride=2, padding=1))]:
            p = op.parse_problem(N=1, C=8, H=9, W=7, dtype=dtype, layout="nhwc", **geo)
            c = next(c for c in op.space.enumerate() if c["algo"] == "scatter" and op.validate(p, c, pool_emu.EMU_TARGET))
            check(op, p, c, op.make_inputs(p, rng))


def test_odd_channels_and_single_pixel():
    rng = np.random.default_rng()
    for name in ("maxpool2d_fwd", "avgpool2d_bwd"):
        op = get_op(name)
        for layout in ("nchw", "nhwc"):
            p = op.parse_problem(N=3, C=3, H=1, W=1, dtype="fp16", layout=layout, kernel=1, stride=1)
            for c in [c for c in op.space.enumerate() if op.validate(p, c, pool_emu.EMU_TARGET)][:2]:
                check(op, p, c, op.make_inputs(p, rng))


def test_emulator_catches_a_wrong_kernel():
    """The check can fail: a config run on a problem with other pooling params is wrong."""
    op = get_op("maxpool2d_fwd")
    p = op.parse_problem(N=1, C=4, H=8, W=8, dtype="fp32", layout="nchw", kernel=3, stride=2, padding=1)
    q = op.parse_problem(N=1, C=4, H=8, W=8, dtype="fp32", layout="nchw", kernel=3, stride=2, padding=0)
    c = op.space.nearest_default(lambda c: bool(op.validate(p, c, pool_emu.EMU_TARGET)))
    inputs = op.make_inputs(p, np.random.default_rng(0))
    got = pool_emu.run(op, p, c, inputs)["y"]
    want = op.reference(q, inputs)["y"]
    assert got.shape != want.shape or max_violation(got, want, 0, 0) > 1


@pytest.mark.parametrize("full", SWEEP)
def test_fast_paths_nchw_row_vectors_and_aligned_gather(full):
    """The forward's NCHW row vectors (vector core plus single-element overhang, vector and
    scalar stores), the backward's stride-aligned gather and 2-D block patches (block_rows > 1),
    on widths where the last tile is partial or the vector stores are misaligned, every dtype.
    Every problem runs a fast-path config, one with block_rows > 1 and (backward) one reading x
    rows as vectors; the quality tier runs two more fast-path configs of each."""
    rng = np.random.default_rng()
    t = pool_emu.EMU_TARGET
    geos = [dict(kernel=3, stride=2, padding=1), dict(kernel=2, stride=2), dict(kernel=3, stride=1, padding=1),
            dict(kernel=3, stride=2, padding=1, ceil_mode=True), dict(kernel=(3, 2), stride=(2, 1), padding=(1, 0))]
    n_vec = n_aligned = n_br = n_xfoot = 0
    runs = []
    for name, extra in [("maxpool2d_fwd", dict(return_indices=True)), ("maxpool2d_fwd", dict(return_indices=False)),
                        ("avgpool2d_fwd", {}), ("maxpool2d_bwd", dict(indices="stored")),
                        ("maxpool2d_bwd", dict(indices="recompute")), ("avgpool2d_bwd", dict(count_include_pad=False))]:
        op = get_op(name)
        for gi, geo in enumerate(geos):
            dtype = ["fp32", "fp16", "bf16"][gi % 3]
            for layout in ("nchw", "nhwc"):
                p = op.parse_problem(N=2, C=8, H=11, W=24, dtype=dtype, layout=layout, **geo, **extra)
                inputs = op.make_inputs(p, rng)
                if op.pool == "max":
                    inputs = specials(p, inputs, rng)
                cfgs = [c for c in op.space.enumerate() if op.validate(p, c, t)]
                if op.backward:
                    fast = [c for c in cfgs if op.aligned_gather(p, c)]
                    n_aligned += bool(fast)
                else:
                    fast = [c for c in cfgs if op.row_vec_elems(p, c) > 1 or c["tw"] >= 4]
                    n_vec += bool(fast) and layout == "nchw"
                rr = random.Random(f"{name}{geo}{layout}")
                picked = rr.sample(fast, min(3 if full else 1, len(fast)))
                picked += rr.sample([c for c in fast if c["block_rows"] > 1 and c not in picked], 1)
                xf = [c for c in fast if op.backward and op.x_footprint(p, c) and op.row_vec_elems(p, c) > 1]
                picked += rr.sample(xf, min(1, len(xf)))  # indices=None: x rows as vectors
                n_xfoot += bool(xf)
                n_br += 1
                runs += [(op, p, c, inputs) for c in picked]
    assert n_vec >= 10 and n_aligned >= 20 and n_br >= 50 and n_xfoot >= 3
    pool_emu.prebuild([(op, p, c) for op, p, c, _ in runs])
    for op, p, c, inputs in runs:
        check(op, p, c, inputs)


@pytest.mark.parametrize("name,extra", [("maxpool2d_fwd", dict(return_indices=True)),
                                        ("maxpool2d_bwd", dict(indices="recompute")),
                                        ("avgpool2d_fwd", {}), ("avgpool2d_bwd", dict(count_include_pad=False))])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_one_output_axis_with_a_small_stride(name, extra, layout):
    """A global pool written with stride 1, and one output along H only: the problem is keyed and
    compiled with the stride raised to the window (`canonical_stride`); the kernels match the
    reference, itself checked against a direct loop with the stride as given
    (tests/test_pool_reference.py)."""
    op = get_op(name)
    rng = np.random.default_rng()
    for geo in (dict(H=7, W=7, kernel=7, stride=1), dict(H=5, W=8, kernel=(5, 3), stride=(2, 1), padding=(0, 1))):
        p = op.parse_problem(N=2, C=24, dtype="fp16", layout=layout, **geo, **extra)
        assert p.OH == 1 and p.stride[0] == 5 or p.stride == (7, 7)
        inputs = op.make_inputs(p, rng)
        t = pool_emu.EMU_TARGET
        cfgs = [c for c in op.space.enumerate() if op.validate(p, c, t)]
        picked = [op.space.nearest_default(lambda c: bool(op.validate(p, c, t)))] + random.Random(name).sample(cfgs, 2)
        pool_emu.prebuild([(op, p, c) for c in picked])
        for c in picked:
            check(op, p, c, inputs)


@pytest.mark.parametrize("geo", [dict(kernel=3, stride=2, padding=1), dict(kernel=3, stride=2, padding=1, ceil_mode=True),
                                 dict(kernel=2, stride=2), dict(kernel=3, stride=1, padding=1, dilation=2),
                                 dict(kernel=(3, 2), stride=(2, 1), padding=(1, 0)), dict(kernel=5, stride=1, padding=2)],
                         ids=lambda g: "-".join(f"{k}{v}" for k, v in g.items()).replace(" ", ""))
@pytest.mark.parametrize("full", SWEEP)
def test_smem_recompute_backward(geo, full):
    """algo=smem (indices=None, NCHW): a block's outputs' argmax and dy in shared memory behind a
    barrier, then the aligned gather from there. Several blocks per plane (a block's first rows
    share covering outputs with the block above), one block per plane, partial last tiles and
    blocks, every dtype, NaN / -inf / ties. Per dtype the fast tier runs the config with the
    fewest rows per block and the one with the most; the quality tier the two with the fewest and
    three others."""
    op = get_op("maxpool2d_bwd")
    rng = np.random.default_rng()
    t = pool_emu.EMU_TARGET
    seen_rows = set()
    for dtype, (H, W) in zip(["fp32", "fp16", "bf16"], [(29, 14), (13, 24), (40, 7)]):
        p = op.parse_problem(N=2, C=3, H=H, W=W, dtype=dtype, layout="nchw", indices="recompute", **geo)
        cfgs = [c for c in op.space.enumerate() if c["algo"] == "smem" and op.validate(p, c, t)]
        assert cfgs, p.key()
        r = random.Random(f"{geo}{dtype}")
        # the fewest rows per block (most blocks per plane, most shared covering outputs) and a few others
        by_rows = sorted(cfgs, key=lambda c: (op.smem_rows(p, c), c["threads"]))
        picked = by_rows[:2] + r.sample(cfgs, min(3, len(cfgs))) if full else [by_rows[0], by_rows[-1]]
        inputs = specials(p, op.make_inputs(p, rng), rng)
        pool_emu.prebuild([(op, p, c) for c in picked])
        for c in picked:
            seen_rows.add(op.smem_rows(p, c) < p.H)
            check(op, p, c, inputs)
    assert seen_rows == {True, False}  # both several blocks per plane and one


def test_smem_is_checked_by_the_emulator():
    """The barrier emulation can fail: an smem kernel run on a problem with another padding is wrong."""
    op = get_op("maxpool2d_bwd")
    t = pool_emu.EMU_TARGET
    p = op.parse_problem(N=1, C=2, H=12, W=12, dtype="fp32", layout="nchw", kernel=3, stride=2, padding=1, indices="recompute")
    q = op.parse_problem(N=1, C=2, H=12, W=12, dtype="fp32", layout="nchw", kernel=3, stride=2, padding=0, indices="recompute")
    c = next(c for c in op.space.enumerate() if c["algo"] == "smem" and op.validate(p, c, t) and op.validate(q, c, t))
    inputs = op.make_inputs(p, np.random.default_rng(0))
    got = pool_emu.run(op, p, c, inputs)["dx"]
    want = op.reference(q, op.make_inputs(q, np.random.default_rng(0)))["dx"]
    assert max_violation(got, want, 0, 0) > 1


def test_a_batch_built_emulator_is_the_one_built_alone(tmp_path, monkeypatch):
    """`prebuild` puts several emulators (of different ops: different macros and helpers) in one
    library, each in a namespace of its own; each runs exactly as it does built alone."""
    rng = np.random.default_rng(3)
    t = pool_emu.EMU_TARGET
    jobs = []
    for name, extra in [("maxpool2d_fwd", dict(return_indices=True)), ("avgpool2d_bwd", {}),
                        ("maxpool2d_bwd", dict(indices="recompute"))]:
        op = get_op(name)
        p = op.parse_problem(N=1, C=8, H=9, W=10, dtype="bf16", layout="nchw", kernel=3, stride=2, padding=1, **extra)
        cfgs = [c for c in op.space.enumerate() if op.validate(p, c, t)]
        jobs += [(op, p, c) for c in random.Random(name).sample(cfgs, 2)]
    monkeypatch.setattr(pool_emu.tempfile, "gettempdir", lambda: str(tmp_path))  # nothing built before
    monkeypatch.setattr(pool_emu, "_cache", {})
    pool_emu.prebuild(jobs)
    assert len({id(pool_emu._cache[pool_emu._source(*j)[0]]) for j in jobs}) == 1, "one library for all"
    for op, p, c in jobs:
        inputs = op.make_inputs(p, rng)
        batched = pool_emu.run(op, p, c, inputs)
        digest, body, _ = pool_emu._source(op, p, c)
        pool_emu._compile(tmp_path / "ckgen-pool-emu" / f"alone-{digest}.so", body)
        pool_emu._cache[digest] = pool_emu.ctypes.CDLL(str(tmp_path / "ckgen-pool-emu" / f"alone-{digest}.so"))
        alone = pool_emu.run(op, p, c, inputs)
        for k in batched:
            np.testing.assert_array_equal(batched[k], alone[k], err_msg=f"{op.name} {k}")
