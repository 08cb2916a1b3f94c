"""The tuner's search loop without a GPU: a fake evaluator replays timings (synthetic ones here;
the recorded H100 sweeps in test_tune_replay.py), so budgets, valid-only proposals, results told
as they arrive, failures as data, timeout, resume, one trial per config and the final re-timing
are tested in CI."""
from __future__ import annotations

import time

import optuna
import pytest

from ckgen import db as dbmod
from ckgen.bench import Timing
from ckgen.ops import get_op
from ckgen.ops.spec import Config, Target
from ckgen.replay import ReplayEvaluator
from ckgen.sampler import STRATEGIES, make_tpe
from ckgen.tune import _Objective, final_round, finalists, search

OP = get_op("groupnorm_fwd")
SM90 = Target.named("sm_90")
PROBLEM = OP.parse_problem(N=8, C=320, H=64, W=64, G=32, dtype="bf16", layout="nhwc")
VALID = {c for c in OP.space.enumerate() if OP.validate(PROBLEM, c, SM90)}
States = optuna.trial.TrialState


class Replay(ReplayEvaluator):
    """Replays `time_of`; configs in `fail` fail; `events` logs starts and measurements in order."""

    def __init__(self, time_of, fail=(), delay: float = 0.0, noise: float = 0.0):
        super().__init__(lambda c: None if c in self.fail else time_of(c),
                         instance=lambda c: OP.instance_name(PROBLEM, c), noise=noise)
        self.fail, self.delay = set(fail), delay
        self.events: list[tuple[str, Config]] = []

    def start(self, configs):
        super().start(configs)
        self.events += [("start", c) for c in configs]

    def measure(self, config):
        self.events.append(("measure", config))
        time.sleep(self.delay)
        return super().measure(config)


def synthetic(config: Config) -> float:
    """A smooth, deterministic cost model: wide vectors and mid-size blocks are faster."""
    return 100.0 - 2.0 * config["vec_bytes"] + abs(config["threads"] - 256) / 64 + config["items"] / 4


def run(ev, trials=20, **kw):
    kw.setdefault("timeout", None)
    kw.setdefault("storage", None)
    kw.setdefault("seed", 0)
    return search(OP, PROBLEM, SM90, 132, ev, trials=trials, **kw)


def trial_configs(study, states=(States.COMPLETE,)):
    return [Config.of(t.params) for t in study.get_trials(deepcopy=False, states=states)]


def test_trial_budget_counts_measured_candidates_and_reports_progress():
    ev, seen = Replay(synthetic), []
    study, _ = run(ev, trials=20, on_trial=lambda done, total, best: seen.append((done, total)))
    assert len(ev.calls) == 20 and len(set(ev.calls)) == 20  # each config measured once
    assert seen[-1] == (20, 20) and [d for d, _ in seen] == list(range(1, 21))
    assert set(ev.started) >= set(ev.calls)  # every measured config was compiled first


def test_one_trial_per_distinct_config_and_no_invalid_trial():
    ev = Replay(synthetic)
    study, _ = run(ev, trials=40)
    complete = trial_configs(study)
    assert len(complete) == 40 == len(set(complete))  # no repeat told as a new trial
    assert len(study.trials) == 40  # nothing pruned, nothing invalid
    assert all(c in VALID for c in complete) and ev.pruned == 0


@pytest.mark.parametrize("sampler", [s for s in STRATEGIES if s != "optuna-gp"])
def test_every_sampler_proposes_only_unseen_valid_configs(sampler):
    ev = Replay(synthetic)
    study, _ = run(ev, trials=30, sampler=sampler, seed=3)
    assert len(ev.calls) == 30 == len(set(ev.calls))
    assert all(c in VALID for c in ev.calls)
    assert {t.state for t in study.trials} == {States.COMPLETE}


def test_results_are_told_as_they_arrive_with_at_most_ahead_in_flight():
    for ahead in (1, 4):
        ev = Replay(synthetic)
        run(ev, trials=24, ahead=ahead)
        in_flight, first_measure = 0, ev.events.index(("measure", ev.calls[0]))
        assert [e for e, _ in ev.events[:first_measure]] == ["start"] * ahead  # the pipeline fills
        for i, (what, _) in enumerate(ev.events):
            in_flight += 1 if what == "start" else -1
            assert 0 <= in_flight <= ahead
            if what == "start" and i > first_measure:  # a new proposal follows each result
                assert ev.events[i - 1][0] == "measure"


def test_default_config_is_measured_first():
    ev = Replay(synthetic)
    _, default_cfg = run(ev, trials=5)
    assert ev.calls[0] == default_cfg
    assert OP.validate(PROBLEM, default_cfg, SM90)


def test_failures_are_recorded_never_win_and_are_not_retried():
    probe = Replay(synthetic)
    run(probe, trials=12)
    bad = set(probe.calls[:6])  # the first configs a run measures, default included, now "fail"
    ev = Replay(synthetic, fail=bad)
    study, _ = run(ev, trials=40)
    failed = [t for t in study.trials if t.state == States.FAIL]
    assert failed and all("replayed failure" in t.user_attrs["failure"] for t in failed)
    assert {Config.of(t.params) for t in failed} <= bad
    assert Config.of(study.best_trial.params) not in bad
    assert all(ev.calls.count(c) == 1 for c in bad if c in ev.calls)  # a failure is not re-measured
    assert len(ev.failures) == len({c for c in ev.calls if c in bad})


