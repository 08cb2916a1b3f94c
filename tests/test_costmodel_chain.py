"""The cost model's chain term (`costmodel.chain_steps`): the serial load round trips of one
block, counted in closed form, checked against a literal walk of the NCHW GroupNorm backward's
streaming sums and dx pass as templates/groupnorm_bwd.cu.j2 runs them (every block of the grid,
every round, every row), under both row rules (narrow since 2026-11-27, wide before). CPU only."""
from __future__ import annotations

import random

import pytest

import ckgen
from ckgen import model as cm
from ckgen.model import records
from ckgen.runtime.db import InstanceDB
from ckgen.ops import get_op
from ckgen.ops.spec import DTYPES, Config, Target

SM90 = Target.named("sm_90")


def walked_steps(op, p, c, narrow: bool) -> int:
    """The template's loops, block by block: a round's rows sync at its reduction, so a round
    costs its longest row's steps; the dx pass walks the share threads x ITEMS vectors a step."""
    d = c.as_dict()
    vec = d["vec_bytes"] // DTYPES[p.dtype]["itemsize"]
    block, items, split = d["threads"], d["items"], d["split"]
    hv = p.H * p.W // vec
    nvec = p.C // p.G * hv
    chunk = -(-nvec // split)
    if narrow:
        cc = block if hv >= block * items else next(1 << j for j in range(20) if (1 << j) * items >= hv)
    else:
        cc = block if hv >= block else next(1 << j for j in range(20) if (1 << j) >= hv)
    rr_n = block // cc
    worst = 0
    for rank in range(split):
        v0, vend = rank * chunk, min(nvec, rank * chunk + chunk)
        if vend <= v0:
            continue
        cl0, cl1 = v0 // hv, (vend - 1) // hv
        total = 0
        for t in range((cl1 - cl0 + rr_n) // rr_n):
            longest = 0
            for rr in range(rr_n):
                ch = cl0 + t * rr_n + rr
                if ch <= cl1:
                    a, b = max(ch * hv, v0), min((ch + 1) * hv, vend)
                    longest = max(longest, len(range(a, b, cc * items)))
            total += longest
        if op.want_dx:
            total += len(range(v0, vend, block * items))
        worst = max(worst, total)
    return worst


def _cases(seed: int, count: int):
    rng = random.Random(seed)
    for name in ("groupnorm_bwd", "groupnorm_bwd_gamma_beta"):
        op = get_op(name)
        configs = list(op.space.enumerate())
        for _ in range(count):
            C = rng.choice([32, 48, 64, 128, 320, 512])
            G = rng.choice([g for g in (1, 8, 16, 32) if C % g == 0])
            p = op.parse_problem(N=rng.choice([1, 2, 8]), C=C, H=rng.choice([7, 14, 17, 33, 56]),
                                 W=rng.choice([7, 11, 17, 32, 64]), G=G, dtype=rng.choice(["fp32", "bf16"]),
                                 layout="nchw")
            for c in rng.sample(configs, 12):
                if op.validate(p, c, SM90) and op.scheme(c) != "single_pass":
                    yield op, p, c


def test_chain_steps_match_the_templates_walk_where_shares_are_whole_channels_and_never_undercount():
    exact = straddle = 0
    for op, p, c in _cases(1, 80):  # 80: the grid-barrier configs (2026-11-28) grew the space
        vec = c["vec_bytes"] // DTYPES[p.dtype]["itemsize"]
        hv = p.H * p.W // vec
        share = -(-(p.C // p.G * hv) // c["split"])
        for narrow in (True, False):
            got, walked = cm.chain_steps(op, p, c, narrow), walked_steps(op, p, c, narrow)
            if share % hv == 0:  # every block's share is whole channels: the closed form is exact
                assert got == walked, (p, c.as_dict(), narrow)
                exact += 1
            else:  # a share that straddles channels: an upper bound (each piece counted whole)
                assert walked <= got <= 2 * walked, (p, c.as_dict(), narrow)
                straddle += 1
    assert exact > 100 and straddle > 20  # both kinds were checked


def test_narrow_rows_shorten_the_held_out_problems_chain():
    """GroupNorm bwd 2x48x33x17 G=1 NCHW bf16, fused s4 t512 v2 i8 (the held-out pick): H*W = 561
    vectors per channel, 12 channels per block. Narrow rows: 128 threads a row (128 x 8 >= 561),
    4 channels a round, 3 rounds of one step, and 2 dx steps (6,732 vectors / 4,096): 5. Wide
    rows: one channel a round (a row of 512 threads), 12 rounds, and the same 2 dx steps: 14."""
    op = get_op("groupnorm_bwd")
    p = op.problem_from_key("N=2,C=48,H=33,W=17,G=1,dtype=bf16,layout=nchw,act=none")
    c = Config.of({"groups_per_block": 1, "items": 8, "min_blocks": 1, "scheme": "fused",
                   "split": 4, "threads": 512, "vec_bytes": 2})
    assert op.validate(p, c, SM90)
    assert cm.chain_steps(op, p, c, True) == 5 == walked_steps(op, p, c, True)
    assert cm.chain_steps(op, p, c, False) == 14 == walked_steps(op, p, c, False)
    chain = cm.TERM_NAMES.index("chain")
    new = cm.geometry(op, p, c, SM90, narrow_rows=True).phi[chain]
    old = cm.geometry(op, p, c, SM90, narrow_rows=False).phi[chain]
    assert 0 < new < old


def test_chain_term_is_zero_for_pooling_and_held_or_one_step_groupnorm():
    chain = cm.TERM_NAMES.index("chain")
    op = get_op("maxpool2d_fwd")
    p = op.problem_from_key("N=8,C=64,H=56,W=56,k=3x3,s=2x2,p=1x1,d=1x1,ceil=0,dtype=bf16,layout=nchw,idx=0")
    c = op.space.default
    assert cm.chain_steps(op, p, c) == 0
    assert cm.geometry(op, p, c, SM90).phi[chain] == 0.0
    fwd = get_op("groupnorm_fwd")
    q = fwd.problem_from_key("N=2,C=320,H=32,W=32,G=32,dtype=bf16,layout=nchw,act=none")
    held = next(c for c in fwd.space.enumerate() if c["slice_in"] == "regs" and fwd.validate(q, c, SM90))
    assert cm.chain_steps(fwd, q, held) == 1
    reload = next(c for c in fwd.space.enumerate() if c["slice_in"] == "reload" and fwd.validate(q, c, SM90))
    assert cm.chain_steps(fwd, q, reload) >= 2  # the sums, then y: two streaming passes


def test_retimed_winners_carry_their_retiming_date():
    """A re-timed shipped entry's winner record is dated when it was re-timed (its time was measured
    then, with the templates of that day: what the fit's row rule keys on)."""
    from pathlib import Path

    db = InstanceDB.load(Path(ckgen.__file__).parent / "data" / "instances.yaml")
    retimed = {(e.op, e.problem): e.provenance_dict()["retimed"] for e in db.entries
               if isinstance(e.provenance_dict().get("retimed"), str)}
    if not retimed:
        pytest.skip("no re-timed entry in the shipped DB")
    seen = 0
    for r in records.read(records.packaged_records_path()):
        if r["phase"] == "winner" and (r["op"], r["problem"]) in retimed:
            assert r["date"] == retimed[(r["op"], r["problem"])], (r["op"], r["problem"])
            seen += 1
    assert seen == len(retimed)
