"""Concurrent tuners on one SQLite study storage, with replayed timings and
real processes: the schema is created under a lock on a fresh file, tuners sharing a study never
measure one config twice and leave no trial RUNNING, a dead tuner's RUNNING trial is failed after
the grace period and its config enqueued again (optuna's retry callback) and measured, storage errors have a clear message, and the
study name carries the device."""
from __future__ import annotations

import multiprocessing as mp
import time

import optuna
import pytest

from ckgen.tuner import tune
from ckgen.tuner.replay import ReplayEvaluator
from ckgen.tuner.sampler import settled
from ckgen.tuner.tune import StudyStorageError, Tuner, TuneRequest, open_storage, study_name
from ckgen.types import Config
from test_tune_search import OP, PROBLEM, SM90, synthetic, valid

States = optuna.trial.TrialState
TUNERS, TRIALS = 4, 8


def search(ev, **fields):
    """A Tuner's search of the test problem (no cost model): its study."""
    return Tuner(TuneRequest(OP, PROBLEM, SM90, model=None, **fields), ev).search()


def _tuner(url, seed, barrier, results):
    try:
        barrier.wait(timeout=120)  # all start on the fresh file at once
        ev = ReplayEvaluator(synthetic)
        search(ev, trials=TRIALS, storage=url, seed=seed, ahead=2)
        results.put((seed, [c.key() for c in ev.calls], None))
    except BaseException as e:  # reported to the test, which fails with it
        results.put((seed, [], f"{e.__class__.__name__}: {e}"))


def test_concurrent_tuners_share_one_fresh_sqlite_study(tmp_path):
    url = f"sqlite:///{tmp_path / 'studies.sqlite3'}"
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(TUNERS), ctx.Queue()
    procs = [ctx.Process(target=_tuner, args=(url, seed, barrier, results)) for seed in range(TUNERS)]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(err is None for _, _, err in got), got
    assert all(p.exitcode == 0 for p in procs)
    calls = [c for _, cs, _ in got for c in cs]
    assert len(calls) == TUNERS * TRIALS and len(set(calls)) == len(calls)  # no config measured twice
    study = optuna.load_study(study_name=study_name(OP, PROBLEM, SM90), storage=url)
    states = [t.state for t in study.trials]
    assert States.RUNNING not in states and States.WAITING not in states
    complete = [t.params for t in study.trials if t.state == States.COMPLETE]
    assert len(complete) == TUNERS * TRIALS
    assert len({tuple(sorted(p.items())) for p in complete}) == len(complete)  # one trial per config


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_a_dead_tuners_running_trial_is_recovered(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "HEARTBEAT_S", 1)
    monkeypatch.setattr(tune, "GRACE_S", 2)
    url = f"sqlite:///{tmp_path / 'studies.sqlite3'}"
    few = sorted(valid(), key=lambda c: c.key())[:6]
    keep = set(few)
    search(ReplayEvaluator(synthetic), trials=1, storage=url, seed=0, restrict=keep.__contains__)
    # A tuner that asked for a config, beat once, then died: its trial stays RUNNING.
    storage = open_storage(url)
    study = optuna.load_study(study_name=study_name(OP, PROBLEM, SM90), storage=storage)
    taken = {tuple(sorted(t.params.items())) for t in study.trials if t.params}
    lost = next(c for c in few if c.items not in taken)
    study.enqueue_trial(lost.as_dict())
    dead = study.ask()
    for name, values in OP.space.params.items():
        dead.suggest_categorical(name, list(values))
    storage.record_heartbeat(dead._trial_id)
    time.sleep(4)  # past the grace period (SQLite keeps whole seconds)
    ev = ReplayEvaluator(synthetic)
    study = search(ev, trials=10, storage=url, seed=1, restrict=keep.__contains__)
    stale = next(t for t in study.trials if t.number == dead.number)
    assert stale.state == States.FAIL and not settled(stale)
    assert lost in ev.calls  # measured again by the next tuner
    retried = [t for t in study.trials if t.system_attrs.get("failed_trial") == dead.number]
    assert [(t.state, t.params) for t in retried] == [(States.COMPLETE, lost.as_dict())]  # optuna's retry callback
    assert {t.state for t in study.trials if t.number != dead.number} <= {States.COMPLETE}
    assert len(ev.calls) == 5  # the 6 configs less the one measured before


@pytest.mark.parametrize("ahead", [1, 3])
def test_an_interrupted_search_leaves_no_trial_running(tmp_path, ahead):
    """Ctrl-C during a measurement left that trial RUNNING (only the proposed, unmeasured ones
    were failed), and `db pull` skipped the study until the same tune ran again. Every trial the
    search holds is failed on the way out, however it ends."""
    url = f"sqlite:///{tmp_path / 'studies.sqlite3'}"
    calls = []

    def interrupted(config):
        calls.append(config)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return synthetic(config)

    with pytest.raises(KeyboardInterrupt):
        search(ReplayEvaluator(interrupted), trials=8, storage=url, seed=0, ahead=ahead)
    study = optuna.load_study(study_name=study_name(OP, PROBLEM, SM90), storage=url)
    states = [t.state for t in study.trials]
    assert States.RUNNING not in states and states.count(States.COMPLETE) == 2
    cut = next(t for t in study.trials if t.params and Config.of(t.params) == calls[2])
    assert cut.state == States.FAIL and not settled(cut)  # proposable again: not a failure of the config


def test_storage_errors_have_a_clear_message(tmp_path):
    bad = tmp_path / "not-a-db.sqlite3"
    bad.write_bytes(b"this is not a SQLite file" * 100)
    with pytest.raises(StudyStorageError, match=r"optuna study storage sqlite:///.*not-a-db"):
        search(ReplayEvaluator(synthetic), trials=2, storage=f"sqlite:///{bad}", seed=0)
    assert issubclass(StudyStorageError, RuntimeError)  # `ckgen tune` reports it and goes on


def test_study_name_is_keyed_by_device():
    a = study_name(OP, PROBLEM, SM90, "NVIDIA H100 80GB HBM3")
    b = study_name(OP, PROBLEM, SM90, "NVIDIA H800")
    assert a != b and "NVIDIA H100 80GB HBM3" in a
