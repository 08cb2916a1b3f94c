"""`ckgen tune --workers` (ckgen/tuner/workers.py) without a GPU: worker processes replay synthetic
timings (ckgen.tuner.replay.ReplayBackend, tests/wtimes.py) against a real PostgreSQL server started
here (tests/pgserver.py: initdb + pg_ctl in a temp dir, on a free port) and against SQLite.

Asserted: every problem gets its budget (trials of the run, for the whole run, not per worker),
no config is measured twice, the winners equal a single worker's, a worker killed with SIGKILL
mid-run loses its running trials only, the CLI's SQLite path with 2 workers, `db pull` and
`db merge` round trips. Without PostgreSQL binaries the PostgreSQL tests skip with the reason,
except where CKGEN_REQUIRE_POSTGRES=1 (CI installs the server): there they fail."""
from __future__ import annotations

import collections
import json
import os
import signal
from pathlib import Path

import optuna
import pytest

import pgserver
import wtimes
from ckgen.runtime import db as dbmod
from ckgen.tuner import workers as wk
from ckgen.tuner.replay import ReplayBackend
from ckgen.types import Config

States = optuna.trial.TrialState
TRIALS = wtimes.SUBSET  # each problem's whole subset: every run, of any worker count, finds its best
# 4 of the 8 problems, where more would only cost CPU time: each of 4 workers still gets one at the
# start, and the others' are taken over (a killed worker's, the second machine's share)
HALF = wtimes.KEYS[:4]


@pytest.fixture(scope="module")
def pg():
    bindir, why = pgserver.find_binaries()
    try:
        import psycopg  # noqa: F401 - the driver of postgresql+psycopg:// URLs (the `postgres` and `test` extras)
    except ImportError as e:
        bindir, why = None, f"the PostgreSQL driver is not installed ({e}); pip install 'ckgen[postgres]'"
    if bindir is None:
        if os.environ.get(pgserver.REQUIRE_ENV) == "1":
            pytest.fail(f"{pgserver.REQUIRE_ENV}=1 but {why}")
        pytest.skip(why)
    server = pgserver.Server(bindir)
    yield server
    server.stop()


def spec_for(url: str, tmp: Path, name: str, trials: int = TRIALS, delay: float = 0.05,
             keys: list[str] = wtimes.KEYS, **kw) -> wk.RunSpec:
    logs = tmp / f"log-{name}"
    logs.mkdir()
    backend = ReplayBackend(wtimes.time_of, wtimes.restrict_to, delay=delay, log_dir=str(logs))
    # Short heartbeats, so a killed worker's trials are recovered in seconds; the grace is several
    # beats long, so a live worker on a loaded machine is not taken for dead.
    kw.setdefault("heartbeat_s", 1)
    kw.setdefault("grace_s", 4)
    return wk.RunSpec("maxpool2d_fwd", tuple(keys), trials, url, db=str(tmp / f"{name}.yaml"),
                      backend=backend, poll_s=0.2, **kw)


