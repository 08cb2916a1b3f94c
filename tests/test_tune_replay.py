"""Search quality on recorded H100 timings: `tune.search` replays every committed exhaustive
sweep (bench/results/sweeps/*.json) at 20 and 40 trials over 20 seeds each, with the shipped
sampler and lookahead, seeded as `ckgen tune` seeds it (the cost model's picks and the winners of
the nearest recorded problems) but from the records without the replayed problem's
(`replay.held_out_records`, `replay.held_out_model`: the shipped records hold the sweeps), and is
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
largest spaces), neither was met over all runs (82% and 68%) while every seed came from one
model; with the nearest recorded problems' winners seeded too (`tune.model_picks`), both are
(400/440 = 91%, 341/440 = 78%). On every sweep alone they are not: those are strict xfails, and
floors at today's level guard against regressions.

The latest counts in the docstrings and xfail reasons below were tabulated with the model of
419d0d6, the refit after the bf16 rounding change (bench/results/logs/replay-2026-11-28/:
420/440 at 40 trials, 363/440 at 20). Before that they were tabulated again with the grid-s7 model (88,544 usable records; before it, with the grid-s3 model, 72,881: the grid-s4
and grid-s5/s6 refits kept every outcome). The grid-s7 refit moved two: the 20-trial runs'
worst went from 9.5% to 6.1% off (that strict xfail is a plain test again), and their share
within 3% from 341/440 to 321/440, under the 75% floor (a strict xfail then; the refit with the
smem max pool backward records brought it over the floor again, untabulated). GroupNorm bwd NCHW
2x320x32x32 is the sweep that moved: 20/20 -> 0/20 runs within 3% (5.1% off, every seed). The
single_pass NCHW bound raised in the same session does not cause it: the replays of that sweep
end 5.1% off with the old bound too (3 seeds each)."""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from ckgen.replay import load_sweep, replay, sweep_paths, sweeps

SWEEPS = Path(__file__).resolve().parent / "data" / "sweeps"
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


def test_replay_seeds_from_the_nearest_held_out_problems_never_the_sweeps_own(monkeypatch):
    """The replay seeds as `ckgen tune` does, with the winners of the nearest recorded problems
    too, but from `held_out_records`: the shipped records hold the sweep, whose own winner (the
    exhaustive best) would be its nearest recorded winner."""
    from ckgen import costmodel, records

    path = next(iter(sweep_paths(SWEEPS, "sweep-maxpool2d_bwd-nchw-*")), None)
    if path is None:
        pytest.skip("no max pool backward NCHW sweep under bench/results/sweeps")
    sw = load_sweep(path)
    own = (sw.op.name, sw.problem.key())
    shipped = records.read(records.packaged_records_path())
    usable = lambda c: sw.covers(c) and bool(sw.op.validate(sw.problem, c, sw.target))  # noqa: E731
    leaked = costmodel.nearest_recorded_winners(shipped, sw.op, sw.problem, sw.target.arch, usable, 1)
    assert leaked[0][1] == own[1] and sw.times[leaked[0][0]] == sw.best  # what not holding out would seed
    seen = []
    real = costmodel.nearest_recorded_winners

    def spy(recs, *args):
        recs = list(recs)
        got = real(recs, *args)
        seen.append((sum((r["op"], r["problem"]) == own for r in recs), got))
        return got

    monkeypatch.setattr(costmodel, "nearest_recorded_winners", spy)
    _, ev = replay(sw, 20, 0)
    assert len(seen) == 1
    n_own, got = seen[0]
    assert n_own == 0 and len(got) == 3 and all(key != own[1] for _, key in got)  # 3: the seed slots left
    assert {c for c, _ in got} <= set(ev.calls[:6])  # measured right after the default and the model's 2


def _share(results, trials):
    return {name: sum(r <= WITHIN for r in rs) / len(rs) for (name, t), rs in results.items() if t == trials}


def test_replayed_search_at_40_trials_is_within_3pct_in_90pct_of_runs(results):
    """Issue 17's 40-trial target over all runs together: 420/440 (95%) with the model of 419d0d6
    (the refit after the bf16 rounding change; tabulated per sweep in
    bench/results/logs/replay-2026-11-28/); 400/440 (91%) with the model of
    2026-11-27 after the re-tune (92,495 records; tabulated per sweep in
    bench/results/logs/replay-2026-11-27/); 420/440 (95%) with the grid-s7 model (400/440 before the grid-s3 refit; 360/440 before the nearest recorded problems' winners joined the seeds)."""
    runs = [r for (_, t), rs in results.items() if t == 40 for r in rs]
    assert sum(r <= WITHIN for r in runs) >= TARGET[40] * len(runs)


@pytest.mark.xfail(strict=True, reason="the 40-trial target on every sweep alone: met on 21 of the 22 with the model of "
                   "419d0d6 (the refit after the bf16 rounding change), not on GroupNorm bwd NHWC 2x320x64x64 "
                   "(0/20, 4.9% off, every seed at one config); 20 of the 22 with the model of "
                   "2026-11-27 after the re-tune and with the chain-term refit after it, not on GroupNorm bwd NHWC "
                   "2x320x64x64 (6.1% off) and 1x256x256x256 (4.2%), 0/20 each: every seed ends at the same config "
                   "(before: max pool bwd NHWC, 4.6%); the result moves with the seeds and the model; strict: when "
                   "it passes, make it a plain test")
def test_replayed_search_at_40_trials_is_within_3pct_in_90pct_of_runs_on_every_sweep(results):
    share = _share(results, 40)
    assert all(v >= TARGET[40] for v in share.values()), share