def test_timeout_is_honoured_and_leaves_no_trial_running():
    ev = Replay(synthetic, delay=0.05)
    t0 = time.monotonic()
    study, _ = run(ev, trials=500, timeout=0.5)
    assert time.monotonic() - t0 < 0.5 + 0.05 + 5.0  # the measurement under way may finish
    assert len(ev.calls) < 60
    assert not [t for t in study.trials if t.state in (States.RUNNING, States.WAITING) and t.params]
    cancelled = [t for t in study.trials if t.user_attrs.get("cancelled")]
    assert all(t.state == States.FAIL for t in cancelled)


def test_study_resumes_from_storage(tmp_path):
    url = f"sqlite:///{tmp_path / 'studies.sqlite3'}"
    first = Replay(synthetic)
    run(first, trials=10, storage=url)
    second = Replay(synthetic)
    study, _ = run(second, trials=10, storage=url)
    complete = trial_configs(study)
    assert len(complete) == 20 == len(set(complete))  # the second run continued the first study
    assert not set(first.calls) & set(second.calls)  # and did not re-measure its configs


def test_restrict_limits_the_searched_configs():
    allowed = {c for c in VALID if c["merge"] == "cluster" and c["threads"] == 256}
    ev = Replay(synthetic)
    study, default_cfg = run(ev, trials=25, restrict=allowed.__contains__)
    assert set(ev.calls) <= allowed and default_cfg in allowed
    few = set(sorted(allowed, key=lambda c: c.key())[:5]) | {default_cfg}
    ev = Replay(synthetic)
    study, _ = run(ev, trials=50, restrict=few.__contains__)  # a budget over the space: all of it, once
    assert sorted(ev.calls, key=Config.key) == sorted(few, key=Config.key)


def test_tpe_flags_are_all_set_explicitly():
    tpe = make_tpe(seed=1, n_startup_trials=4)
    assert tpe._multivariate is True and tpe._constant_liar is True and tpe._group is False
    assert tpe._n_startup_trials == 4 and tpe._n_ei_candidates == 24
    p = tpe._parzen_estimator_parameters
    assert p.prior_weight == 1.0 and p.consider_magic_clip is True and p.consider_endpoints is False


# ----------------------------------------------------------------------------- the final round


def test_finalists_are_the_best_distinct_configs_then_the_default():
    ev = Replay(synthetic)
    study, default_cfg = run(ev, trials=20)
    best = sorted(synthetic(c) for c in set(ev.calls))
    fin = finalists(study, default_cfg, VALID, count=3)
    assert [synthetic(c) for c in fin[:3]] == best[:3]
    assert fin[-1] == default_cfg and len(fin) == len(set(fin))


class FakeHarness:
    def runner(self, src, config, target):
        return config  # the "run" stands for its config

    def check(self, run):
        return type("Check", (), {"ok": True, "detail": ""})()


class ScriptedTimer:
    """Times a config from a script of per-round medians; logs the order of timings."""

    def __init__(self, script):
        self.script, self.log = {c: list(ts) for c, ts in script.items()}, []

    def time(self, run):
        self.log.append(run)
        t = self.script[run].pop(0)
        return Timing(t, t, t, 25)


def test_final_round_retimes_fresh_interleaved_and_picks_by_median():
    ev = Replay(synthetic)
    study, default_cfg = run(ev, trials=12)
    fin = finalists(study, default_cfg, VALID, count=3)
    lucky, steady = fin[0], fin[1]
    # `lucky` had one fast timing in the search; fresh, it is slower most of the time.
    script = {c: [50.0] * 5 for c in fin}
    script[lucky] = [30.0, 49.0, 60.0, 61.0, 62.0]
    script[steady] = [48.0, 48.5, 47.5, 48.2, 70.0]
    timer = ScriptedTimer(script)
    obj = _Objective(OP, PROBLEM, SM90, FakeHarness(), timer)
    obj.measured = {c: ev.measured[c] for c in fin if c in ev.measured}  # the search's cached results
    ranked = final_round(obj, study, default_cfg, VALID, rounds=5, count=3)
    assert len(timer.log) == 5 * len(fin)  # every finalist timed fresh every round
    n = len(fin)
    rounds = [timer.log[i * n:(i + 1) * n] for i in range(5)]
    assert all(sorted(r, key=fin.index) == fin for r in rounds)  # each round times each once
    assert rounds[0] != rounds[1]  # in a rotated order
    assert ranked[0].config == steady and ranked[0].timing.median_us == 48.2
    assert ranked[0].rounds == (48.0, 48.5, 47.5, 48.2, 70.0)
    assert ranked[0].timing.spread == pytest.approx((70.0 - 47.5) / 48.2)


def test_db_entry_keeps_the_spread():
    e = dbmod.Entry(op="groupnorm_fwd", vendor="cuda", arch="sm_90", device="d", problem=PROBLEM.key(),
                    config=(("threads", 256),), instance="i", source_sha256="s", time_us=1.0, gbps=1.0,
                    default_time_us=2.0, spread=0.031)
    assert dbmod.Entry.from_dict(e.to_dict()).spread == 0.031
    old = dbmod.Entry.from_dict({k: v for k, v in e.to_dict().items() if k != "spread"})
    assert old.spread is None and "spread" not in old.to_dict()


def test_start_compiles_in_worker_processes_and_measure_waits_for_it():
    pytest.importorskip("cupy")
    from ckgen.compile import cubin_path
    from ckgen.instance import render_instance

    configs = sorted(VALID, key=lambda c: c.key())[:3]
    obj = _Objective(OP, PROBLEM, SM90, FakeHarness(), ScriptedTimer({c: [1.0] for c in configs}))
    obj.start(configs)  # returns at once; the compiles run in spawned workers
    assert set(obj.pending) == set(configs)
    for c in configs:
        m = obj.measure(c)
        assert m.timing.median_us == 1.0 and c not in obj.pending
        assert cubin_path(render_instance(OP, PROBLEM, c, SM90), "sm_90").is_file()