def measured(spec: wk.RunSpec) -> list[dict]:
    """Every measure() call of every worker, in each worker's order."""
    out = []
    for f in sorted(Path(spec.backend.log_dir).glob("measure-*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def run_trials(spec: wk.RunSpec, report: wk.RunReport) -> dict[str, list]:
    """problem key -> the trials of this run in its study."""
    run_id = {w.run_id for w in report.workers if w.run_id}
    assert len(run_id) == 1, run_id  # every worker joined one run
    storage = optuna.storages.RDBStorage(spec.storage)
    out = {}
    for key in spec.problems:
        name = wk.tune.study_name(wtimes.OP, wtimes.OP.problem_from_key(key), wtimes.SM90, "replayed GPU")
        study = optuna.load_study(study_name=name, storage=storage)
        out[key] = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(wk.RUN_ATTR) in run_id]
    return out


def expected_winner(key: str) -> dict:
    times = {c: wtimes.time_of(key, c) for c in wtimes.subset(key)}
    return min((c for c, t in times.items() if t is not None), key=times.get).as_dict()


def winners(report: wk.RunReport) -> dict[str, dict]:
    return {key: r["entry"]["config"] for (_, key), r in report.results.items()}


def check_budget(spec: wk.RunSpec, report: wk.RunReport, trials: int = TRIALS) -> dict[str, list]:
    per = run_trials(spec, report)
    for key, ts in per.items():
        assert not [t for t in ts if t.state in (States.RUNNING, States.WAITING)], key
        spent = [t for t in ts if wk._counted(t)]
        assert len(spent) == trials, (key, len(spent))  # the run's budget, exactly
        configs = [Config.of(t.params) for t in spent]
        assert len(set(configs)) == len(configs)  # one trial per config
    return per


def test_four_workers_on_postgresql_tune_8_problems_like_one_worker(pg, tmp_path):
    url = pg.create_db()
    spec = spec_for(url, tmp_path, "four")
    report = wk.run_workers(spec, 4)
    assert [w.exitcode for w in report.workers] == [0, 0, 0, 0], [w.error for w in report.workers]
    assert len({w.pid for w in report.workers}) == 4
    per = check_budget(spec, report)
    calls = collections.Counter((m["problem"], m["config"]) for m in measured(spec))
    assert sum(calls.values()) == len(wtimes.KEYS) * TRIALS and max(calls.values()) == 1  # nothing measured twice
    assert len({m["pid"] for m in measured(spec)}) > 1  # the work was shared
    assert len(report.results) == len(wtimes.KEYS) and all("entry" in r for r in report.results.values())
    # the winners: those of one worker replaying the same problems (and the subsets' best)
    one = spec_for(f"sqlite:///{tmp_path / 'one.sqlite3'}", tmp_path, "one")
    single = wk.run_workers(one, 1)
    assert single.workers[0].exitcode == 0, single.workers[0].error
    assert winners(report) == winners(single) == {k: expected_winner(k) for k in wtimes.KEYS}
    # each worker wrote its winners through the locked merge: the DB holds all 8
    db = dbmod.InstanceDB.load(spec.db)
    assert {e.problem: dict(e.config) for e in db.entries} == winners(report)
    assert all(e.provenance_dict()["trials"] == TRIALS and e.provenance_dict()["host"] for e in db.entries)
    assert sum(len({t.user_attrs[wk.WORKER_ATTR] for t in ts}) for ts in per.values()) >= len(wtimes.KEYS)
    # `ckgen db pull` from the PostgreSQL storage rebuilds those entries (provenance: host, trials)
    pulled = wk.pull_entries(url)
    assert not pulled.skipped
    assert {e.problem: dict(e.config) for e in pulled.entries} == winners(report)
    assert all(e.provenance_dict()["trials"] == TRIALS and e.provenance_dict()["host"] for e in pulled.entries)


def test_a_worker_killed_mid_run_loses_only_its_running_trial(pg, tmp_path):
    url = pg.create_db()
    spec = spec_for(url, tmp_path, "kill", delay=0.15, keys=HALF)
    victim: dict[str, int] = {}

    def on_event(ev, procs):
        if ev[0] == "trial" and ev[1] == 0 and ev[6] >= 3 and not victim:  # its 3rd trial told: it goes on
            victim["pid"] = procs[0].pid
            os.kill(procs[0].pid, signal.SIGKILL)

    report = wk.run_workers(spec, 4, on_event=on_event)
    assert victim, "worker 0 never reached its third trial"
    assert report.workers[0].exitcode == -signal.SIGKILL
    assert [w.exitcode for w in report.workers[1:]] == [0, 0, 0], [w.error for w in report.workers]
    per = check_budget(spec, report)  # every problem still got its whole budget
    lost = [t for ts in per.values() for t in ts if t.state == States.FAIL and not wk._counted(t)]
    assert lost and all(t.user_attrs[wk.WORKER_ATTR].endswith(f":{victim['pid']}") for t in lost)
    assert len(lost) <= spec.ahead  # its running trials: the one measured, the others compiling
    for key, ts in per.items():  # each lost trial was enqueued again (optuna's retry callback) and spent
        lost_here = {t.number for t in ts if t.state == States.FAIL and not wk._counted(t)}
        assert lost_here <= {t.system_attrs.get("failed_trial") for t in ts if wk._counted(t)}, key
    calls = measured(spec)
    twice = {k for k, n in collections.Counter((m["problem"], m["config"]) for m in calls).items() if n > 1}
    victim_calls = [(m["problem"], m["config"]) for m in calls if m["pid"] == victim["pid"]]
    # at most the config it was measuring when killed is measured again; nothing it finished
    assert twice <= set(victim_calls[-1:]), (twice, victim_calls[-3:])
    finished = {(key, Config.of(t.params).key()) for key, ts in per.items() for t in ts
                if t.user_attrs[wk.WORKER_ATTR].endswith(f":{victim['pid']}") and wk._counted(t)}
    assert len(finished) >= 3 and not finished & twice
    assert winners(report) == {k: expected_winner(k) for k in HALF}


def test_a_second_machine_joins_the_run(pg, tmp_path):
    """Two `run_workers` calls with the same spec on one URL (two machines, one command): one run,
    the budget once, each problem finalized once."""
    import threading

    url = pg.create_db()
    a, b = spec_for(url, tmp_path, "a", keys=HALF), None
    b = wk.RunSpec(**{**a.__dict__, "db": str(tmp_path / "b.yaml")})
    reports = {}
    threads = [threading.Thread(target=lambda n, s: reports.__setitem__(n, wk.run_workers(s, 2)), args=(n, s))
               for n, s in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    runs = {w.run_id for r in reports.values() for w in r.workers}
    assert len(runs) == 1
    check_budget(a, reports["a"])
    assert winners(reports["a"]) == winners(reports["b"]) == {k: expected_winner(k) for k in HALF}
    written = [e.problem for f in (a.db, b.db) if Path(f).exists() for e in dbmod.InstanceDB.load(f).entries]
    assert sorted(written) == sorted(HALF)  # each winner written once, by the machine that finalized it


def test_budgets_hold_for_the_run_and_a_finished_run_is_not_joined(tmp_path):
    """SQLite, 2 workers, a budget smaller than the searched set: exactly `trials` per problem in
    all; the same command again starts a new run that continues the studies."""
    url = f"sqlite:///{tmp_path / 's.sqlite3'}"
    spec = spec_for(url, tmp_path, "first", trials=4, delay=0.02)
    first = wk.run_workers(spec, 2)
    assert [w.exitcode for w in first.workers] == [0, 0]
    check_budget(spec, first, trials=4)
    again = wk.run_workers(spec_for(url, tmp_path, "again", trials=4, delay=0.02), 2)
    assert {w.run_id for w in again.workers} != {w.run_id for w in first.workers}
    check_budget(spec, again, trials=4)
    assert all(len(r["workers"]) >= 1 for r in again.results.values())


def test_total_timeout_ends_the_run_for_every_worker(tmp_path):
    url = f"sqlite:///{tmp_path / 's.sqlite3'}"
    spec = spec_for(url, tmp_path, "timeout", trials=TRIALS, delay=0.5, total_timeout=4)
    report = wk.run_workers(spec, 2)
    assert [w.exitcode for w in report.workers] == [0, 0]
    spent = sum(len([t for t in ts if wk._counted(t)]) for ts in run_trials(spec, report).values())
    assert 0 < spent < len(wtimes.KEYS) * TRIALS  # stopped by the clock, not the budget
    assert report.seconds < 60


def _joining(spec: wk.RunSpec) -> wk._Worker:
    """A worker as far as joining its run: the spec, the device and the storage, nothing measured."""
    from ckgen.runtime.target import DeviceInfo

    w = object.__new__(wk._Worker)
    w.spec, w.optuna, w.storage = spec, optuna, wk.tune.open_storage(spec.storage)
    w.target, w.info = wtimes.SM90, DeviceInfo(wtimes.SM90, "replayed GPU", 132, 50 * 2**20)
    return w


def test_a_late_worker_of_the_same_command_joins_its_run(tmp_path):
    """A worker that starts after --total-timeout has passed since its sibling made the run (a
    busy CPU, a slow GPU start) must not take the expired run for a finished one and start a
    second: a worker of the launch that made the run joins it however late it starts (and finds
    no time left); another launch of the command after the deadline starts a new run."""
    import time

    spec = spec_for(f"sqlite:///{tmp_path / 's.sqlite3'}", tmp_path, "late", total_timeout=1)
    launched = wk.launched(spec)
    first, deadline = _joining(launched)._join()
    time.sleep(1.2)  # past the run's deadline
    late, late_deadline = _joining(launched)._join()
    assert (late, late_deadline) == (first, deadline) and late_deadline < time.time()
    assert _joining(wk.launched(spec))._join()[0] != first  # the same command again, later: a new run


def test_one_worker_searches_as_one_process_and_builds_one_evaluator_per_problem(tmp_path):
    """`--workers 1` is `ckgen tune` in a process of its own: per problem, the same configs in the
    same order as a `tune.Tuner`'s search with the same budget (its seeds sized by the run's --trials, not by
    an unbounded count: over each problem's whole valid space, not a subset, so the op's seeds
    count), and one evaluator (on a GPU: one harness, the inputs and the float64 reference) for the
    search and the final round."""
    from ckgen.tuner.replay import ReplayEvaluator
    from ckgen.tuner.tune import Tuner, TuneRequest

    trials, keys = 6, wtimes.KEYS[:3]
    logs = tmp_path / "logs"
    logs.mkdir()
    backend = wtimes.CountingBackend(ReplayBackend(wtimes.time_of, None, log_dir=str(logs)))
    spec = wk.RunSpec(wtimes.OP.name, tuple(keys), trials, f"sqlite:///{tmp_path / 'w.sqlite3'}", backend=backend,
                      poll_s=0.2)
    report = wk.run_workers(spec, 1)
    assert report.workers[0].exitcode == 0, report.workers[0].error
    order = collections.defaultdict(list)
    for m in measured(spec):
        order[m["problem"]].append(m["config"])
    for key in keys:
        ev = ReplayEvaluator(lambda c, key=key: wtimes.time_of(key, c))
        request = TuneRequest(wtimes.OP, wtimes.OP.problem_from_key(key), wtimes.SM90, trials=trials,
                              storage=f"sqlite:///{tmp_path / 'one.sqlite3'}", seed=spec.seed, device="replayed GPU",
                              model=None)
        Tuner(request, ev).search()
        assert order[key] == [c.key() for c in ev.calls], key
    made = [line for f in logs.glob("evaluators-*.txt") for line in f.read_text().split()]
    assert sorted(made) == sorted(keys)  # one per problem: the final round reused the search's
