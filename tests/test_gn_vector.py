"""The GroupNorm ops' array forms (ckgen/ops/gn_vector.py) equal their scalar forms exactly:
`shape_check_many` vs `shape_check`, `geometry_columns` vs launches / registers / workspace /
`chain_steps`, and `model.geometry_many` vs `model.geometry`, on random problems and
configs of every GroupNorm op on sm_90, sm_80 and gfx942 (CPU tier)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from ckgen import model as cm
from ckgen.model import features, lattice
from ckgen.ops import all_ops, get_op
from ckgen.ops.spec import Target
from ckgen.types import Config

TARGETS = [Target.named(a) for a in ("sm_90", "sm_80", "gfx942")]
GN_OPS = [op.name for op in all_ops() if op.name.startswith("groupnorm")]


def _problems(op, rng: random.Random, count: int):
    out = []
    while len(out) < count:
        G = rng.choice([1, 2, 4, 8, 16, 32])
        out.append(op.parse_problem(N=rng.choice([1, 2, 3, 8, 16, 64]),
                                    C=G * rng.choice([1, 2, 3, 8, 40, 96, 640, 1024, 4096]),
                                    H=rng.choice([1, 2, 7, rng.randint(1, 90), 128, 512]),
                                    W=rng.choice([1, 3, 8, rng.randint(1, 90), 256, 1024]), G=G,
                                    dtype=rng.choice(["fp32", "fp16", "bf16"]), layout=rng.choice(["nchw", "nhwc"]),
                                    activation=rng.choice(["none", "swish"])))
    return out


def _admitted(op, p, target, rng: random.Random, n: int):
    """Up to `n` random points of the space that the class check admits for p (as the walk asks
    the shape check), their codes and the lattice."""
    lat = lattice._lattice(op.space)
    codes = np.unique(np.array([rng.randrange(lat.size) for _ in range(4 * n)], dtype=np.int64))
    codes = lattice._class_filter(op, p, target, lat)(lat.space_points(codes))[:n]
    return lat, codes, [lat.config(c) for c in codes.tolist()]


@pytest.mark.parametrize("name", GN_OPS)
def test_shape_check_many_equals_shape_check(name):
    op = get_op(name)
    rng = random.Random(name)
    for p in _problems(op, rng, 40):
        for target in TARGETS:
            lat, codes, configs = _admitted(op, p, target, rng, 400)
            many = op.shape_check_many(p, lat.columns(codes), target)
            assert many.tolist() == [bool(op.shape_check(p, c, target)) for c in configs], (p.key(), target.arch)


@pytest.mark.parametrize("name", GN_OPS)
def test_geometry_columns_equal_the_scalar_forms(name):
    op = get_op(name)
    rng = random.Random(name + "geo")
    for p in _problems(op, rng, 40):
        for target in TARGETS:
            lat, codes, configs = _admitted(op, p, target, rng, 300)
            for narrow in (True, False):
                cols = op.geometry_columns(p, lat.columns(codes), target, narrow)
                for i, c in enumerate(configs):
                    launches = op.launches(p, c, target)
                    main = features._main_launch(op, p, c, launches)
                    want = {"launches": len(launches), "blocks": main.grid[0] * main.grid[1] * main.grid[2],
                            "threads": main.block[0] * main.block[1] * main.block[2],
                            "regs": features._regs(op, p, c), "ws": op.workspace_bytes(p, c),
                            "steps": cm.chain_steps(op, p, c, narrow)}
                    got = {k: int(np.broadcast_to(cols[k], len(configs))[i]) for k in want}
                    assert got == want, (p.key(), target.arch, c.key())


@pytest.mark.parametrize("name", GN_OPS)
def test_geometry_many_equals_geometry(name):
    """The cost model's batch (the array path for GroupNorm) against `geometry` config by config,
    valid candidates and configs validate refuses alike, float for float."""
    op = get_op(name)
    rng = random.Random(name + "many")
    for p in _problems(op, rng, 25):
        for target in TARGETS:
            _, _, configs = _admitted(op, p, target, rng, 200)
            configs = configs + [op.space.default]
            for narrow in (None, False):
                many = cm.geometry_many(op, p, configs, target, narrow_rows=narrow)
                assert many == [cm.geometry(op, p, c, target, narrow_rows=narrow) for c in configs], \
                    (p.key(), target.arch)


def test_geometry_many_off_the_lattice_falls_back():
    """A config whose values are of another kind (a float) takes the per-config path, same answer."""
    op = get_op("groupnorm_fwd")
    p = op.parse_problem(N=2, C=64, H=9, W=9, G=4, dtype="fp16", layout="nchw")
    t = TARGETS[0]
    c = Config.of(dict(op.space.default.as_dict(), vec_bytes=8.0))
    assert cm.geometry_many(op, p, [c, op.space.default], t) == \
        [cm.geometry(op, p, c, t), cm.geometry(op, p, op.space.default, t)]


@pytest.mark.parametrize("name", GN_OPS)
def test_walk_with_shape_check_many_equals_the_walk_without(name):
    """`candidate_tiers` with the dispatcher's `admitted.many` (whole chunks on knob arrays) returns
    the candidates and the near tier the per-config `admitted` does."""
    op = get_op(name)
    rng = random.Random(name + "walk")
    model = cm.load()
    winners = model.winner_configs(op) if model is not None else []
    for p in _problems(op, rng, 6):
        for target in TARGETS:
            for max_vec in (16, 8):
                def usable(c, p=p, target=target, max_vec=max_vec):
                    return c["vec_bytes"] <= max_vec and bool(op.validate(p, c, target))

                def admitted(c, p=p, target=target, max_vec=max_vec):
                    return c["vec_bytes"] <= max_vec and bool(op.shape_check(p, c, target))

                plain = cm.candidate_tiers(op, p, target, winners, usable, admitted=admitted)
                admitted.many = lambda k, p=p, target=target, max_vec=max_vec: (
                    op.shape_check_many(p, k, target) & (k["vec_bytes"] <= max_vec))
                assert cm.candidate_tiers(op, p, target, winners, usable, admitted=admitted) == plain, \
                    (p.key(), target.arch, max_vec)


@pytest.mark.parametrize("name", [op.name for op in all_ops()])
def test_space_holds_many_equals_first_failing(name):
    """The space's constraints on knob arrays (`_CompiledSpace.holds_many`, which the lattice's
    `space_points` asks) agree with the compiled scalar check on random points of the product."""
    op = get_op(name)
    compiled = op.space._memo["compiled"]
    lat = lattice._lattice(op.space)
    rng = random.Random(name + "space")
    codes = np.unique(np.array([rng.randrange(lat.size) for _ in range(30000)], dtype=np.int64))
    cols = lat.columns(codes)
    many = compiled.holds_many(cols)
    assert many is not None
    assert many.tolist() == [compiled.first_failing(*[cols[n][i].item() for n in compiled.names]) < 0
                             for i in range(len(codes))]
