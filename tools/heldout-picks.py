"""The dispatcher's picks for the held-out problems (bench/heldout.yaml), offline (no GPU): the
shipped DB and the cost model in use, 16-byte aligned pointers (fresh torch tensors), sm_90.
With --against a bench/heldout.py JSON, says which picks differ from the ones measured there
(what a model or `validate` change moves after the last device run).

    PYTHONPATH=. python3 tools/heldout-picks.py [--against bench/results/2026-11-28-heldout-h200.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, default=None, help="a bench/heldout.py JSON whose picks to compare")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args()
    from heldout import load_cases, problem_of

    from ckgen import model
    from ckgen.runtime.db import InstanceDB
    from ckgen.instance import render_instance
    from ckgen.offline.library import spill_free
    from ckgen.ops.spec import Target

    target = Target.named(args.arch)
    db = InstanceDB.load(ROOT / "ckgen" / "data" / "instances.yaml")
    measured = {}
    if args.against:
        measured = {(r["op"], r["problem"]): r for r in json.loads(args.against.read_text())["rows"]}
    changed = 0
    for case in load_cases():
        op, p = problem_of(case)

        def usable(c, op=op, p=p):
            return (c.as_dict().get("vec_bytes", 0) <= 16) and bool(op.validate(p, c, target))

        got = model.dispatch_pick(op, p, target, db.select(op.name), usable, spill_free(op, p, target))
        name = render_instance(op, p, got[0], target).name if got else "(no model)"
        row = measured.get((op.name, p.key()))
        mark = ""
        if row is not None and row["instance"] != name:
            changed += 1
            mark = f"  CHANGED (measured {row['instance']}: {row['gpu_us']:.1f} us, own best {row.get('own_gpu_us') or 0:.1f})"
        print(f"{op.name:26} {p.key():90} {name}{mark}")
    if args.against:
        print(f"{changed} of {len(load_cases())} picks differ from {args.against}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
