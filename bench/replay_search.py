"""Compare the tuner's samplers on recorded exhaustive sweeps, no GPU needed: a `tune.Tuner`'s search runs
against the recorded times of every committed sweep (ckgen/tuner/replay.py), many seeds per cell, and
the table tells how close the best config found comes to the exhaustive best.

    python bench/replay_search.py [--sweeps tests/data/sweeps] [--samplers gp,tpe,random]
        [--trials 20,40] [--ahead 1,4] [--seeds 20] [--jobs 16] [--out FILE.md]

--jobs N replays N sweeps at a time, one process each (every cell of a sweep in its process, so
the sweep's held-out model is fit once there); the table is the same, rows in the same order.

A sweep recorded before some knobs joined the space is replayed on its recorded configs only
(the table says which knobs were fixed)."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cell(sw, cell: tuple[str, int, int], seeds: int) -> tuple[list[float], float]:
    """One (sampler, ahead, trials) cell of a sweep: every seed's best found / best, and the seconds."""
    from ckgen.tuner.replay import replay

    sampler, ahead, trials = cell
    t0 = time.monotonic()
    ratios = [replay(sw, trials, seed, sampler=sampler, ahead=ahead)[0] for seed in range(seeds)]
    return ratios, time.monotonic() - t0


def _sweep_cells(path: str, cells: list[tuple[str, int, int]], seeds: int) -> dict:
    """Every cell of one sweep, in a worker process (--jobs)."""
    sys.path.insert(0, str(ROOT))
    from ckgen.tuner.replay import load_sweep

    sw = load_sweep(path)
    return {cell: _cell(sw, cell, seeds) for cell in cells}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweeps", default=str(ROOT / "tests" / "data" / "sweeps"))
    ap.add_argument("--samplers", default="gp,tpe,random")
    ap.add_argument("--trials", default="20,40")
    ap.add_argument("--ahead", default="4")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--within", type=float, default=0.03, help="a run counts as a hit within this of the best")
    ap.add_argument("--jobs", type=int, default=1, help="sweeps replayed at once, one process each")
    ap.add_argument("--out", help="also write the table here (markdown)")
    a = ap.parse_args()
    from ckgen.tuner.replay import sweeps

    sws = sweeps(a.sweeps)
    lines = [f"Replayed search: best found / exhaustive best over {a.seeds} seeds per cell; "
             f"'hits' = runs within {100 * a.within:.0f}% of the best.", ""]
    for sw in sws:
        fixed = ", ".join(f"{k}={v}" for k, v in sorted(sw.filled.items())) or "none"
        lines.append(f"- {sw.name}: {sw.op.name} {sw.problem.key()} on {sw.device}; {len(sw.times)} recorded "
                     f"configs, {len(sw.failed)} failed, {sw.unrecorded} valid configs unrecorded (knobs fixed: {fixed})")
    lines += ["", "| sampler | ahead | trials | sweep | hits | mean off best | worst off best | s/run |",
              "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    cells = [(sampler, int(ahead), int(trials)) for sampler in a.samplers.split(",")
             for ahead in a.ahead.split(",") for trials in a.trials.split(",")]
    if a.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=min(a.jobs, len(sws))) as pool:
            done = dict(zip((sw.name for sw in sws),
                            pool.map(_sweep_cells, [str(sw.path) for sw in sws], [cells] * len(sws),
                                     [a.seeds] * len(sws))))
    else:
        done = {}
    for cell in cells:
        for sw in sws:
            ratios, secs = done[sw.name][cell] if sw.name in done else _cell(sw, cell, a.seeds)
            hits = sum(r <= 1 + a.within for r in ratios)
            row = (f"| {cell[0]} | {cell[1]} | {cell[2]} | {sw.name} | {hits}/{len(ratios)} "
                   f"({100 * hits / len(ratios):.0f}%) | {100 * (statistics.mean(ratios) - 1):.1f}% | "
                   f"{100 * (max(ratios) - 1):.1f}% | {secs / len(ratios):.2f} |")
            lines.append(row)
            print(row, flush=True)
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
