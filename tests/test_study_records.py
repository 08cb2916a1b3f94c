"""tools/study_records.py: tuning records recovered from an optuna study storage."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna

from ckgen.model import records
from ckgen.ops import get_op
from ckgen.ops.spec import Target
from ckgen.tuner.sampler import FAILURE_ATTR

ROOT = Path(__file__).resolve().parents[1]


def test_study_trials_become_records(tmp_path):
    op = get_op("groupnorm_fwd")
    p = op.problem_from_key("N=2,C=64,H=8,W=8,G=8,dtype=fp16,layout=nhwc,act=none")
    have = op.problem_from_key("N=4,C=64,H=8,W=8,G=8,dtype=fp16,layout=nhwc,act=none")
    cfg = op.space.default.as_dict()
    storage = f"sqlite:///{tmp_path / 's.sqlite3'}"
    for prob, value in ((p, 12.5), (have, 3.0)):
        study = optuna.create_study(study_name=f"groupnorm_fwd|sm_90|Fake GPU|{prob.key()}|0123456789ab",
                                    storage=storage)
        dists = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in cfg.items()}
        study.add_trial(optuna.trial.create_trial(params=cfg, distributions=dists, value=value))
        study.add_trial(optuna.trial.create_trial(params=cfg, distributions=dists, state=optuna.trial.TrialState.FAIL,
                                                  user_attrs={FAILURE_ATTR: "wrong result: y off"}))
    optuna.create_study(study_name="a run study of workers.py", storage=storage)  # not a problem's: skipped
    known = tmp_path / "known.records.jsonl"
    records.append(known, [records.make_record(op, have, Target.named("sm_90"),
                                               "Fake GPU", op.space.default, ok=True, time_us=3.0)])
    out = tmp_path / "out.records.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "study_records.py"), storage, "--have", str(known),
                        "-o", str(out)], capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    got = records.read(out)
    assert {g["problem"] for g in got} == {p.key()}  # the problem the records file had is left out
    ok = [g for g in got if g["ok"]]
    bad = [g for g in got if not g["ok"]]
    assert len(ok) == 1 and ok[0]["time_us"] == 12.5 and ok[0]["config"] == json.loads(json.dumps(cfg))
    assert ok[0]["device"] == "Fake GPU" and ok[0]["arch"] == "sm_90" and ok[0]["phase"] == "trial"
    assert len(bad) == 1 and bad[0]["reason"] == "wrong result: y off"
