"""`ckgen retune` without a GPU: which problems it re-tunes and from which arch's winner; the
warm start is measured first; the CLI's no-GPU answer."""
from __future__ import annotations

import pytest

from ckgen import cli
from ckgen.runtime import db as dbmod
from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.ops.spec import Config, Target
from ckgen.tuner.tune import Tuner, TuneRequest, retune_plan
from test_tune_search import PROBLEM, Replay, synthetic

OP = get_op("groupnorm_fwd")


def entry(problem, arch, config=None):
    t = Target.named(arch)
    config = config or next(c for c in OP.space.enumerate() if OP.validate(problem, c, t))
    src = render_instance(OP, problem, config, t)
    return dbmod.Entry(op=OP.name, vendor=t.vendor, arch=arch, device="test", problem=problem.key(),
                       config=config.items, instance=src.name, source_sha256=src.sha256, time_us=1.0,
                       gbps=1.0, default_time_us=1.0, provenance=(("date", "2026-11-22T00:00:00+00:00"),))


def prob(n):
    return OP.parse_problem(N=n, C=64, H=16, W=16, G=8, dtype="fp16", layout="nchw")


def test_plan_covers_problems_not_tuned_here_from_the_nearest_arch():
    db = dbmod.InstanceDB(entries=(entry(prob(1), "sm_80"), entry(prob(2), "sm_80"), entry(prob(2), "sm_90"),
                                   entry(prob(3), "gfx942"), entry(prob(4), "sm_80"), entry(prob(4), "gfx942")))
    db = dbmod.InstanceDB.layered(db)
    plan = {i.problem: i for i in retune_plan(db, "sm_90")}
    assert set(plan) == {prob(1).key(), prob(3).key(), prob(4).key()}  # prob 2 is tuned on sm_90
    assert plan[prob(4).key()].from_arch == "sm_80"  # same vendor beats another vendor
    assert plan[prob(3).key()].from_arch == "gfx942"
    assert plan[prob(1).key()].config == Config.of(db.lookup(OP.name, "sm_80", prob(1).key()).config_dict())
    only = retune_plan(db, "sm_90", from_arch="gfx942")
    assert sorted(i.problem for i in only) == sorted([prob(3).key(), prob(4).key()])
    assert {i.from_arch for i in only} == {"gfx942"}
    assert retune_plan(db, "sm_90", ops=["other_op"]) == []


def test_warm_start_is_measured_first():
    t = Target.named("sm_90")
    warm = [c for c in OP.space.enumerate() if OP.validate(PROBLEM, c, t)][123]
    ev = Replay(synthetic)
    Tuner(TuneRequest(OP, PROBLEM, t, trials=6, warm=(warm,), model=None), ev).search()
    assert ev.calls[0] == warm


def test_cli_retune_without_gpu(capsys):
    from ckgen.runtime.target import gpu_status

    if gpu_status() is None:
        pytest.skip("a GPU is present")
    assert cli.main(["retune"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no usable GPU" in err and len(err.splitlines()) == 1
