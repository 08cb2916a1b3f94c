"""How `ckgen tune --workers` scales on the GPUs this machine shows (issue 50): the same tune (op,
problems, trials, seed) run as one process (`ckgen tune`), as `--workers 1` and as `--workers auto`
(one worker per visible GPU), each with fresh caches (its own kernel cache, study storage, DB and
records: every candidate is compiled and measured again). GPU only.

    python3 bench/workers_scaling.py [--op groupnorm_bwd] [--trials 20] [--runs one,1,auto]
                                     [--out bench/results] [-- PROBLEM OPTIONS OF ckgen tune]

Without problem options: the op's default problems (what `ckgen tune OP` tunes). After `--`, any of
`ckgen tune`'s problem options (`--grid`, `--shape ... --groups ...`, `--dtype`, `--layout`).
`--runs` may also name other worker counts (`--runs one,1,2,auto`: 2 workers share one GPU where
there is one). Prints a table (wall seconds, speedup against one process, winners the same as one
process's) and writes it, with each problem's winners, to OUT/<date>-workers-scaling-<device>.md (bench/reports.py names it; and
.json: every run's `ckgen tune --format json` document and its wall time)."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_tune(op: str, trials: int, workers: str, extra: list[str], tmp: Path, seed: int) -> dict[str, Any]:
    """One `ckgen tune` in a subprocess with fresh caches under `tmp`: its JSON document, wall
    time and exit code."""
    tmp.mkdir(parents=True)
    db = tmp / "db.yaml"
    env = {**os.environ, "CKGEN_CACHE_DIR": str(tmp / "cache"), "CKGEN_KERNEL_CACHE": str(tmp / "kernels"),
           "CKGEN_DB": str(db)}
    cmd = [sys.executable, "-m", "ckgen", "tune", op, *extra, "--trials", str(trials), "--seed", str(seed),
           "--db", str(db), "--storage", f"sqlite:///{tmp / 'studies.sqlite3'}", "--format", "json"]
    if workers != "one":
        cmd += ["--workers", workers]
    log = tmp / "stderr.log"
    t0 = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    wall = time.monotonic() - t0
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        doc = {}
    if proc.returncode != 0:
        print(f"  `{' '.join(cmd[3:])}` exited with {proc.returncode}; its last output:\n"
              + "".join(log.read_text().splitlines(keepends=True)[-15:]), file=sys.stderr)
    return {"runs": workers, "command": " ".join(["ckgen", *cmd[3:]]), "wall_s": round(wall, 1),
            "exit": proc.returncode, "doc": doc}


def winners(run: dict[str, Any]) -> dict[str, tuple[str, float]]:
    """problem -> (winning instance, its time in us) of a run."""
    return {r["problem"]: (r["instance"], r["time_us"]) for r in run["doc"].get("results", [])}


def label(runs: str, gpus: int) -> str:
    if runs == "one":
        return "one process"
    if runs == "auto":
        return f"--workers auto ({gpus} {'GPU' if gpus == 1 else 'GPUs'})"
    return f"--workers {runs}"


def main() -> int:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[: argv.index("--")]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="groupnorm_bwd")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default="one,1,auto", help="comma-separated: one (no --workers), N, auto")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    from ckgen.tuner import workers as wk
    from ckgen.runtime.compile import cpu_count
    from ckgen.runtime.target import device_info

    gpus = len(wk.visible_devices())
    if gpus == 0:
        print("no GPU visible: this script times tuning on the GPU", file=sys.stderr)
        return 2
    name = device_info(None).name
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    print(f"{args.op}, {args.trials} trials, problems: {' '.join(extra) or 'the default ones'}; "
          f"{gpus} x {name}, {cpu_count()} CPUs", flush=True)
    done: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ckgen-workers-scaling-") as tmp:
        for i, r in enumerate(runs):
            run = run_tune(args.op, args.trials, r, extra, Path(tmp) / f"{i}-{r}", args.seed)
            done.append(run)
            print(f"{label(r, gpus)}: {run['wall_s']:.1f} s, {len(run['doc'].get('results', []))} problems tuned"
                  + ("" if run["exit"] == 0 else f", exit code {run['exit']}"), flush=True)
    base = next((d for d in done if d["runs"] == "one"), done[0])
    ref = winners(base)
    lines = [f"| run | wall s | speedup vs {label(base['runs'], gpus)} | problems tuned | same winner | "
             "winner's time vs its (geomean) |", "|---|---:|---:|---:|---:|---:|"]
    for d in done:
        w = winners(d)
        common = [k for k in w if k in ref]
        same = sum(w[k][0] == ref[k][0] for k in common)
        ratio = math.exp(sum(math.log(w[k][1] / ref[k][1]) for k in common) / len(common)) if common else float("nan")
        lines.append(f"| {label(d['runs'], gpus)} | {d['wall_s']:.1f} | {base['wall_s'] / d['wall_s']:.2f}x | "
                     f"{len(w)} | {same}/{len(common)} | {ratio:.3f} |")
    table = "\n".join(lines)
    print("\n" + table)
    keys = sorted({k for d in done for k in winners(d)})
    per = ["| problem | " + " | ".join(label(d["runs"], gpus) for d in done) + " |",
           "|---|" + "---|" * len(done)]
    for k in keys:
        cells = [f"{winners(d)[k][0]} {winners(d)[k][1]:.2f} us" if k in winners(d) else "-" for d in done]
        per.append(f"| {k} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "bench"))
    from reports import report_stem  # bench/reports.py

    stem = out / report_stem("workers-scaling", name)
    cmdline = " ".join(["python3", "bench/workers_scaling.py", *sys.argv[1:]])
    stem.with_suffix(".md").write_text(
        f"# `ckgen tune --workers` scaling: {args.op}, {args.trials} trials\n\n"
        f"`{cmdline}` on {gpus} x {name}, {cpu_count()} CPUs. Every run with fresh caches (kernels, study "
        "storage, DB, records); winners compared with the first run's (each run re-times its own "
        "finalists, so a different winner within a few percent is timing noise).\n\n"
        f"{table}\n\nCommands:\n\n" + "\n".join(f"- `{d['command']}`" for d in done)
        + "\n\n## Winners\n\n" + "\n".join(per) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"op": args.op, "trials": args.trials, "problems": extra,
                                                     "gpus": gpus, "device": name, "cpus": cpu_count(),
                                                     "runs": done}, indent=1) + "\n")
    print(f"\nwrote {stem.with_suffix('.md')} and .json")
    return 0 if all(d["exit"] == 0 for d in done) else 1


if __name__ == "__main__":
    sys.exit(main())
