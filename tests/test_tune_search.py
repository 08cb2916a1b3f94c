"""The tuner's search loop without a GPU: a fake evaluator replays timings (synthetic ones here;
the recorded H100 sweeps in test_tune_replay.py), so budgets, valid-only proposals, results told
as they arrive, failures as data, timeout, resume, one trial per config and the final re-timing
are tested in CI."""
from __future__ import annotations

import functools
import time

import optuna
import pytest

from ckgen.runtime import db as dbmod
from ckgen.runtime.bench import Timing
from ckgen.ops import get_op
from ckgen.ops.spec import Config, Target
from ckgen.tuner.replay import ReplayEvaluator
from ckgen.tuner.sampler import STRATEGIES, make_tpe
from ckgen.tuner.tune import NEIGHBOURS, Objective, Tuner, TuneRequest, final_round, finalists, model_picks

OP = get_op("groupnorm_fwd")
SM90 = Target.named("sm_90")
PROBLEM = OP.parse_problem(N=8, C=320, H=64, W=64, G=32, dtype="bf16", layout="nhwc")


@functools.cache
def valid() -> frozenset[Config]:
    """PROBLEM's valid configs (worked out on first use, not while the tests are collected)."""
    return frozenset(c for c in OP.space.enumerate() if OP.validate(PROBLEM, c, SM90))

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


def run(ev, trials=20, on_trial=None, **kw):
    """A Tuner's search (no cost model): the study and the default config."""
    kw.setdefault("model", None)
    tuner = Tuner(TuneRequest(OP, PROBLEM, SM90, trials=trials, **kw), ev, on_trial=on_trial)
    return tuner.search(), tuner.default()


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
    assert all(c in valid() for c in complete) and ev.pruned == 0


@pytest.mark.parametrize("sampler", [s for s in STRATEGIES if s != "optuna-gp"])
def test_every_sampler_proposes_only_unseen_valid_configs(sampler):
    ev = Replay(synthetic)
    study, _ = run(ev, trials=30, sampler=sampler, seed=3)
    assert len(ev.calls) == 30 == len(set(ev.calls))
    assert all(c in valid() for c in ev.calls)
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
    allowed = {c for c in valid() if c["merge"] == "cluster" and c["threads"] == 256}
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


# ------------------------------------------------------ seeds from the nearest recorded problems


def _recs(op, problem, timed, arch="sm_90"):
    """Records of `problem`: (config, time_us) pairs, timed on `arch`."""
    from ckgen.model import records

    return [records.make_record(op, problem, Target.named(arch), "test", c, ok=True, time_us=t) for c, t in timed]


def _shape(**kw):
    return OP.parse_problem(**{**dict(N=8, C=320, H=64, W=64, G=32, dtype="bf16", layout="nhwc"), **kw})


def test_seeds_hold_the_winners_of_the_nearest_recorded_problems():
    """Beside the model's picks (none here: the tests run without a model), the winners of the
    nearest recorded problems of this op and arch seed the search, nearest first, distinct."""
    from ckgen import model as cm

    assert cm.load() is None
    cfgs = sorted(valid(), key=Config.key)
    a, b, c, d, e = cfgs[3], cfgs[40], cfgs[80], cfgs[120], cfgs[160]
    near, nearer, far = _shape(N=2), _shape(N=4), _shape(N=8, layout="nchw")
    recs = (_recs(OP, near, [(a, 9.0), (b, 5.0)]) + _recs(OP, nearer, [(c, 3.0), (a, 4.0)])
            + _recs(OP, far, [(d, 1.0)]) + _recs(get_op("groupnorm_bwd"), PROBLEM, [(e, 1.0)])
            + _recs(OP, PROBLEM, [(e, 1.0)], arch="sm_80"))
    assert OP.distance(PROBLEM, nearer) < OP.distance(PROBLEM, near) < OP.distance(PROBLEM, far)
    assert model_picks(OP, PROBLEM, SM90, 40, records=recs, neighbours=2) == (c, b)  # not the other op's, arch's
    assert model_picks(OP, PROBLEM, SM90, 40, records=recs, neighbours=5) == (c, b, d)
    # a problem whose winner is not allowed is passed over (not its runner-up)
    assert model_picks(OP, PROBLEM, SM90, 40, lambda x: x != c, records=recs, neighbours=2) == (b, d)
    assert model_picks(OP, PROBLEM, SM90, 40, records=recs, neighbours=0) == ()
    assert model_picks(OP, PROBLEM, SM90, 8, records=recs, neighbours=5) == (c, b)  # 8 trials: 2 seed slots
    # a winner shared by two problems counts once
    twice = recs + _recs(OP, _shape(N=1), [(c, 0.5)])
    assert model_picks(OP, PROBLEM, SM90, 40, records=twice, neighbours=2) == (c, b)


