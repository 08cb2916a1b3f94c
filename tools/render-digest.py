#!/usr/bin/env python3
"""The sha256 of every rendered kernel source over a deterministic sweep, to check that a
template refactor leaves every render byte-identical (the shipped DB keys its entries on the
rendered source's sha256).

    python3 tools/render-digest.py --out before.json            # on the untouched tree
    python3 tools/render-digest.py --out after.json             # after the edit
    python3 tools/render-digest.py --diff before.json after.json  # exit 1 on any difference

The sweep, per op and target: the problems of the tuning space's default list and every grid
(GroupNorm: a deterministic sample of them, every dtype x layout x activation kept), the shipped
DB's and the timing records' problems; for each problem every valid config of the space
(GroupNorm: a deterministic sample, --gn-configs), plus the shipped DB's configs and the cost
model's winners wherever valid. A render is recorded once per distinct (instance name, render
context): the context is all a template sees, so equal contexts render equally. The shipped DB's
entries are also rendered as they are and checked against their stored source_sha256.
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ckgen.runtime import db
from ckgen import model as cm  # noqa: E402
from ckgen.codegen import render  # noqa: E402
from ckgen.ops import all_ops  # noqa: E402
from ckgen.types import Config, Target  # noqa: E402

DEFAULT_TARGETS = "sm_90,sm_80,gfx942,gfx1100"


def _shipped_entries():
    path = db.packaged_db_path()
    return db.InstanceDB.load(path).entries if path.is_file() else []


def _record_problems() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    path = ROOT / "ckgen" / "data" / "records.jsonl.gz"
    if path.is_file():
        with gzip.open(path, "rt") as f:
            for line in f:
                r = json.loads(line)
                out.setdefault(r["op"], set()).add(r["problem"])
    return out


def _problems(op, records: dict[str, set[str]], entries, gn_problems: int) -> list:
    grid = [p for g in op.grid_names() for p in op.grid_problems(g)]
    named = [op.problem_from_key(e.problem) for e in entries if e.op == op.name]
    named += [op.problem_from_key(k) for k in sorted(records.get(op.name, ()))]
    grid = list(dict.fromkeys(grid))
    if op.name.startswith("groupnorm") and len(grid) > gn_problems:
        # every (dtype, layout, activation) kept: the sample is drawn per combination
        by: dict[tuple, list] = {}
        for p in grid:
            by.setdefault((p.dtype, p.layout, p.activation), []).append(p)
        per = max(1, gn_problems // len(by))
        grid = [p for k in sorted(by) for p in
                random.Random(f"{op.name}|{k}").sample(by[k], min(per, len(by[k])))]
    return list(dict.fromkeys([*named, *grid]))


def sweep(targets: list[str], gn_problems: int, gn_configs: int, ops: list[str] | None) -> dict:
    entries = _shipped_entries()
    records = _record_problems()
    model = cm.load()
    rows: list[dict] = []
    shipped: list[dict] = []
    for e in entries:  # the shipped DB as it is
        op = next(o for o in all_ops() if o.name == e.op)
        from ckgen.instance import render_instance
        src = render_instance(op, op.problem_from_key(e.problem), Config.of(e.config_dict()), Target.named(e.arch))
        shipped.append(dict(op=e.op, target=e.arch, problem=e.problem, config=Config.of(e.config_dict()).key(),
                            sha256=src.sha256, stored=e.source_sha256, match=src.sha256 == e.source_sha256))
    for op in all_ops():
        if ops and op.name not in ops:
            continue
        t0 = time.time()
        space = op.space.enumerate()
        forced = [Config.of(e.config_dict()) for e in entries if e.op == op.name]
        if model is not None:
            forced += model.winner_configs(op)
        forced = [c for c in dict.fromkeys(forced) if op.space.check(c)]
        problems = _problems(op, records, entries, gn_problems)
        seen: set = set()
        n_valid = 0
        for arch in targets:
            target = Target.named(arch)
            for p in problems:
                valid = [c for c in space if op.validate(p, c, target)]
                n_valid += len(valid)
                if op.name.startswith("groupnorm") and len(valid) > gn_configs:
                    valid = random.Random(f"{op.name}|{arch}|{p.key()}").sample(valid, gn_configs)
                todo = list(dict.fromkeys([*[c for c in forced if op.validate(p, c, target)], *valid]))
                for c in todo:
                    name = op.instance_name(p, c)
                    ctx = op.render_context(p, c, target)
                    key = (arch, name, repr(sorted(ctx.items())))
                    if key in seen:
                        continue
                    seen.add(key)
                    src = render(op.template, name, ctx)
                    rows.append(dict(op=op.name, target=arch, problem=p.key(), config=c.key(), instance=name,
                                     sha256=src.sha256))
        print(f"{op.name}: {len(problems)} problems x {len(targets)} targets, {n_valid} valid (problem, config) "
              f"pairs, {len(seen)} distinct renders, {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: (r["op"], r["target"], r["instance"], r["problem"]))
    return dict(targets=targets, renders=rows, shipped=shipped)


def _key(r: dict) -> tuple:
    return (r["op"], r["target"], r["problem"], r["config"])


def diff(a_path: str, b_path: str) -> int:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    ra, rb = {_key(r): r["sha256"] for r in a["renders"]}, {_key(r): r["sha256"] for r in b["renders"]}
    only_a, only_b = sorted(set(ra) - set(rb)), sorted(set(rb) - set(ra))
    changed = sorted(k for k in set(ra) & set(rb) if ra[k] != rb[k])
    for k in changed[:40]:
        print("changed:", *k)
    for k in only_a[:10]:
        print(f"only in {a_path}:", *k)
    for k in only_b[:10]:
        print(f"only in {b_path}:", *k)
    stale = [s for s in b.get("shipped", []) if not s["match"]]
    for s in stale:
        print("shipped DB entry no longer matches:", s["op"], s["target"], s["problem"], s["config"])
    print(f"{len(set(ra) & set(rb))} renders compared, {len(changed)} changed, {len(only_a)} only before, "
          f"{len(only_b)} only after; shipped DB: {len(b.get('shipped', [])) - len(stale)} of "
          f"{len(b.get('shipped', []))} entries match")
    return 1 if changed or only_a or only_b or stale else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the digest JSON here")
    ap.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two digests")
    ap.add_argument("--targets", default=DEFAULT_TARGETS, help=f"comma-separated arches (default {DEFAULT_TARGETS})")
    ap.add_argument("--ops", help="comma-separated ops (default: all)")
    ap.add_argument("--gn-problems", type=int, default=48, help="GroupNorm grid problems sampled per op (default 48)")
    ap.add_argument("--gn-configs", type=int, default=150,
                    help="GroupNorm valid configs sampled per (problem, target) (default 150)")
    args = ap.parse_args(argv)
    if args.diff:
        return diff(*args.diff)
    if not args.out:
        ap.error("--out or --diff")
    doc = sweep(args.targets.split(","), args.gn_problems, args.gn_configs, args.ops.split(",") if args.ops else None)
    Path(args.out).write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")
    bad = [s for s in doc["shipped"] if not s["match"]]
    print(f"{len(doc['renders'])} renders written to {args.out}; shipped DB: {len(doc['shipped']) - len(bad)} of "
          f"{len(doc['shipped'])} entries match their stored source_sha256", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
