"""Opt-in online tuning (ckgen/tuner/online.py) without a GPU: the dispatcher's slow path (plan building,
`Dispatcher.choose` with a `Site`) calls an injected tuner, a fake one or the real search on
replayed timings. Off by default; on with CKGEN_TUNE=1 or inside `ckgen.tuning()`; the budget
from the env and the block; one tune per problem and process; a failing tuner falls back with one
warning; never under CUDA-graph capture; two processes tuning into one user DB lose nothing; the
plan-building hook leaves the fast path alone."""
from __future__ import annotations

import datetime as _dt
import logging
import multiprocessing as mp
import threading
from types import SimpleNamespace

import pytest

import ckgen
from ckgen.runtime import db as dbmod
from ckgen.runtime import dispatch
from ckgen.tuner import online
from ckgen import settings
from ckgen.runtime.dispatch import Dispatcher, dispatcher
from ckgen.instance import render_instance
from ckgen.tuner.online import OnlineTuningWarning, Site
from ckgen.ops import get_op
from ckgen.ops.spec import Config, Target
from ckgen.runtime.target import DeviceInfo, NoGPUError
from ckgen.tuner.tune import TuneRequest

OP = get_op("groupnorm_fwd")
SM90 = Target.named("sm_90")
DEFAULT = OP.space.default
X = Config.of({**DEFAULT.as_dict(), "threads": 256})  # valid for every problem(N=...) below
HERE = Site(0, lambda: False)
CAPTURING = Site(0, lambda: True)


def problem(N=2, C=320, H=64, W=64, G=32, layout="nchw"):
    return OP.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype="bf16", layout=layout)


P = problem()


def entry_for(p, config: Config = X, trials: int = 12, date: str | None = None) -> dbmod.Entry:
    src = render_instance(OP, p, config, SM90)
    date = date or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return dbmod.Entry(op=OP.name, vendor="cuda", arch="sm_90", device="fake GPU", problem=p.key(),
                       config=config.items, instance=src.name, source_sha256=src.sha256, time_us=5.0, gbps=1.0,
                       default_time_us=9.0, provenance={"date": date, "trials": trials, "tuned_by": "online"})


class FakeTuner:
    """Records its calls; returns an entry for X (or raises `fail`)."""

    def __init__(self, fail: BaseException | None = None):
        self.calls: list[tuple] = []
        self.fail = fail

    def __call__(self, op, problem, *, device, trials, max_seconds):
        self.calls.append((op.name, problem.key(), device, trials, max_seconds))
        if self.fail is not None:
            raise self.fail
        return entry_for(problem, X, trials)


@pytest.fixture
def tuner(monkeypatch) -> FakeTuner:
    t = FakeTuner()
    monkeypatch.setattr(online, "tuner", t)
    return t


@pytest.fixture
def d(tmp_path, monkeypatch) -> Dispatcher:
    """A fresh dispatcher that online tuning's DB writes reload, as they reload the global one."""
    disp = Dispatcher()
    monkeypatch.setattr(dbmod, "_listeners", [*dbmod._listeners, disp.reload])
    monkeypatch.setattr(dispatch, "_dispatcher", disp)  # online.py asks dispatch.dispatcher() for the DB view
    return disp


def test_module_configs_are_valid() -> None:
    assert X != DEFAULT
    for n in (1, 2, 3, 7, 64):
        assert OP.validate(problem(N=n), X, SM90)


# ------------------------------------------------------------------ on and off


def test_off_by_default(d, tuner) -> None:
    assert online.budget() is None
    choice, _ = d.choose(OP, P, SM90, site=HERE)
    assert choice.source == "default" and not tuner.calls
    assert not settings.user_db_path().exists()


