"""Search quality on recorded H100 timings: `tune.search` replays every committed exhaustive
sweep (bench/results/sweeps/*.json) at 20 and 40 trials over 20 seeds each, with the shipped
sampler and lookahead, seeded as `ckgen tune` seeds it but from a cost model fit without the
replayed problem's records (`replay.held_out_model`: the shipped records hold the sweeps), and is
scored by the best config found / the exhaustive best.

The two first-format GroupNorm-forward sweeps predate merge=global: they hold every
merge=cluster config and none of the merge=global ones, so the replay searches only the recorded
configs (`Sweep.covers`) and says so in the table. The pooling sweeps (max/avg, fwd/bwd, both
layouts, N=64 C=64 112x112 k3 s2 p1 bf16: the ResNet stem; the two NHWC forward ones measured
again after the loads-first change) and the twelve GroupNorm sweeps of bench/sweeps.sh
(forward and backward, NCHW and NHWC, at 2x320x32x32, 2x320x64x64 and 1x256x256x256) cover
today's spaces; a sweep still being measured ("complete": false) is not replayed.
Target (issue 17): >= 90% of runs within 3% of the best at 40 trials, >= 70% at 20. Since the
four NHWC GroupNorm sweeps at SD and large size joined (5,055-7,673 valid configs each, the
largest spaces), neither is met over all runs: those targets are strict xfails, and floors at
today's level guard against regressions."""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from ckgen.replay import replay, sweeps

SWEEPS = Path(__file__).resolve().parents[1] / "bench" / "results" / "sweeps"
SEEDS = range(20)
WITHIN = 1.03
TARGET = {40: 0.90, 20: 0.70}


@pytest.fixture(scope="module")
def results():
    sws = sweeps(SWEEPS)
    if not sws:
        pytest.skip("no recorded sweep under bench/results/sweeps")
    out = {(sw.name, trials): [replay(sw, trials, seed)[0] for seed in SEEDS] for sw in sws for trials in TARGET}
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


def _share(results, trials):
    return {name: sum(r <= WITHIN for r in rs) / len(rs) for (name, t), rs in results.items() if t == trials}


@pytest.mark.xfail(strict=True, reason="issue 17's 40-trial target over all runs: 360/440 (82%) over the 22 sweeps "
                   "(it was 340/360 over 18 before the NHWC GroupNorm SD and large sweeps joined); missed on GroupNorm "
                   "fwd NHWC 2x320x32x32 and 2x320x64x64, bwd NHWC 1x256x256x256 and max pool bwd NHWC (0/20 each, "
                   "3.5-6.0% off); strict: when it passes, make it a plain test")
def test_replayed_search_at_40_trials_is_within_3pct_in_90pct_of_runs(results):
    """Issue 17's 40-trial target over all runs together."""
    runs = [r for (_, t), rs in results.items() if t == 40 for r in rs]
    assert sum(r <= WITHIN for r in runs) >= TARGET[40] * len(runs)


@pytest.mark.xfail(strict=True, reason="the 40-trial target on every sweep alone: met on 18 of the 22, not on GroupNorm "
                   "fwd NHWC 2x320x32x32 (6.0% off) and 2x320x64x64 (5.2%), GroupNorm bwd NHWC 1x256x256x256 (3.5%) "
                   "and max pool bwd NHWC (4.6%), 0/20 each: every seed ends at the same config; the result moves "
                   "with the model's seeds; strict: when it passes, make it a plain test")
def test_replayed_search_at_40_trials_is_within_3pct_in_90pct_of_runs_on_every_sweep(results):
    share = _share(results, 40)
    assert all(v >= TARGET[40] for v in share.values()), share


def test_replayed_search_at_40_trials_stays_near_the_best(results):
    """What 40 trials do reach today (a floor against regressions): every run within 7% of the
    exhaustive best (worst today 6.0%, GroupNorm fwd NHWC 2x320x32x32)."""
    runs = [r for (_, t), rs in results.items() if t == 40 for r in rs]
    assert max(runs) <= 1.07, {name: max(rs) for (name, t), rs in results.items() if t == 40}


def test_replayed_search_at_40_trials_reaches_todays_share(results):
    """A floor under the 40-trial share within 3% (today 360/440, 82%): >= 80%."""
    runs = [r for (_, t), rs in results.items() if t == 40 for r in rs]
    assert sum(r <= WITHIN for r in runs) >= 0.80 * len(runs)


def test_replayed_search_at_20_trials_reaches_todays_share(results):
    """A floor under the 20-trial share within 3% (today 297/440, 68%): >= 65%."""
    runs = [r for (_, t), rs in results.items() if t == 20 for r in rs]
    assert sum(r <= WITHIN for r in runs) >= 0.65 * len(runs)


@pytest.mark.xfail(strict=True, reason="issue 17's 20-trial target over all runs: 297/440 (68%) over the 22 sweeps "
                   "(262/360, 73%, over 18 before the NHWC GroupNorm SD and large sweeps joined); strict: when it "
                   "passes, make it a plain test")
def test_replayed_search_at_20_trials_is_within_3pct_in_70pct_of_runs(results):
    """Issue 17's 20-trial target over all runs together."""
    runs = [r for (_, t), rs in results.items() if t == 20 for r in rs]
    assert sum(r <= WITHIN for r in runs) >= TARGET[20] * len(runs)


@pytest.mark.xfail(strict=True, reason="the 20-trial target on every sweep alone: met on 14 of the 22, not on GroupNorm "
                   "fwd NHWC at all three sizes (0/20 each, 6.0-12.4% off), GroupNorm bwd NHWC 1x256x256x256 (0/20, "
                   "4.8%) and NCHW 2x320x32x32 (0/20, 5.1%), max pool bwd NHWC (1/20) and NCHW (13/20), avg pool fwd "
                   "NHWC (7/20); strict: when it passes, make it a plain test")
def test_replayed_search_at_20_trials_is_within_3pct_in_70pct_of_runs_on_every_sweep(results):
    share = _share(results, 20)
    assert all(v >= TARGET[20] for v in share.values()), share


def test_replayed_search_at_20_trials_stays_near_the_best(results):
    """What 20 trials do reach today (a floor against regressions, not the target): every run
    within 30% of the exhaustive best (worst today: 25.8%, max pool bwd NHWC; GroupNorm fwd NHWC
    2x320x64x64 12.4%)."""
    assert all(max(rs) <= 1.30 for (_, t), rs in results.items() if t == 20), \
        {name: max(rs) for (name, t), rs in results.items() if t == 20}
