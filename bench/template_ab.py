"""Time given configs with today's templates: the A/B check of a template change. Run it once
with the old templates and once with the new (same configs, same problems, one machine), then
compare the two JSON files with --compare.

    python bench/template_ab.py --db ckgen/data/instances.yaml [--db OTHER.yaml] [--ops maxpool2d_fwd,...] \
        --out run.json
    python bench/template_ab.py --compare old.json new.json [--md out.md]

Each config is compiled, checked against the reference (the tuner's harness: fresh inputs,
poisoned outputs) and timed as the tuner times (L2 flushed, median of 25)."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def run(a) -> int:
    import yaml

    from ckgen.runtime.bench import Timer
    from ckgen.runtime.compile import compile_many
    from ckgen.instance import render_instance
    from ckgen.ops import get_op
    from ckgen.runtime.target import device_info
    from ckgen.tuner.tune import Objective, TrialFailed
    from ckgen.types import Config
    from ckgen.runtime.verify import Harness

    info = device_info(None)
    ops = set(a.ops.split(",")) if a.ops else None
    jobs = []
    for path in a.db:
        for e in yaml.safe_load(Path(path).read_text())["entries"]:
            if (ops is None or e["op"] in ops) and e["target"]["arch"] == info.target.arch:
                if get_op(e["op"]).problem_from_key(e["problem"]).numel <= a.max_numel:
                    jobs.append((Path(path).name, e["op"], e["problem"], e["config"]))
    t0 = time.monotonic()
    srcs = []
    for _, opname, key, cfg in jobs:  # compile all in parallel first (the disk cache), then time one by one
        op = get_op(opname)
        try:
            srcs.append(render_instance(op, op.problem_from_key(key), Config.of(cfg), info.target))
        except ValueError:
            pass
    compile_many(srcs, info.target)
    print(f"{len(jobs)} configs, {len(srcs)} rendered and compiled in {time.monotonic() - t0:.0f}s", flush=True)
    timer = Timer(info.l2_bytes)
    rows = []
    for i, (src, opname, key, cfg) in enumerate(jobs):
        op = get_op(opname)
        p = op.problem_from_key(key)
        c = Config.of(cfg)
        obj = Objective(op, p, info.target, Harness(op, p), timer)  # compiled above: measure loads from the cache
        row = {"db": src, "op": opname, "problem": key, "config": cfg, "copy_us": timer.copy_time(op.min_bytes(p)).median_us}
        try:
            m = obj.measure(c)
            row.update(us=m.timing.median_us, instance=m.instance)
        except TrialFailed as e:
            row.update(us=None, error=str(e)[:300])
        rows.append(row)
        print(f"[{i + 1}/{len(jobs)} {time.monotonic() - t0:.0f}s] {opname} {key}: {row.get('us')}", flush=True)
        Path(a.out).write_text(json.dumps({"device": info.name, "arch": info.target.arch, "rows": rows}, indent=0))
    return 0


def compare(a) -> int:
    old, new = (json.loads(Path(f).read_text()) for f in a.compare)
    key = lambda r: (r["db"], r["op"], r["problem"], json.dumps(r["config"], sort_keys=True))
    olds = {key(r): r for r in old["rows"]}
    lines = [f"Same configs, old vs new templates, one run each on {new['device']} (GPU time, L2 flushed, median of 25).",
             "", "| op | problem | config source | old us | new us | new/old | eff old | eff new |", "|---|---|---|---|---|---|---|---|"]
    ratios: dict[str, list[float]] = {}
    for r in new["rows"]:
        o = olds.get(key(r))
        if not o or not o.get("us") or not r.get("us"):
            continue
        q = r["us"] / o["us"]
        ratios.setdefault(f"{r['op']} {'nhwc' if 'layout=nhwc' in r['problem'] else 'nchw'}", []).append(q)
        lines.append(f"| {r['op']} | {r['problem']} | {r['db']} | {o['us']:.1f} | {r['us']:.1f} | {q:.2f} | "
                     f"{o['copy_us'] / o['us']:.2f} | {r['copy_us'] / r['us']:.2f} |")
    lines += ["", "| op, layout | configs | geomean new/old | best | worst |", "|---|---|---|---|---|"]
    for k, v in sorted(ratios.items()):
        g = math.exp(sum(map(math.log, v)) / len(v))
        lines.append(f"| {k} | {len(v)} | {g:.3f} | {min(v):.2f} | {max(v):.2f} |")
    text = "\n".join(lines) + "\n"
    if a.md:
        Path(a.md).write_text(text)
    print(text)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", action="append", default=[])
    ap.add_argument("--ops")
    ap.add_argument("--max-numel", type=int, default=20_000_000,
                    help="skip problems with more input elements (the float64 reference check is slow on the host)")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--md")
    a = ap.parse_args()
    return compare(a) if a.compare else run(a)


if __name__ == "__main__":
    sys.exit(main())
