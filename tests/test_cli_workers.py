"""The command line of multi-worker tuning without a GPU: `ckgen tune OP --workers 2` on the default
SQLite storage (workers replay tests/wtimes.py's timings: the backend is swapped in, nothing else),
`--grid`, `ckgen db pull` and `ckgen db merge` round trips."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import wtimes
from ckgen.runtime import db as dbmod
from ckgen.runtime import target as target_mod
from ckgen.tuner import workers as wk
from ckgen.tuner.replay import ReplayBackend, ReplayEvaluator
from ckgen.tuner.tune import Tuner, TuneRequest

OP = wtimes.OP


@pytest.fixture
def replayed(monkeypatch, tmp_path):
    """`ckgen tune --workers` with replayed timings: no GPU check, no devices to pin."""
    logs = tmp_path / "logs"
    logs.mkdir()
    backend = ReplayBackend(wtimes.time_of, wtimes.restrict_to, delay=0.02, log_dir=str(logs))
    monkeypatch.setattr(target_mod, "gpu_status", lambda: None)
    monkeypatch.setattr(wk, "visible_devices", lambda: [])
    monkeypatch.setattr(wk, "backend_factory", lambda: backend)
    return backend


def test_tune_with_two_workers_on_sqlite(inproc, replayed, tmp_path):
    db = tmp_path / "tuned.yaml"
    storage = f"sqlite:///{tmp_path / 'studies.sqlite3'}"
    args = ["tune", OP.name, "--workers", "2", "--trials", "4", "--layout", "nhwc", "--db", str(db),
            "--storage", storage]
    code, out, err = inproc(*args, "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    problems = [p.key() for p in OP.default_problems(layouts=["nhwc"])]
    rows = doc["results"]
    assert sorted(r["problem"] for r in rows) == sorted(problems) and doc["workers"] == 2 and doc["died"] == []
    assert all(r["failed_trials"] <= 4 and r["time_us"] > 0 for r in rows)
    entries = dbmod.InstanceDB.load(db).entries
    assert {e.problem: e.instance for e in entries} == {r["problem"]: r["instance"] for r in rows}
    calls = [json.loads(line) for f in Path(replayed.log_dir).glob("*.jsonl") for line in f.read_text().splitlines()]
    assert len(calls) == 4 * len(problems) == len({(c["problem"], c["config"]) for c in calls})
    assert len({c["pid"] for c in calls}) == 2
    # tsv and the table keep working; the finished run is not joined again: a new run, 4 more trials
    code, out, err = inproc(*args, "--format", "tsv")
    assert code == 0, err
    assert out.splitlines()[0].split("\t")[:2] == ["problem", "instance"] and len(out.splitlines()) == 1 + len(problems)
    code, out, err = inproc(*args, "--format", "table")
    assert code == 0 and "best instance" in out
    # not a terminal: no bars, one line per finished problem, naming the worker that finished it
    done = [ln for ln in out.splitlines() if ln.startswith("[") and ": worker " in ln]
    assert sorted(ln.split("] ", 1)[1].split(": worker ")[0] for ln in done) == sorted(problems)
    # db pull rebuilds the same winners from the storage; merge round trips
    pulled = tmp_path / "pulled.yaml"
    code, out, err = inproc("db", "pull", "--storage", storage, "--db", str(pulled), "--format", "json")
    assert code == 0, err
    got = {e.problem: e for e in dbmod.InstanceDB.load(pulled).entries}
    assert {k: e.config for k, e in got.items()} == {e.problem: e.config for e in dbmod.InstanceDB.load(db).entries}
    assert all(e.provenance_dict()["host"] and e.device == "replayed GPU" for e in got.values())
    merged = tmp_path / "merged.yaml"
    assert inproc("db", "merge", str(db), str(pulled), "-o", str(merged))[0] == 0
    again = tmp_path / "again.yaml"
    assert inproc("db", "merge", str(pulled), str(db), "-o", str(again))[0] == 0
    assert merged.read_bytes() == again.read_bytes()  # deterministic, whatever the order


def test_db_pull_takes_the_best_verified_trial_of_a_plain_study(inproc, tmp_path):
    """A study of a plain search (no run, no final round): its best complete trial, re-rendered."""
    storage = f"sqlite:///{tmp_path / 's.sqlite3'}"
    key = wtimes.KEYS[1]
    problem = OP.problem_from_key(key)
    ev = ReplayEvaluator(lambda c: wtimes.time_of(key, c))
    Tuner(TuneRequest(OP, problem, wtimes.SM90, trials=6, storage=storage, restrict=lambda c: wtimes.restrict_to(key, c),
                      device="Some GPU", model=None), ev).search()
    out_db = tmp_path / "pulled.yaml"
    code, out, err = inproc("db", "pull", "--storage", storage, "--db", str(out_db), "--format", "json")
    assert code == 0, err
    (entry,) = dbmod.InstanceDB.load(out_db).entries
    best = min((m for m in ev.measured.values()), key=lambda m: m.timing.median_us)
    assert entry.config == best.config.items and entry.time_us == round(best.timing.median_us, 3)
    assert entry.device == "Some GPU" and entry.provenance_dict()["trials"] == 6
    assert dbmod.entry_verified(entry)  # instance and source hash rendered from today's templates


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_db_pull_fails_stale_running_trials_and_says_which_studies_have_none(inproc, tmp_path, monkeypatch):
    """A tune cut short (Ctrl-C of a worker run, a crash) left RUNNING trials, and `db pull`
    skipped the study ("trials still running") until the same tune ran again. Trials whose
    heartbeats went stale are failed (optuna's fail_stale_trials) and the study is pulled; a
    study with a live trial is still skipped, and one without trials says so."""
    import time

    import optuna

    from ckgen.tuner import tune
    from ckgen.tuner.tune import open_storage, study_name

    monkeypatch.setattr(tune, "GRACE_S", 2)
    monkeypatch.setattr(tune, "HEARTBEAT_S", 0.3)
    storage = f"sqlite:///{tmp_path / 's.sqlite3'}"
    k_cut, k_live, k_empty = wtimes.KEYS[:3]
    names = {k: study_name(OP, OP.problem_from_key(k), wtimes.SM90, "Some GPU") for k in (k_cut, k_live, k_empty)}
    for key in (k_cut, k_live):
        Tuner(TuneRequest(OP, OP.problem_from_key(key), wtimes.SM90, trials=3, storage=storage, device="Some GPU",
                          restrict=lambda c, key=key: wtimes.restrict_to(key, c), model=None),
              ReplayEvaluator(lambda c, key=key: wtimes.time_of(key, c))).search()
    optuna.create_study(study_name=names[k_empty], storage=storage)
    st = open_storage(storage)
    cut = optuna.load_study(study_name=names[k_cut], storage=st).ask()  # asked for, beaten once, its tuner gone
    st.record_heartbeat(cut._trial_id)
    time.sleep(3.5)  # past the grace period (SQLite keeps whole seconds)
    live = optuna.load_study(study_name=names[k_live], storage=st).ask()  # a tuner still at work
    out_db = tmp_path / "pulled.yaml"
    with tune.Heartbeat(st.record_heartbeat) as beat:
        beat.add(live._trial_id)
        code, out, err = inproc("db", "pull", "--storage", storage, "--db", str(out_db), "--format", "json")
    assert code == 0, err
    assert [e.problem for e in dbmod.InstanceDB.load(out_db).entries] == [OP.problem_from_key(k_cut).key()]
    skipped = dict(s.split(": ", 1) for s in json.loads(out)["skipped"])
    assert "still running" in skipped[names[k_live]] and skipped[names[k_empty]] == "no trials yet", skipped
    states = [t.state for t in optuna.load_study(study_name=names[k_cut], storage=storage).trials]
    assert optuna.trial.TrialState.RUNNING not in states


def _entry(problem: str, time_us: float, date: str, sha: str | None = None) -> dbmod.Entry:
    from ckgen.instance import render_instance

    p = OP.problem_from_key(problem)
    cfg = OP.space.nearest_default(lambda c: bool(OP.validate(p, c, wtimes.SM90)))
    src = render_instance(OP, p, cfg, wtimes.SM90)
    return dbmod.Entry(op=OP.name, vendor="cuda", arch="sm_90", device="GPU", problem=p.key(), config=cfg.items,
                       instance=src.name, source_sha256=sha or src.sha256, time_us=time_us, gbps=1.0,
                       default_time_us=time_us, provenance=(("date", date),))


def test_db_merge_faster_verified_wins_ties_by_date(inproc, tmp_path):
    k0, k1, k2, k3 = wtimes.KEYS[:4]
    a = [_entry(k0, 10.0, "2026-01-01T00:00:00+00:00"), _entry(k1, 20.0, "2026-01-01T00:00:00+00:00"),
         _entry(k2, 5.0, "2026-01-01T00:00:00+00:00", sha="0" * 64), _entry(k3, 7.0, "2026-01-01T00:00:00+00:00")]
    b = [_entry(k0, 11.0, "2026-06-01T00:00:00+00:00"), _entry(k1, 20.0, "2026-06-01T00:00:00+00:00"),
         _entry(k2, 9.0, "2025-01-01T00:00:00+00:00")]
    fa, fb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    dbmod.write_db(fa, a)
    dbmod.write_db(fb, b)
    out1, out2 = tmp_path / "ab.yaml", tmp_path / "ba.yaml"
    code, out, err = inproc("db", "merge", str(fa), str(fb), "-o", str(out1))
    assert code == 0 and "wrote 4 entries" in out, err
    assert inproc("db", "merge", str(fb), str(fa), "-o", str(out2))[0] == 0
    assert out1.read_bytes() == out2.read_bytes()
    got = {e.problem: e for e in dbmod.InstanceDB.load(out1).entries}
    assert got[k0].time_us == 10.0  # the faster
    assert got[k1].date.startswith("2026-06")  # a tie: the later
    assert got[k2].time_us == 9.0  # a stale entry (its source no longer renders) loses to a verified one
    assert got[k3].time_us == 7.0  # only in one
    assert inproc("db", "merge", str(fa), str(tmp_path / "missing.yaml"), "-o", str(out1))[0] == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema: 1\nentries:\n  - op: [unclosed\n")
    assert inproc("db", "merge", str(fa), str(bad), "-o", str(out1))[0] == 2


def test_grid_and_workers_options_are_checked(inproc):
    code, _, err = inproc("tune", "maxpool2d_fwd", "--grid", "nope")
    assert code == 2 and "--grid: maxpool2d_fwd has no grid 'nope'; its grids: default, resnet, vgg" in err
    code, _, err = inproc("tune", "maxpool2d_fwd", "--workers", "0")
    assert code == 2 and "--workers" in err
    code, _, err = inproc("tune", "maxpool2d_fwd", "--workers", "two")
    assert code == 2 and "'auto'" in err
    code, _, err = inproc("db", "pull", "--storage", "bogus://x")
    assert code == 2 and "--storage" in err


def test_grids_are_problem_lists_of_the_spaces():
    for op in (OP, wk.get_op("groupnorm_fwd")):
        assert op.grid_problems("default") == op.default_problems()
        broad = op.grid_problems("broad")
        assert {p.dtype for p in broad} == {"bf16", "fp16", "fp32"} and len(broad) > len(op.default_problems())
        assert op.grid_problems("broad", ["bf16"], ["nhwc"], None) == [p for p in broad if p.dtype == "bf16"
                                                                         and p.layout == "nhwc"]


def test_db_pull_skips_what_one_study_gets_wrong_and_pulls_the_others(inproc, tmp_path):
    """Issue 53: a best trial with a non-finite spread aborted the whole pull; final results with
    dates of mixed types ended in a traceback; a final result for another op was pulled as it
    was. Each is now that study's matter: the others are pulled."""
    import optuna
    from optuna.trial import create_trial

    from ckgen.tuner.tune import study_name
    from ckgen.types import Config

    storage = f"sqlite:///{tmp_path / 's.sqlite3'}"
    keys = wtimes.KEYS[:3]
    names = {k: study_name(OP, OP.problem_from_key(k), wtimes.SM90, "Some GPU") for k in keys}
    studies = {}
    for key, name in names.items():  # studies as a plain search leaves them: complete trials of valid configs
        studies[key] = optuna.create_study(study_name=name, storage=storage)
        for cfg in sorted(wtimes.subset(key), key=Config.key)[:3]:
            studies[key].add_trial(create_trial(
                params=cfg.as_dict(), value=wtimes.time_of(key, cfg) or 500.0,
                distributions={k: optuna.distributions.CategoricalDistribution(vs) for k, vs in OP.space.params.items()}))
    clean = tmp_path / "clean.yaml"
    assert inproc("db", "pull", "--storage", storage, "--db", str(clean))[0] == 0
    pulled = {e.problem: e for e in dbmod.InstanceDB.load(clean).entries}
    # 1: a faster trial of the best config with a spread of inf
    best = studies[keys[0]].best_trial
    studies[keys[0]].add_trial(create_trial(params=best.params, distributions=best.distributions, value=best.value / 2,
                                            user_attrs={"spread": float("inf")}))
    # 2: two final results, dated by an ISO string and by a number
    later = dbmod.Entry(**{**pulled[keys[1]].__dict__, "time_us": 1.25})
    studies[keys[1]].set_user_attr("ckgen:r1:result", {"entry": later.to_dict(), "date": "2030-01-01T00:00:00+00:00"})
    studies[keys[1]].set_user_attr("ckgen:r2:result", {"entry": pulled[keys[1]].to_dict(), "date": 5})
    # 3: a final result that is an entry of another op
    gn = get_gn_entry()
    studies[keys[2]].set_user_attr("ckgen:r1:result", {"entry": gn.to_dict(), "date": "2030-01-01T00:00:00+00:00"})
    out_db = tmp_path / "pulled.yaml"
    code, out, err = inproc("db", "pull", "--storage", storage, "--db", str(out_db), "--format", "json")
    assert code == 0, err
    got = {e.problem: e for e in dbmod.InstanceDB.load(out_db).entries}
    assert set(got) == set(keys) and all(e.op == OP.name for e in got.values())
    assert got[keys[0]].time_us == round(best.value / 2, 3) and got[keys[0]].spread is None
    assert got[keys[1]].time_us == 1.25
    assert got[keys[2]].config == pulled[keys[2]].config  # its best trial, not the other op's entry
    skipped = json.loads(out)["skipped"]
    assert len(skipped) == 1 and skipped[0].startswith(names[keys[2]]) and "not for this study's problem" in skipped[0]
    assert f"skipped {names[keys[2]]}: " in err


def get_gn_entry() -> dbmod.Entry:
    from ckgen.ops import get_op

    gn = get_op("groupnorm_fwd")
    p = gn.parse_problem(N=2, C=320, H=8, W=8, G=32, dtype="bf16", layout="nhwc")
    return dbmod.Entry(op=gn.name, vendor="cuda", arch="sm_90", device="Some GPU", problem=p.key(),
                       config=gn.space.default.items, instance="ckgen_groupnorm_fwd_x", source_sha256="ab" * 32,
                       time_us=0.5, gbps=1.0, default_time_us=1.0)
