"""Search quality on recorded H100 timings: a `tune.Tuner`'s search replays every exhaustive sweep of
tests/data/sweeps at 20 and 40 trials over 20 seeds each, with the shipped sampler and
lookahead, seeded as `ckgen tune` seeds it (the cost model's picks and the winners of the nearest
recorded problems) but from the records without the replayed problem's
(`replay.held_out_records`, `replay.held_out_model`: the shipped records hold the sweeps), and is
scored by the best config found / the exhaustive best.

The two first-format GroupNorm-forward sweeps hold only merge=cluster configs: the replay
searches the recorded configs alone (`Sweep.covers`) and the table says so. The pooling sweeps
(max/avg, fwd/bwd, both layouts, the ResNet stem) and the twelve GroupNorm sweeps (forward and
backward, NCHW and NHWC, at 2x320x32x32, 2x320x64x64 and 1x256x256x256) cover today's spaces; a
sweep still being measured ("complete": false) is not replayed.

Target: >= 90% of runs within 3% of the best at 40 trials, >= 70% at 20, over all runs.
On every sweep alone it is not met: those are strict xfails, and floors (every run within 6% at 40
trials, 9% at 20, and >= 75% of the 20-trial runs within 3%) guard against regressions. The
replays are the quality tier (`python3 -m pytest -m quality`), but for the test of the seeding;
the table of every cell is printed."""
from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest

from ckgen.tuner.replay import load_sweep, replay, replay_sweeps, sweep_paths, sweeps

SWEEPS = Path(__file__).resolve().parent / "data" / "sweeps"
SEEDS = range(20)
WITHIN = 1.03
TARGET = {40: 0.90, 20: 0.70}


@pytest.fixture(scope="module")
def results():
    sws = sweeps(SWEEPS)
    if not sws:
        pytest.skip("no recorded sweep under tests/data/sweeps")
    # one worker process per core: 880 replays of independent searches
    out = replay_sweeps(sws, sorted(TARGET), SEEDS, jobs=os.cpu_count() or 1)
    lines = ["", "replayed search (shipped sampler): best found / exhaustive best, 20 seeds per cell"]
    for sw in sws:
        fixed = ", ".join(f"{k}={v}" for k, v in sorted(sw.filled.items())) or "none"
        lines.append(f"  {sw.name}: {len(sw.times)} recorded configs searched, {sw.unrecorded} valid configs of "
                     f"today's space unrecorded and not searched (knobs fixed by the recording: {fixed})")
    lines.append(f"  {'sweep':<28} {'trials':>6} {'within 3%':>10} {'mean off':>9} {'worst off':>10}")
    for (name, trials), ratios in sorted(out.items()):
        hits = sum(r <= WITHIN for r in ratios)
        lines.append(f"  {name:<28} {trials:>6} {hits:>4}/{len(ratios):<5} {100 * (statistics.mean(ratios) - 1):>8.1f}% "
                     f"{100 * (max(ratios) - 1):>9.1f}%")
    for trials, want in sorted(TARGET.items()):
        runs = [r for (_, t), rs in out.items() if t == trials for r in rs]
        hits = sum(r <= WITHIN for r in runs)
        lines.append(f"  summary {trials} trials: {hits}/{len(runs)} runs ({100 * hits / len(runs):.0f}%) within 3% "
                     f"of the best (target {100 * want:.0f}%)")
    print("\n".join(lines))
    return out


def _patch_where_tune_looks(monkeypatch, name, value):
    """`name` replaced in ckgen.model, where ckgen/tuner/tune.py looks it up."""
    from ckgen import model

    monkeypatch.setattr(model, name, value)


def test_replay_seeds_from_the_nearest_held_out_problems_never_the_sweeps_own(monkeypatch):
    """The replay seeds as `ckgen tune` does, with the winners of the nearest recorded problems
    too, but from `held_out_records`: the shipped records hold the sweep, whose own winner (the
    exhaustive best) would be its nearest recorded winner."""
    from ckgen import model as cm
    from ckgen.model import records

    path = next(iter(sweep_paths(SWEEPS, "sweep-maxpool2d_bwd-nchw-*")), None)
    if path is None:
        pytest.skip("no max pool backward NCHW sweep under tests/data/sweeps")
    sw = load_sweep(path)
    own = (sw.op.name, sw.problem.key())
    shipped = records.read_cached(records.packaged_records_path())
    usable = lambda c: sw.covers(c) and bool(sw.op.validate(sw.problem, c, sw.target))  # noqa: E731
    leaked = cm.nearest_recorded_winners(shipped, sw.op, sw.problem, sw.target.arch, usable, 1)
    assert leaked[0][1] == own[1] and sw.times[leaked[0][0]] == sw.best  # what not holding out would seed
    seen = []
    real = cm.nearest_recorded_winners

    def spy(recs, *args):
        recs = list(recs)
        got = real(recs, *args)
        seen.append((sum((r["op"], r["problem"]) == own for r in recs), got))
        return got

    _patch_where_tune_looks(monkeypatch, "nearest_recorded_winners", spy)
    _, ev = replay(sw, 20, 0)
    assert len(seen) == 1
    n_own, got = seen[0]
    assert n_own == 0 and len(got) == 3 and all(key != own[1] for _, key in got)  # 3: the seed slots left
    assert {c for c, _ in got} <= set(ev.calls[:6])  # measured right after the default and the model's 2