def test_ckgen_tune_seeds_hold_the_nearest_recorded_winner_of_the_user_records():
    """`ckgen tune` (tune_problem: `model_picks` with the records in use, the shipped and the
    user's) measures the nearest recorded problem's winner right after the default."""
    from ckgen.model import records

    p = OP.parse_problem(N=3, C=96, H=40, W=24, G=24, dtype="fp32", layout="nhwc")
    valid = sorted((c for c in OP.space.enumerate() if OP.validate(p, c, SM90)), key=Config.key)
    win, other = valid[len(valid) // 2], valid[len(valid) // 3]
    before = model_picks(OP, p, SM90, 40)
    assert win not in before  # from the shipped records only
    records.append(records.user_records_path(), _recs(OP, p, [(other, 20.0), (win, 10.0)]))
    picks = model_picks(OP, p, SM90, 40)
    assert picks[0] == win and len(picks) == NEIGHBOURS == len(set(picks))  # the user's record is the nearest
    ev = ReplayEvaluator(lambda c: 50.0 + c["items"])
    tuner = Tuner(TuneRequest(OP, p, SM90, trials=12, model=None, picks=picks), ev)
    tuner.search()
    default = tuner.default()
    assert ev.calls[:2] == [default, win] or (default == win and ev.calls[0] == win)
    records.append(records.user_records_path(), _recs(OP, p, [(other, 5.0)]))  # the file changed: read again
    assert model_picks(OP, p, SM90, 40)[0] == other


# ----------------------------------------------------------------------------- the final round


def test_finalists_are_the_best_distinct_configs_then_the_default():
    ev = Replay(synthetic)
    study, default_cfg = run(ev, trials=20)
    best = sorted(synthetic(c) for c in set(ev.calls))
    fin = finalists(study, default_cfg, valid(), count=3)
    assert [synthetic(c) for c in fin[:3]] == best[:3]
    assert fin[-1] == default_cfg and len(fin) == len(set(fin))


def test_the_final_round_also_retimes_the_dispatchers_pick():
    """`finalists(also=...)`: the dispatcher's pick (`tune.dispatcher_pick`) joins the final round
    after the study's best and the default, once, and only if valid."""
    ev = Replay(synthetic)
    study, default_cfg = run(ev, trials=20)
    fin = finalists(study, default_cfg, valid(), count=3)
    slow = max((c for c in valid() if c not in fin), key=synthetic)
    assert finalists(study, default_cfg, valid(), count=3, also=(slow, default_cfg, slow)) == fin + [slow]
    outside = next(c for c in OP.space.enumerate() if c not in valid())
    assert finalists(study, default_cfg, valid(), count=3, also=(outside,)) == fin


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
    fin = finalists(study, default_cfg, valid(), count=3)
    lucky, steady = fin[0], fin[1]
    # `lucky` had one fast timing in the search; fresh, it is slower most of the time.
    script = {c: [50.0] * 5 for c in fin}
    script[lucky] = [30.0, 49.0, 60.0, 61.0, 62.0]
    script[steady] = [48.0, 48.5, 47.5, 48.2, 70.0]
    timer = ScriptedTimer(script)
    obj = Objective(OP, PROBLEM, SM90, FakeHarness(), timer)
    obj.measured = {c: ev.measured[c] for c in fin if c in ev.measured}  # the search's cached results
    ranked = final_round(obj, study, default_cfg, valid(), rounds=5, count=3)
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
    from ckgen.runtime.compile import cubin_path
    from ckgen.instance import render_instance

    configs = sorted(valid(), key=lambda c: c.key())[:3]
    obj = Objective(OP, PROBLEM, SM90, FakeHarness(), ScriptedTimer({c: [1.0] for c in configs}))
    obj.start(configs)  # returns at once; the compiles run in spawned workers
    assert set(obj.pending) == set(configs)
    for c in configs:
        m = obj.measure(c)
        assert m.timing.median_us == 1.0 and c not in obj.pending
        assert cubin_path(render_instance(OP, PROBLEM, c, SM90), "sm_90").is_file()
