"""Measure EVERY valid config of one problem (compiled in parallel, verified, timed) and print
the best ones per family. Answers "is the space or the sampler the limit?".

    python bench/sweep.py --shape 8,320,64,64 --groups 32 --dtype bf16 --layout nhwc [--out DIR]
    python bench/sweep.py --op maxpool2d_fwd --key 'N=64,C=64,...,idx=0' [--limit 60] [--out DIR]"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="groupnorm_fwd")
    ap.add_argument("--key", help="a problem key (any op); instead of --shape/--groups")
    ap.add_argument("--limit", type=int, default=0, help="measure at most this many configs (model order)")
    ap.add_argument("--config", action="append", default=[],
                    help="measure only this config, as JSON (repeatable); e.g. for a profiler run")
    ap.add_argument("--where", help="only configs c for which this Python expression is true, e.g. \"c['tw'] == 1\"")
    ap.add_argument("--shape")
    ap.add_argument("--groups", type=int)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--layout", default="nchw")
    ap.add_argument("--activation", default="none")
    ap.add_argument("--out")
    a = ap.parse_args()
    from ckgen.bench import Timer
    from ckgen.ops import get_op
    from ckgen.target import device_info
    from ckgen.tune import TrialFailed, _Objective
    from ckgen.verify import Harness

    info = device_info(None)
    op = get_op(a.op)
    if a.key:
        p = op.problem_from_key(a.key)
    else:
        N, C, H, W = map(int, a.shape.split(","))
        p = op.parse_problem(N=N, C=C, H=H, W=W, G=a.groups, dtype=a.dtype, layout=a.layout, activation=a.activation)
    if a.where:
        valid_all = [c for c in op.space.enumerate() if op.validate(p, c, info.target)]
        valid = [c for c in valid_all if eval(a.where, {}, {"c": c.as_dict()})][: a.limit or None]
    elif a.config:
        from ckgen.ops.spec import Config
        valid = [Config.of(json.loads(c)) for c in a.config]
    elif a.limit:
        valid = op.seed_configs(p, info.target, info.num_sms, a.limit)
    else:
        valid = [c for c in op.space.enumerate() if op.validate(p, c, info.target)]
    t0 = time.monotonic()
    timer = Timer(info.l2_bytes, warmup=2, runs=15)
    obj = _Objective(op, p, info.target, Harness(op, p), timer)
    obj.prepare(valid)
    t1 = time.monotonic()
    rows, failed = [], 0
    for c in valid:
        try:
            m = obj.measure(c)
            rows.append((m.timing.median_us, m.instance, c.as_dict()))
        except TrialFailed:
            failed += 1
    copy = timer.copy_time(op.min_bytes(p)).median_us
    rows.sort(key=lambda r: r[0])
    print(f"{p.key()}: {len(valid)} valid configs, compile {t1 - t0:.0f}s, measure {time.monotonic() - t1:.0f}s, "
          f"{failed} failed; copy {copy:.1f} us")
    for us, name, _ in rows[:12]:
        print(f"  {us:8.1f} us  eff {copy / us:.2f}  {name}")
    if rows and "slice_in" in rows[0][2]:
        fam = collections.defaultdict(list)
        for us, name, cfg in rows:
            fam[(cfg["slice_in"], cfg["cluster"], cfg.get("groups_per_block"))].append(us)
        print("best per (slice_in, cluster, groups_per_block):",
              {f"{k[0]}/c{k[1]}/g{k[2]}": round(min(v), 1) for k, v in sorted(fam.items())})
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / f"sweep-{op.name}-{p.layout}-{p.N}x{p.C}x{p.H}x{p.W}.json").write_text(
            json.dumps({"problem": p.key(), "copy_us": copy, "rows": rows}, indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
