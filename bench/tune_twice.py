"""Run-to-run check of the tuner: tune the same problems twice, each run a fresh study (its own
optuna storage, no DB to warm-start from), then re-time both winners in one run, interleaved
(`tune.Objective.retime`: every round times each once, the median over rounds); the two must be
within 3% of each other. GPU only.

    python bench/tune_twice.py OUT_DIR [--trials 40] [--rounds 15]

Writes OUT_DIR/<date>-tune-twice-<device>.md and .json (bench/reports.py names them). The tuning is `tune.tune_problem`, what
`ckgen tune` runs per problem (search, then the finalists re-timed fresh)."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROBLEMS = [
    ("groupnorm_bwd", "N=8,C=320,H=64,W=64,G=32,dtype=bf16,layout=nhwc,act=none"),
    ("groupnorm_fwd", "N=8,C=320,H=64,W=64,G=32,dtype=fp16,layout=nhwc,act=swish"),
    ("groupnorm_bwd", "N=16,C=512,H=64,W=64,G=32,dtype=fp16,layout=nchw,act=none"),
    ("maxpool2d_fwd", "N=64,C=128,H=56,W=56,k=3x3,s=2x2,p=1x1,d=1x1,ceil=0,dtype=fp16,layout=nhwc,idx=1"),
    ("avgpool2d_bwd", "N=32,C=256,H=56,W=56,k=2x2,s=2x2,p=0x0,d=1x1,ceil=0,dtype=fp16,layout=nchw,cip=1,div=0"),
]
TOLERANCE = 0.03


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--limit", type=int, default=0, help="only the first N problems (0: all)")
    args = ap.parse_args()
    from ckgen.tuner import tune
    from ckgen.runtime.bench import Timer
    from ckgen.ops import get_op
    from ckgen.runtime.target import device_info
    from ckgen.runtime.verify import Harness

    info = device_info()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for op_name, key in PROBLEMS[: args.limit or None]:
        op = get_op(op_name)
        p = op.problem_from_key(key)
        winners, tune_s = [], []
        for run in (1, 2):
            with tempfile.TemporaryDirectory() as d:
                t0 = time.monotonic()
                r = tune.tune_problem(tune.TuneRequest.on(op, p, info, trials=args.trials, seed=run,
                                                            storage=f"sqlite:///{d}/studies.sqlite3"), info)
                tune_s.append(time.monotonic() - t0)
            winners.append(r.best)
            print(f"{op_name} {key} run {run}: {r.best.instance} {r.best.timing.median_us:.2f} us "
                  f"({tune_s[-1]:.0f} s)", flush=True)
        obj = tune.Objective(op, p, info.target, Harness(op, p, seed=None), Timer(info.l2_bytes))
        configs = list(dict.fromkeys(w.config for w in winners))
        final, failed = obj.retime(configs, args.rounds)
        if failed:
            raise SystemExit(f"{key}: re-timing failed: {failed}")
        t1, t2 = (final[w.config].timing.median_us for w in winners)
        off = max(t1, t2) / min(t1, t2) - 1
        rows.append({"op": op_name, "problem": key, "run1": winners[0].instance, "run2": winners[1].instance,
                     "run1_tuned_us": winners[0].timing.median_us, "run2_tuned_us": winners[1].timing.median_us,
                     "run1_us": t1, "run2_us": t2, "off": off, "same_config": len(configs) == 1,
                     "tune_s": tune_s, "ok": off <= TOLERANCE})
        print(f"  re-timed together over {args.rounds} rounds: {t1:.2f} vs {t2:.2f} us, {100 * off:.1f}% apart "
              f"-> {'ok' if off <= TOLERANCE else 'MISS'}", flush=True)
    ok = sum(r["ok"] for r in rows)
    from reports import report_stem  # bench/reports.py

    stem = report_stem("tune-twice", info.name)
    lines = [(f"# Tune twice: {info.name} ({info.target.arch}), {args.trials} trials per run, winners re-timed "
              f"together over {args.rounds} interleaved rounds"), "",
             "| op | problem | run 1 winner | run 2 winner | run 1 us | run 2 us | apart |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        same = " (same config)" if r["same_config"] else ""
        lines.append(f"| {r['op']} | {r['problem']} | {r['run1']} | {r['run2']}{same} | {r['run1_us']:.2f} | "
                     f"{r['run2_us']:.2f} | {100 * r['off']:.1f}% |")
    lines += ["", f"Within {100 * TOLERANCE:.0f}% of each other: {ok} of {len(rows)}."]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"device": info.name, "trials": args.trials,
                                                             "rounds": args.rounds, "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
