"""Tune a spread of a model grid into a user DB, leaving out every held-out shape (issue 11's broad
shipped DB, tuned across sessions).

`ckgen tune OP --grid NAME --skip-tuned` tunes a grid in its YAML order, and would tune the
held-out shapes of bench/heldout.yaml too (the SD grids hold some). This script takes the same
grid problems, drops every problem whose *shape* is held out for the op's family (GroupNorm: N, C,
H, W, G in any dtype, layout or activation and any GroupNorm op; pooling: the pooling op's shape and
window in any dtype or layout), so that no tuned sibling of a held-out problem reaches the DB
either, then shuffles them with a fixed seed, so that a run cut short by --budget has tuned an even
spread of the grid rather than its first rows, and later runs go on (problems with a usable entry
for this arch in the DB in effect are skipped, as with --skip-tuned).

    CKGEN_DB=/tmp/grid.yaml python3 bench/grid_tune.py groupnorm_fwd --grid sd15-unet \\
        --dtype fp16 --dtype bf16 --layout nhwc --trials 20 --budget 400

Winners go to the user DB ($CKGEN_DB), every measured trial to the records file beside it.
Merge them into the shipped DB with `ckgen db merge`, copy the records under
bench/results/tuning/ and rebuild the records and model with tools/build_records.py.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def family(op_name: str) -> str:
    return "groupnorm" if op_name.startswith("groupnorm") else op_name.replace("_bwd", "").replace("_fwd", "")


def shape_key(op_name: str, key: str) -> tuple:
    """A problem key without dtype, layout, activation and the index/backward options: its shape."""
    drop = {"dtype", "layout", "act", "idx", "indices"}
    return (family(op_name),) + tuple(kv for kv in key.split(",") if kv.split("=")[0] not in drop)


def heldout_shapes() -> set[tuple]:
    import heldout

    out = set()
    for case in heldout.load_cases():
        op, p = heldout.problem_of(case)
        out.add(shape_key(op.name, p.key()))
    return out


def plan(op_name: str, grid: str, dtypes, layouts, acts, seed: int = 0, batches=None):
    """(problems to tune in order, how many held-out-shape problems were left out); batches: only
    those batch sizes (N)."""
    from ckgen.ops import get_op

    op = get_op(op_name)
    problems = op.grid_problems(grid, dtypes, layouts, acts)
    if batches:
        problems = [p for p in problems if p.N in batches]
    held = heldout_shapes()
    keep = [p for p in problems if shape_key(op.name, p.key()) not in held]
    random.Random(seed).shuffle(keep)
    return op, keep, len(problems) - len(keep)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op")
    ap.add_argument("--grid", required=True)
    ap.add_argument("--dtype", action="append")
    ap.add_argument("--layout", action="append")
    ap.add_argument("--activation", action="append")
    ap.add_argument("--batch", type=int, action="append", help="only these batch sizes (repeatable)")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run")
    ap.add_argument("--seed", type=int, default=0, help="the shuffle's seed")
    ap.add_argument("--list", action="store_true", help="print the plan, tune nothing")
    args = ap.parse_args()
    op, problems, dropped = plan(args.op, args.grid, args.dtype, args.layout, args.activation, args.seed, args.batch)
    if args.list:
        for p in problems:
            print(p.key())
        print(f"{len(problems)} problems ({dropped} left out: held-out shapes)", file=sys.stderr)
        return 0
    from ckgen.runtime import db as dbmod
    from ckgen import settings
    from ckgen.runtime.target import device_info
    from ckgen.tuner.tune import TuneRequest, db_entry, tune_problem

    info = device_info(None)
    arch = info.target.arch
    db_path = settings.user_db_path()
    layered = dbmod.load_layered(db_path)
    todo = []
    for p in problems:
        e = layered.lookup(op.name, arch, p.key())
        if e is None or not dbmod.entry_verified(e):
            todo.append(p)
    print(f"{op.name} grid {args.grid}: {len(problems)} problems ({dropped} held-out shapes left out), "
          f"{len(problems) - len(todo)} already tuned, {len(todo)} to go; DB {db_path}", flush=True)
    start, done = time.monotonic(), 0
    for p in todo:
        left = None if args.budget is None else args.budget - (time.monotonic() - start)
        if left is not None and left <= 5:
            print("budget spent", flush=True)
            break
        try:
            r = tune_problem(TuneRequest.on(op, p, info, trials=args.trials, timeout=left), info)
        except RuntimeError as e:
            print(f"{p.key()}: {e}", flush=True)
            continue
        dbmod.save_entries(db_path, [db_entry(r, info)])
        done += 1
        print(f"{p.key()}\t{r.best.instance}\t{r.best.timing.median_us:.1f} us\t{r.seconds:.1f} s", flush=True)
    print(f"tuned {done} of {len(todo)} in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