def test_replays_remember_only_what_every_seed_asks_again():
    """A sweep's replays remember the op's and the model's answers and the seeds of a trial count
    (`replay`): each search proposes and measures what it does without them."""
    path = next(iter(sweep_paths(SWEEPS, "sweep-maxpool2d_bwd-nchw-*")), None)
    if path is None:
        pytest.skip("no max pool backward NCHW sweep under tests/data/sweeps")
    sw = load_sweep(path)
    for trials, seed in ((20, 0), (40, 1), (20, 2)):
        ratio, ev = replay(sw, trials, seed)
        plain, plain_ev = replay(sw, trials, seed, remember=False)
        assert (ratio, ev.calls) == (plain, plain_ev.calls)
    assert {"op", "model", ("picks", 20), ("picks", 40)} <= set(sw.memo)


def _share(results, trials):
    return {name: sum(r <= WITHIN for r in rs) / len(rs) for (name, t), rs in results.items() if t == trials}


@pytest.mark.quality
def test_replayed_search_at_40_trials_is_within_3pct_in_90pct_of_runs(results):
    """Issue 17's 40-trial target over all runs together."""
    runs = [r for (_, t), rs in results.items() if t == 40 for r in rs]
    assert len(runs) == 20 * len(_share(results, 40)) >= 20 * 20
    assert sum(r <= WITHIN for r in runs) >= TARGET[40] * len(runs)


@pytest.mark.quality
@pytest.mark.xfail(strict=True, reason="the 40-trial target on every sweep alone: GroupNorm bwd NHWC 2x320x64x64 "
                   "misses it (every seed ends at one config about 5% off); strict: when it passes, make it a "
                   "plain test")
def test_replayed_search_at_40_trials_is_within_3pct_in_90pct_of_runs_on_every_sweep(results):
    share = _share(results, 40)
    assert all(v >= TARGET[40] for v in share.values()), share


@pytest.mark.quality
def test_replayed_search_at_40_trials_stays_near_the_best(results):
    """What 40 trials do reach (a floor against regressions): every run within 6% of the
    exhaustive best."""
    runs = [r for (_, t), rs in results.items() if t == 40 for r in rs]
    assert max(runs) <= 1.06, {name: max(rs) for (name, t), rs in results.items() if t == 40}


@pytest.mark.quality
def test_replayed_search_at_20_trials_reaches_todays_share(results):
    """A floor under the 20-trial share of runs within 3% of the best: >= 75% (the target is 70%,
    `test_replayed_search_at_20_trials_is_within_3pct_in_70pct_of_runs`)."""
    runs = [r for (_, t), rs in results.items() if t == 20 for r in rs]
    assert sum(r <= WITHIN for r in runs) >= 0.75 * len(runs)


@pytest.mark.quality
def test_replayed_search_at_20_trials_is_within_3pct_in_70pct_of_runs(results):
    """Issue 17's 20-trial target over all runs together."""
    runs = [r for (_, t), rs in results.items() if t == 20 for r in rs]
    assert len(runs) == 20 * len(_share(results, 20)) >= 20 * 20
    assert sum(r <= WITHIN for r in runs) >= TARGET[20] * len(runs)


@pytest.mark.quality
@pytest.mark.xfail(strict=True, reason="the 20-trial target on every sweep alone: missed on some GroupNorm sweeps "
                   "(bwd NCHW 2x320x32x32, bwd NHWC 1x256x256x256, fwd NHWC 2x320x64x64) and on max pool bwd "
                   "NHWC; strict: when it passes, make it a plain test")
def test_replayed_search_at_20_trials_is_within_3pct_in_70pct_of_runs_on_every_sweep(results):
    share = _share(results, 20)
    assert all(v >= TARGET[20] for v in share.values()), share


@pytest.mark.quality
def test_replayed_search_at_20_trials_stays_near_the_best(results):
    """What 20 trials do reach (a floor against regressions, not the target): every run within 9%
    of the exhaustive best."""
    assert all(max(rs) <= 1.09 for (_, t), rs in results.items() if t == 20), \
        {name: max(rs) for (name, t), rs in results.items() if t == 20}