def test_env_turns_it_on_and_the_call_goes_on_with_the_winner(d, tuner, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CKGEN_TUNE", "1")
    with caplog.at_level(logging.WARNING, logger="ckgen"):
        choice, src = d.choose(OP, P, SM90, site=HERE)
    assert tuner.calls == [(OP.name, P.key(), 0, 12, None)]
    assert (choice.source, choice.config) == ("tuned", X)
    assert src.name == choice.instance and "tuned online" in choice.reason
    saved = dbmod.InstanceDB.load(settings.user_db_path()).lookup(OP.name, "sm_90", P.key())
    assert saved is not None and saved.config_dict() == X.as_dict()
    lines = [r.getMessage() for r in caplog.records if r.name == "ckgen"]
    assert len(lines) == 1 and lines[0].startswith(f"ckgen: tuned groupnorm_fwd {P.key()} online")


def test_quiet_silences_the_progress_line(d, tuner, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CKGEN_TUNE", "1")
    monkeypatch.setenv("CKGEN_QUIET", "1")
    with caplog.at_level(logging.DEBUG, logger="ckgen"):
        assert d.choose(OP, P, SM90, site=HERE)[0].source == "tuned"
    assert not [r for r in caplog.records if r.name == "ckgen"] and len(tuner.calls) == 1


def test_the_env_takes_the_usual_words_for_on_and_off(d, tuner, monkeypatch) -> None:
    """CKGEN_TUNE=true|yes|on meant off, silently; now the usual words mean what they say, and
    a word that is neither is off with one warning naming the variable."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these warns
        for value in ("1", "true", "Yes", "ON", " on "):
            monkeypatch.setenv("CKGEN_TUNE", value)
            assert online.budget() == online.Budget(12, None), value
        for value in ("0", "", "false", "No", "off"):
            monkeypatch.setenv("CKGEN_TUNE", value)
            assert online.budget() is None, value
    monkeypatch.setenv("CKGEN_TUNE", "maybe")
    with pytest.warns(settings.SettingWarning, match=r"\$CKGEN_TUNE='maybe' is neither on .* taken as off"):
        assert online.budget() is None
    assert d.choose(OP, P, SM90, site=HERE)[0].source == "default" and not tuner.calls


def test_tune_max_s_inf_is_no_cap_as_documented(monkeypatch) -> None:
    import math
    import warnings

    monkeypatch.setenv("CKGEN_TUNE", "1")
    for value in ("inf", "Infinity"):
        monkeypatch.setenv("CKGEN_TUNE_MAX_S", value)
        assert settings.tune_max_seconds() == math.inf
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not "malformed, using no cap"
            assert online.budget() == online.Budget(12, None)
    for value in ("0", "-inf", "nan", "soon"):
        monkeypatch.setenv("CKGEN_TUNE_MAX_S", value)
        with pytest.raises(ValueError, match=r"\$CKGEN_TUNE_MAX_S: expected a number of seconds > 0"):
            settings.tune_max_seconds()


def test_tuning_block_turns_it_on_and_only_inside(d, tuner) -> None:
    with ckgen.tuning() as want:
        assert want == online.Budget(12, None)
        assert d.choose(OP, P, SM90, site=HERE)[0].source == "tuned"
    assert online.budget() is None
    assert d.choose(OP, problem(N=3), SM90, site=HERE)[0].source != "tuned"
    assert [c[1] for c in tuner.calls] == [P.key()]


def test_explain_after_tuning_says_tuned(tuner, monkeypatch) -> None:
    """Through the global dispatcher, as a call's plan building would, then explain."""
    kw = dict(N=2, C=320, H=64, W=64, G=32, dtype="bf16", layout="nchw", arch="sm_90")
    assert ckgen.explain("groupnorm_fwd", **kw).source == "default"  # explain alone never tunes
    monkeypatch.setenv("CKGEN_TUNE", "1")
    assert ckgen.explain("groupnorm_fwd", **kw).source == "default" and not tuner.calls
    dispatcher().choose(OP, P, SM90, site=HERE)  # the call's plan: the cached choice is not tuned -> tune
    choice = ckgen.explain("groupnorm_fwd", **kw)
    assert (choice.source, choice.config) == ("tuned", X) and len(tuner.calls) == 1
    assert "[tuned]" in str(choice) and "tuned online" in str(choice)


def test_explain_with_no_problem_arguments_never_tunes(d, tuner, monkeypatch) -> None:
    monkeypatch.setenv("CKGEN_TUNE", "1")
    assert d.choose(OP, P, SM90)[0].source == "default"  # no site: not plan building
    assert not tuner.calls


# ------------------------------------------------------------------ budget


@pytest.mark.parametrize("env, block, want", [
    ({}, None, (12, None)),
    ({"CKGEN_TUNE_TRIALS": "5", "CKGEN_TUNE_MAX_S": "7.5"}, None, (5, 7.5)),
    ({"CKGEN_TUNE_TRIALS": "5", "CKGEN_TUNE_MAX_S": "7.5"}, {}, (5, 7.5)),
    ({"CKGEN_TUNE_TRIALS": "5", "CKGEN_TUNE_MAX_S": "7.5"}, {"trials": 3}, (3, 7.5)),
    ({"CKGEN_TUNE_TRIALS": "5", "CKGEN_TUNE_MAX_S": "7.5"}, {"max_seconds": 2}, (5, 2.0)),
    ({"CKGEN_TUNE_MAX_S": "7.5"}, {"trials": 4, "max_seconds": float("inf")}, (4, None)),
])
def test_budget_from_the_env_and_the_block(d, tuner, monkeypatch, env, block, want) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if block is None:
        monkeypatch.setenv("CKGEN_TUNE", "1")
        d.choose(OP, P, SM90, site=HERE)
    else:
        with ckgen.tuning(**block):
            d.choose(OP, P, SM90, site=HERE)
    assert [c[3:] for c in tuner.calls] == [want]


@pytest.mark.parametrize("trials", ["99999999999999999999999", str(10**7)])
def test_a_trial_count_beyond_any_space_is_refused(monkeypatch, trials) -> None:
    """CKGEN_TUNE_TRIALS=99999999999999999999999 was taken (a number no search reaches, and
    beyond the int sizes the tuner hands on)."""
    from ckgen import settings

    monkeypatch.setenv("CKGEN_TUNE_TRIALS", trials)
    with pytest.raises(ValueError, match=r"\$CKGEN_TUNE_TRIALS: .*at most"):
        settings.tune_trials()
    with pytest.raises(ValueError, match="trials: .*at most"):
        with ckgen.tuning(trials=int(trials)):
            pass


def test_nested_blocks_inherit_and_the_block_wins_over_the_env(d, tuner, monkeypatch) -> None:
    monkeypatch.setenv("CKGEN_TUNE", "1")
    monkeypatch.setenv("CKGEN_TUNE_TRIALS", "20")
    with ckgen.tuning(trials=3):
        with ckgen.tuning(max_seconds=9):
            assert online.budget() == online.Budget(3, 9.0)
            d.choose(OP, problem(N=1), SM90, site=HERE)
            with ckgen.tuning(enabled=False):
                assert online.budget() is None
                assert d.choose(OP, problem(N=2), SM90, site=HERE)[0].source != "tuned"
            assert online.budget() == online.Budget(3, 9.0)
        assert online.budget() == online.Budget(3, None)
    assert online.budget() == online.Budget(20, None)  # the env again
    with ckgen.tuning(enabled=False):
        assert online.budget() is None  # off inside, CKGEN_TUNE=1 or not
    assert [c[1:] for c in tuner.calls] == [(problem(N=1).key(), 0, 3, 9.0)]


def test_a_block_is_seen_by_other_threads_and_a_threads_own_block_wins() -> None:
    """Process-wide while open (autograd runs backward ops on its own threads); a thread's own
    innermost block comes first."""
    seen: dict[str, object] = {}
    inner_open, outer_checked, done = threading.Event(), threading.Event(), threading.Event()

    def other() -> None:
        seen["before"] = online.budget()
        with ckgen.tuning(trials=7):
            inner_open.set()
            outer_checked.wait(10)
            seen["own"] = online.budget()
        seen["after own"] = online.budget()
        done.set()

    with ckgen.tuning(trials=2):
        t = threading.Thread(target=other)
        t.start()
        inner_open.wait(10)
        seen["main, other's block open"] = online.budget()  # main's own block wins in main
        outer_checked.set()
        done.wait(10)
        t.join(10)
    assert seen["before"] == online.Budget(2, None)  # main's block, seen from the other thread
    assert seen["own"] == online.Budget(7, None)
    assert seen["after own"] == online.Budget(2, None)
    assert seen["main, other's block open"] == online.Budget(2, None)
    assert online.budget() is None


def test_bad_block_arguments_raise() -> None:
    for kw in ({"trials": 0}, {"trials": 2.5}, {"trials": True}, {"max_seconds": 0}, {"max_seconds": -1},
               {"max_seconds": "5"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            with ckgen.tuning(**kw):
                pass
    with pytest.raises(TypeError, match="enabled"):
        with ckgen.tuning(enabled=1):
            pass
    assert online.budget() is None


def test_malformed_env_budget_warns_once_and_uses_the_defaults(monkeypatch) -> None:
    monkeypatch.setenv("CKGEN_TUNE", "1")
    monkeypatch.setenv("CKGEN_TUNE_TRIALS", "many")
    monkeypatch.setenv("CKGEN_TUNE_MAX_S", "-3")
    with pytest.warns(OnlineTuningWarning) as got:
        assert online.budget() == online.Budget(12, None)
        assert online.budget() == online.Budget(12, None)
    assert len(got) == 2  # one per variable, once each
    assert "CKGEN_TUNE_TRIALS" in str(got[0].message) and "CKGEN_TUNE_MAX_S" in str(got[1].message)


# ------------------------------------------------------------------ once per problem; failures


def test_one_tune_per_problem(d, tuner, monkeypatch) -> None:
    monkeypatch.setenv("CKGEN_TUNE", "1")
    for _ in range(3):
        assert d.choose(OP, P, SM90, site=HERE)[0].source == "tuned"
        d.choose(OP, P, SM90, max_vec_bytes=8, site=HERE)  # another alignment class: same problem
        d.reload()
    Dispatcher().choose(OP, P, SM90, site=HERE)  # another dispatcher of this process
    d.choose(OP, problem(N=5), SM90, site=HERE)
    assert [c[1] for c in tuner.calls] == [P.key(), problem(N=5).key()]


@pytest.mark.parametrize("error", [RuntimeError("no candidate passed verification"),
                                   ValueError("bad"), OSError("disk full")])
def test_a_failing_tuner_warns_once_and_falls_back(d, monkeypatch, error) -> None:
    bad = FakeTuner(fail=error)
    monkeypatch.setattr(online, "tuner", bad)
    monkeypatch.setenv("CKGEN_TUNE", "1")
    with pytest.warns(OnlineTuningWarning, match="online tuning of groupnorm_fwd .* failed") as got:
        for _ in range(3):
            assert d.choose(OP, P, SM90, site=HERE)[0].source == "default"
            d.reload()
    assert len(got) == 1 and str(error) in str(got[0].message)
    assert len(bad.calls) == 1  # not retried in a loop
    assert not settings.user_db_path().exists()
    # another problem is still tried (the failure was this problem's)
    with pytest.warns(OnlineTuningWarning):
        d.choose(OP, problem(N=4), SM90, site=HERE)
    assert len(bad.calls) == 2


@pytest.mark.parametrize("error", [NoGPUError("no usable GPU (CuPy is not installed)"),
                                   ModuleNotFoundError("No module named 'cupy'")])
def test_a_failure_every_problem_would_meet_stops_online_tuning(d, monkeypatch, error) -> None:
    bad = FakeTuner(fail=error)
    monkeypatch.setattr(online, "tuner", bad)
    monkeypatch.setenv("CKGEN_TUNE", "1")
    with pytest.warns(OnlineTuningWarning, match="off for the rest of this process") as got:
        for n in (1, 2, 3):
            assert d.choose(OP, problem(N=n), SM90, site=HERE)[0].source == "default"
    assert len(got) == 1 and len(bad.calls) == 1


def test_the_study_storage_failing_stops_online_tuning(d, monkeypatch) -> None:
    from ckgen.tuner.tune import StudyStorageError

    bad = FakeTuner(fail=StudyStorageError("optuna study storage sqlite:///x: locked"))
    monkeypatch.setattr(online, "tuner", bad)
    with ckgen.tuning():
        with pytest.warns(OnlineTuningWarning) as got:
            d.choose(OP, problem(N=1), SM90, site=HERE)
            d.choose(OP, problem(N=2), SM90, site=HERE)
    assert len(got) == 1 and len(bad.calls) == 1


def test_a_tuner_returning_another_problems_entry_is_a_failure(d, monkeypatch) -> None:
    monkeypatch.setattr(online, "tuner", lambda op, p, **kw: entry_for(problem(N=9)))
    monkeypatch.setenv("CKGEN_TUNE", "1")
    with pytest.warns(OnlineTuningWarning, match="not an entry for this problem"):
        assert d.choose(OP, P, SM90, site=HERE)[0].source == "default"
    assert not settings.user_db_path().exists()


def test_a_corrupt_user_db_keeps_the_winner_in_a_side_file(d, tuner, monkeypatch) -> None:
    path = settings.user_db_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("schema: 1\nentries: [unclosed\n")
    monkeypatch.setenv("CKGEN_TUNE", "1")
    with pytest.warns(UserWarning) as got:
        choice, _ = d.choose(OP, P, SM90, site=HERE)
    assert any(isinstance(w.message, OnlineTuningWarning) and "side file" in str(w.message) for w in got)
    assert (choice.source, choice.config) == ("tuned", X)  # every load merges the side file
    assert path.read_text() == "schema: 1\nentries: [unclosed\n"  # never overwritten


# ------------------------------------------------------------------ CUDA-graph capture


def test_never_under_capture_said_once(d, tuner, monkeypatch) -> None:
    monkeypatch.setenv("CKGEN_TUNE", "1")
    with pytest.warns(OnlineTuningWarning, match="capturing a CUDA graph") as got:
        assert d.choose(OP, problem(N=1), SM90, site=CAPTURING)[0].source == "default"
        assert d.choose(OP, problem(N=2), SM90, site=CAPTURING)[0].source == "default"
    assert len(got) == 1 and not tuner.calls
    # outside capture, the next plan built for it tunes it
    assert d.choose(OP, problem(N=1), SM90, site=HERE)[0].source == "tuned"
    assert len(tuner.calls) == 1


def test_a_capture_state_that_cannot_be_read_counts_as_capture(d, tuner, monkeypatch) -> None:
    def broken() -> bool:
        raise RuntimeError("cudaStreamIsCapturing failed")

    monkeypatch.setenv("CKGEN_TUNE", "1")
    with pytest.warns(OnlineTuningWarning, match="capturing"):
        assert d.choose(OP, P, SM90, site=Site(0, broken))[0].source == "default"
    assert not tuner.calls


# ------------------------------------------------------------------ DB already has it


def test_a_winner_saved_by_another_process_meanwhile_is_used_not_retuned(d, tuner, monkeypatch, caplog) -> None:
    assert d.choose(OP, P, SM90)[0].source == "default"  # this process read the (empty) DB
    with monkeypatch.context() as m:  # another process writes the file: no on_change here
        m.setattr(dbmod, "_listeners", [])
        dbmod.save_entries(settings.user_db_path(), [entry_for(P, X)])
    monkeypatch.setenv("CKGEN_TUNE", "1")
    with caplog.at_level(logging.WARNING, logger="ckgen"):
        choice, _ = d.choose(OP, P, SM90, site=HERE)
    assert (choice.source, choice.config) == ("tuned", X) and not tuner.calls
    assert any("tuned by another process" in r.getMessage() for r in caplog.records)


def test_a_tuned_entry_passed_over_for_alignment_is_not_retuned(d, tuner, monkeypatch) -> None:
    dbmod.save_entries(settings.user_db_path(), [entry_for(P, X)])  # X has 16-byte vectors
    monkeypatch.setenv("CKGEN_TUNE", "1")
    choice, _ = d.choose(OP, P, SM90, max_vec_bytes=4, site=HERE)
    assert choice.source != "tuned" and "unusable" in choice.reason
    assert not tuner.calls


# ------------------------------------------------------------------ the real search, replayed


def _synthetic(config: Config) -> float:
    return 100.0 - 2.0 * config["vec_bytes"] + abs(config["threads"] - 256) / 64 + config["items"] / 4


def replay_tuner(op, p, *, device, trials, max_seconds):
    """A tune.Tuner (search + final round) on synthetic timings (ReplayEvaluator) in place of the GPU."""
    from ckgen.tuner.replay import ReplayEvaluator

    return online.tune_with(TuneRequest(op, p, SM90, trials=trials, timeout=max_seconds, device="replayed GPU"),
                            ReplayEvaluator(_synthetic))


def test_replayed_search_writes_its_winner_and_the_call_uses_it(d, monkeypatch) -> None:
    calls = []

    def tuner(op, p, **kw):
        calls.append(kw)
        return replay_tuner(op, p, **kw)

    monkeypatch.setattr(online, "tuner", tuner)
    p = problem(N=8, layout="nhwc")
    with ckgen.tuning(trials=4):
        choice, src = d.choose(OP, p, SM90, site=HERE)
    assert calls == [{"device": 0, "trials": 4, "max_seconds": None}]
    e = dbmod.InstanceDB.load(settings.user_db_path()).lookup(OP.name, "sm_90", p.key())
    assert e is not None and e.device == "replayed GPU"
    prov = e.provenance_dict()
    assert prov["tuned_by"] == "online" and prov["trials"] == 4 and prov["date"]
    assert (choice.source, choice.config, choice.entry) == ("tuned", Config.of(e.config_dict()), e)
    assert src.sha256 == e.source_sha256 and OP.validate(p, choice.config, SM90)
    assert e.time_us == pytest.approx(_synthetic(choice.config)) and e.time_us <= e.default_time_us


def test_the_incumbent_is_measured_first_and_a_tune_never_ends_slower_than_it() -> None:
    """`TuneRequest.incumbent` (what the call ran untuned: `tune.dispatcher_pick`) measures it
    before the default and re-times it in the final round: a config no 4-trial search finds, made
    the fastest, is the winner; an invalid incumbent is ignored."""
    from ckgen.tuner.replay import ReplayEvaluator

    p = problem(N=8, layout="nhwc")
    valid = sorted((c for c in OP.space.enumerate() if OP.validate(p, c, SM90)), key=Config.key)
    plain = online.tune_with(TuneRequest(OP, p, SM90, trials=4), ReplayEvaluator(_synthetic))
    found = Config.of(plain.config_dict())
    inc = next(c for c in reversed(valid) if c != found and c != DEFAULT)
    fast = lambda c: 1.0 if c == inc else _synthetic(c)  # noqa: E731
    ev = ReplayEvaluator(fast)
    e = online.tune_with(TuneRequest(OP, p, SM90, trials=4, incumbent=inc), ev)
    assert ev.calls[0] == inc and Config.of(e.config_dict()) == inc and e.time_us == pytest.approx(1.0)
    bad = DEFAULT.replace(threads=-1)
    ev2 = ReplayEvaluator(_synthetic)
    e2 = online.tune_with(TuneRequest(OP, p, SM90, trials=4, incumbent=bad), ev2)
    assert bad not in ev2.calls and Config.of(e2.config_dict()) == found


def test_a_time_budget_spent_before_any_measurement_is_a_failure(monkeypatch) -> None:
    from ckgen.tuner.replay import ReplayEvaluator

    with pytest.raises(RuntimeError, match="ran out before the first config"):
        online.tune_with(TuneRequest(OP, P, SM90, trials=4, timeout=1.0), ReplayEvaluator(_synthetic),
                         started=-1e9)  # started long ago: nothing left


# ------------------------------------------------------------------ two processes, one user DB

PER_PROCESS = 12


def _online_worker(tag: int, start, results) -> None:
    """A process with CKGEN_TUNE=1 (inherited) whose first calls tune PER_PROCESS problems."""
    try:
        online.tuner = FakeTuner()
        start.wait(60)
        got = []
        for i in range(PER_PROCESS):
            p = problem(N=1 + i + 100 * tag)
            got.append(dispatcher().choose(OP, p, SM90, site=HERE)[0].source)
        results.put((tag, got, None))
    except BaseException as e:  # reported to the test
        results.put((tag, [], f"{e.__class__.__name__}: {e}"))


def test_two_processes_tuning_into_one_user_db_lose_nothing(monkeypatch) -> None:
    # One tuned problem first, so that the workers' untuned problems take the quick "nearest" path.
    seed = problem(N=1000)
    dbmod.save_entries(settings.user_db_path(), [entry_for(seed, X)])
    monkeypatch.setenv("CKGEN_TUNE", "1")  # the spawned workers inherit the env (and the test's DB)
    ctx = mp.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_online_worker, args=(tag, start, results)) for tag in (1, 2)]
    for pr in procs:
        pr.start()
    start.set()
    got = [results.get(timeout=300) for _ in procs]
    for pr in procs:
        pr.join(timeout=60)
    assert all(err is None for _, _, err in got), got
    assert all(sources == ["tuned"] * PER_PROCESS for _, sources, _ in got), got
    assert [pr.exitcode for pr in procs] == [0, 0]
    keys = {e.problem for e in dbmod.InstanceDB.load(settings.user_db_path()).entries}
    want = {problem(N=1 + i + 100 * tag).key() for tag in (1, 2) for i in range(PER_PROCESS)} | {seed.key()}
    assert keys == want


# ------------------------------------------------------------------ the hook: plan building only


@pytest.fixture
def no_gpu_plans(monkeypatch):
    """dispatch.Plan built on CPU: fake CUDA runtime and kernels, CPU torch tensors as device ones."""
    torch = pytest.importorskip("torch")
    from ckgen.runtime import compile as compmod
    from ckgen.runtime import target as targetmod
    from ckgen.runtime import tensors

    state = SimpleNamespace(capturing=False, launches=0, torch=torch)
    rt = SimpleNamespace(streamIsCapturing=lambda s: state.capturing, getDevice=lambda: 0)

    def launch(*args):
        state.launches += 1

    monkeypatch.setattr(dispatch, "_rt", rt)
    monkeypatch.setattr(dispatch, "_launch_kernel", launch)
    monkeypatch.setattr(dispatch, "_multi_gpu", False)
    monkeypatch.setattr(dispatch, "_on_device", _NoSwitch)
    monkeypatch.setattr(tensors, "current_stream_fn", lambda ref: (lambda: 77))
    monkeypatch.setattr(targetmod, "device_info", lambda device=None: DeviceInfo(SM90, "fake GPU", 132, 50 << 20))
    monkeypatch.setattr(compmod, "load_kernel",
                        lambda src, target=None, symbol=None: SimpleNamespace(kernel=SimpleNamespace(ptr=4242)))
    return state


class _NoSwitch:
    def __init__(self, device: int) -> None:
        pass

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


def _x(state, n: int):
    return state.torch.randn(n, 320, 64, 64, dtype=state.torch.bfloat16)


def _plan(x):
    from ckgen.runtime.dispatch import Output, plan_for
    from ckgen.runtime.tensors import DeviceTensor

    like = DeviceTensor(x, "torch", x.data_ptr(), tuple(x.shape), tuple(x.stride()), "bf16", 0)
    p = problem(N=x.shape[0])
    outs = (Output("y", like.shape, "nchw", "bf16"), Output("mean", (p.N, p.G), "flat", "fp32"),
            Output("rstd", (p.N, p.G), "flat", "fp32"))
    return plan_for(OP, p, like, {"x": x.data_ptr(), "gamma": 0, "beta": 0}, outs, ("x", "gamma", "beta"))


def test_plan_building_tunes_and_a_built_plan_never_asks_again(no_gpu_plans, tuner, monkeypatch) -> None:
    asked = []
    real = online.maybe_tune
    monkeypatch.setattr(online, "maybe_tune", lambda *a: asked.append(a[1].key()) or real(*a))
    x = _x(no_gpu_plans, 2)
    monkeypatch.setenv("CKGEN_TUNE", "1")
    plan = _plan(x)
    assert plan.choice.source == "tuned" and plan.choice.config == X and len(tuner.calls) == 1
    assert dispatcher().plans  # the plan survived the DB write's reload: it was stored after it
    for _ in range(5):
        assert _plan(x) is plan
        plan.run((x.data_ptr(), 0, 0), 1e-5, x)
    assert asked == [problem(N=2).key()]  # once, while the plan was built
    assert "online" not in plan.run.source and "tune" not in plan.run.source


def test_plan_built_under_capture_is_not_tuned(no_gpu_plans, tuner, monkeypatch) -> None:
    monkeypatch.setenv("CKGEN_TUNE", "1")
    no_gpu_plans.capturing = True
    with pytest.warns(OnlineTuningWarning, match="capturing"):
        plan = _plan(_x(no_gpu_plans, 3))
    assert plan.choice.source != "tuned" and not tuner.calls


def test_opening_a_block_drops_untuned_plans_so_their_next_call_tunes(no_gpu_plans, tuner) -> None:
    x = _x(no_gpu_plans, 4)
    before = _plan(x)
    assert before.choice.source == "default" and _plan(x) is before and not tuner.calls
    with ckgen.tuning(trials=2):
        inside = _plan(x)
    assert inside is not before and inside.choice.source == "tuned"
    assert [c[3] for c in tuner.calls] == [2]
    with ckgen.tuning():  # tried already: nothing dropped, nothing tuned again
        assert _plan(x) is inside
    assert len(tuner.calls) == 1


def test_opening_a_block_keeps_plans_of_problems_tried_already(no_gpu_plans, monkeypatch) -> None:
    bad = FakeTuner(fail=RuntimeError("compile error"))
    monkeypatch.setattr(online, "tuner", bad)
    x = _x(no_gpu_plans, 5)
    with pytest.warns(OnlineTuningWarning):
        with ckgen.tuning():
            failed = _plan(x)
    with ckgen.tuning():
        assert _plan(x) is failed
    assert len(bad.calls) == 1


def test_after_a_fatal_failure_opening_a_block_drops_nothing(no_gpu_plans, monkeypatch) -> None:
    bad = FakeTuner(fail=NoGPUError("no usable GPU"))
    monkeypatch.setattr(online, "tuner", bad)
    with pytest.warns(OnlineTuningWarning):
        with ckgen.tuning():
            first = _plan(_x(no_gpu_plans, 6))
    other = _plan(_x(no_gpu_plans, 7))  # built outside a block, after online tuning stopped
    with ckgen.tuning():
        assert _plan(_x(no_gpu_plans, 6)) is first and _plan(_x(no_gpu_plans, 7)) is other
    assert len(bad.calls) == 1


# ------------------------------------------------------------------ the GPU tuner's glue, with fakes


def test_tune_on_device_glue_with_a_fake_gpu(monkeypatch) -> None:
    """tune_on_device with CuPy, the device, the harness and the timer faked: the real objective
    compiles ahead in threads (no worker process), waits for the caller's GPU work first, frees
    CuPy's pool after, records every measurement, and returns the winner's entry."""
    from ckgen.runtime import bench, verify
    from ckgen.model import records
    from ckgen.runtime import target as targetmod
    from ckgen.runtime.bench import Timing
    from ckgen.runtime.verify import Check

    events: list[str] = []
    rt = SimpleNamespace(deviceSynchronize=lambda: events.append("sync"), runtimeGetVersion=lambda: 13000,
                         driverGetVersion=lambda: 13010)
    pool = SimpleNamespace(free_all_blocks=lambda: events.append("free"))
    cupy = SimpleNamespace(__version__="14.0-fake", cuda=SimpleNamespace(runtime=rt), get_default_memory_pool=lambda: pool)
    monkeypatch.setattr(targetmod, "require_cupy", lambda what="": cupy)
    monkeypatch.setattr(targetmod, "device_info", lambda device=None: DeviceInfo(SM90, "fake GPU", 132, 50 << 20))

    class FakeHarness:
        def __init__(self, op, problem, seed=None):
            events.append("harness")

        def runner(self, src, config, target):
            run = lambda: None  # noqa: E731
            run.config = config
            return run

        def check(self, run):
            return Check(True, "")

    class FakeTimer:
        def __init__(self, l2_bytes):
            pass

        def time(self, run):
            t = _synthetic(run.config)
            return Timing(t, t, t, 25)

    compiled: list[str] = []

    def compile_in_thread(src, target):
        compiled.append(threading.current_thread().name)
        return None

    monkeypatch.setattr(verify, "Harness", FakeHarness)
    monkeypatch.setattr(bench, "Timer", FakeTimer)
    monkeypatch.setattr(online, "_compile", compile_in_thread)
    from ckgen.runtime import compile as ck_compile

    pool_before = ck_compile._pool
    p = problem(N=8, layout="nhwc")
    e = online.tune_on_device(OP, p, device=0, trials=4, max_seconds=None)
    assert events[:2] == ["sync", "harness"] and events[-1] == "free"
    assert e.ident == (OP.name, "sm_90", p.key()) and e.device == "fake GPU"
    prov = e.provenance_dict()
    assert prov["tuned_by"] == "online" and prov["cupy"] == "14.0-fake" and prov["cuda_driver"] == 13010
    assert prov["trials"] == 4 and e.time_us == pytest.approx(_synthetic(Config.of(e.config_dict())))
    assert compiled and all(name.startswith("ckgen-compile") for name in compiled)  # threads, not processes
    assert ck_compile._pool is pool_before  # no compile pool (processes) was started
    recs = records.read(records.user_records_path())
    assert len([r for r in recs if r["phase"] == "trial"]) == 4 and any(r["phase"] == "final" for r in recs)