def test_replayed_search_at_40_trials_stays_near_the_best(results):
    """What 40 trials do reach today (a floor against regressions): every run within 6% of the
    exhaustive best. Worst 4.9% with the model of 419d0d6 (GroupNorm bwd NHWC 2x320x64x64, every
    seed). Met again with the refit of 2026-11-28 (94,186 records: the H200 grid tunes
    and sweeps joined), a plain test again; 6.1% with the model of 2026-11-27 after the re-tune
    (GroupNorm bwd NHWC 2x320x64x64, every seed: a strict xfail then); 4.6% before it, max pool
    bwd NHWC; 6.0% before the neighbour seeds."""
    runs = [r for (_, t), rs in results.items() if t == 40 for r in rs]
    assert max(runs) <= 1.06, {name: max(rs) for (name, t), rs in results.items() if t == 40}


def test_replayed_search_at_20_trials_reaches_todays_share(results):
    """A floor under the 20-trial share within 3% (363/440, 82%, with the model of 419d0d6, the
    refit after the bf16 rounding change: bench/results/logs/replay-2026-11-28/; 342/440, 78%,
    with the chain-term model of
    2026-11-27; 362/440 with the one before it; 341/440, 78%, with the grid-s3 to grid-s6
    models; 321/440, 73%, with the grid-s7 one, when this was a strict xfail; 297/440 before the
    neighbour seeds): >= 75%. The refit with the smem max pool backward records (2026-11-26, 89,730
    records) is over the floor again: the strict xfail passed in that session's CI-equivalent run
    (the count was not tabulated again). A strict xfail again after the first refit of 2026-11-28
    (H200 GroupNorm grid tunes and sweeps, the fused-at-a-grid-barrier unroll term: 322/440, 73%);
    over the floor again with the refit after the bf16 rounding change (the 475 bf16 winners
    re-timed on the H200): the strict xfail passed in the CI-equivalent run of 73fa0d1, a plain
    test again (tabulated the next session: 363/440)."""
    runs = [r for (_, t), rs in results.items() if t == 20 for r in rs]
    assert sum(r <= WITHIN for r in runs) >= 0.75 * len(runs)


def test_replayed_search_at_20_trials_is_within_3pct_in_70pct_of_runs(results):
    """Issue 17's 20-trial target over all runs together: 363/440 (82%) with the model of 419d0d6
    (bench/results/logs/replay-2026-11-28/); 342/440 (78%) with the chain-term model
    (2026-11-27, the same 92,495 records; bench/results/logs/costmodel-chain-2026-11-27/); 362/440
    (82%) with the model of 2026-11-27 after the re-tune (92,495 records); 400/440 (91%) with the one before it (90,846); 321/440 (73%) with the grid-s7 model, 341/440 (78%) with
    the grid-s3 to grid-s6 models (297/440, 68%, before the nearest recorded problems' winners joined the seeds)."""
    runs = [r for (_, t), rs in results.items() if t == 20 for r in rs]
    assert sum(r <= WITHIN for r in runs) >= TARGET[20] * len(runs)


@pytest.mark.xfail(strict=True, reason="the 20-trial target on every sweep alone: met on 18 of the 22 with the model of "
                   "419d0d6, not on GroupNorm bwd NCHW 2x320x32x32 (0/20, 3.5% off), GroupNorm bwd NHWC "
                   "1x256x256x256 (0/20, 5.5%), GroupNorm fwd NHWC 2x320x64x64 (0/20, 3.1%) and max pool bwd "
                   "NHWC (3/20, 6.2%); 17 of the 22 with the chain-term model (2026-11-27), not on avg pool fwd NCHW (0/20, 5.5% off), GroupNorm bwd NCHW 2x320x32x32 "
                   "(0/20, 5.1%), GroupNorm bwd NHWC 2x320x64x64 (0/20, 10.2%) and 1x256x256x256 (0/20, 5.5%), "
                   "and max pool bwd NHWC (2/20, 5.1%); 18 of 22 with the model before it (GroupNorm fwd NHWC "
                   "1x256x256x256 0/20 then, 20/20 now); strict: when it passes, make it a plain test")
def test_replayed_search_at_20_trials_is_within_3pct_in_70pct_of_runs_on_every_sweep(results):
    share = _share(results, 20)
    assert all(v >= TARGET[20] for v in share.values()), share


def test_replayed_search_at_20_trials_stays_near_the_best(results):
    """What 20 trials do reach (a floor against regressions, not the target): every run within 9%
    of the exhaustive best. Worst 6.2% with the model of 419d0d6 (max pool bwd NHWC). Met again
    with the refit of 2026-11-28 (94,186 records), a plain test again; missed with the two refits of 2026-11-27 after the re-tune (GroupNorm bwd NHWC
    2x320x64x64 10.2% off in every seed, a strict xfail then). Worst 7.4% with the model of 2026-11-27 (90,846 records: GroupNorm bwd
    NHWC 2x320x64x64, every seed; GroupNorm fwd NHWC 1x256x256x256 0.8%), a plain test again
    after a strict xfail from the pipelined-backward refit (90,714 records, 2026-11-26: that
    sweep ended 9.5% off in every run). Worst 6.1% with the grid-s7 model (GroupNorm bwd NHWC 2x320x64x64; a
    plain test again). Missed from the grid-s3 to the grid-s6 refit (9.5%, GroupNorm fwd NHWC
    1x256x256x256, a strict xfail then); before them the worst was 6.4%, GroupNorm bwd NCHW
    2x320x32x32; 25.8%, max pool bwd NHWC, before the neighbour seeds."""
    assert all(max(rs) <= 1.09 for (_, t), rs in results.items() if t == 20), \
        {name: max(rs) for (name, t), rs in results.items() if t == 20}
