"""Measure EVERY valid config of one problem (compiled in parallel, verified, timed) and print
the best ones per family. Answers "is the space or the sampler the limit?"; with --out, the
result is the test data the tuner's search is replayed on (tests/test_tune_replay.py).

    python bench/sweep.py --shape 8,320,64,64 --groups 32 --dtype bf16 --layout nhwc [--out DIR]
    python bench/sweep.py --op maxpool2d_fwd --key 'N=64,C=64,...,idx=0' [--limit 60] [--out DIR]
    python bench/sweep.py --op groupnorm_bwd --key KEY --out tests/data/sweeps --chunk 256

With --out and no --limit/--config/--where, the sweep is resumable: the file is rewritten after
every chunk of --chunk configs (compiled together, then measured), marked "complete": false
until the last chunk, and a rerun of the same command measures only what it lacks.
bench/sweeps.sh runs the whole set of issue 17 this way."""
from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import os
import sys
import time
from pathlib import Path


def sweep_name(op, p) -> str:
    digest = hashlib.sha256(p.key().encode()).hexdigest()[:8]
    return f"sweep-{op.name}-{p.layout}-{p.N}x{p.C}x{p.H}x{p.W}-{digest}.json.gz"


def write(path: Path, doc: dict) -> None:
    """Atomically, gzipped (ckgen.tuner.replay reads .json and .json.gz): an interrupted sweep leaves
    the last complete chunk behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as f:
        f.write(json.dumps(doc, indent=0))
    os.replace(tmp, path)


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
    ap.add_argument("--out", help="write sweep-<op>-<layout>-<NxCxHxW>-<key digest>.json.gz here")
    ap.add_argument("--chunk", type=int, default=256, help="configs per resumable chunk (with --out)")
    a = ap.parse_args()
    from ckgen.runtime.bench import Timer
    from ckgen.ops import get_op
    from ckgen.runtime.target import device_info
    from ckgen.tuner.tune import Objective, TrialFailed
    from ckgen.runtime.verify import Harness

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
    timer = Timer(info.l2_bytes)  # as the tuner times (3 warm-ups, 25 runs, L2 flushed)
    obj = Objective(op, p, info.target, Harness(op, p), timer)
    exhaustive = not (a.where or a.config or a.limit)
    path = Path(a.out) / sweep_name(op, p) if a.out else None
    rows: list = []
    failed: list = []
    if path is not None and exhaustive and path.is_file():  # resume a partial sweep
        from ckgen.tuner.replay import read_sweep_doc

        done = read_sweep_doc(path)
        if done.get("problem") == p.key() and done.get("arch") == info.target.arch:
            rows, failed = [tuple(r) for r in done["rows"]], [tuple(f) for f in done.get("failed", [])]
    seen = {json.dumps(r[2], sort_keys=True) for r in rows} | {json.dumps(f[0], sort_keys=True) for f in failed}
    todo = [c for c in valid if json.dumps(c.as_dict(), sort_keys=True) not in seen]
    print(f"{p.key()}: {len(valid)} valid configs, {len(valid) - len(todo)} already measured", flush=True)
    copy = timer.copy_time(op.min_bytes(p)).median_us
    step = a.chunk if path is not None and exhaustive else len(todo) or 1
    for i in range(0, len(todo), step):
        chunk = todo[i:i + step]
        obj.prepare(chunk)
        for c in chunk:
            try:
                m = obj.measure(c)
                rows.append((m.timing.median_us, m.instance, c.as_dict()))
            except TrialFailed as e:
                failed.append((c.as_dict(), str(e)[:300]))
        obj.measured.clear()
        obj.runners.clear()  # keep GPU memory flat over thousands of configs
        if path is not None:
            write(path, {"op": op.name, "problem": p.key(), "arch": info.target.arch, "device": info.name,
                         "num_sms": info.num_sms, "complete": exhaustive and i + step >= len(todo),
                         "configs": len(valid), "copy_us": copy, "timer": {"warmup": timer.warmup, "runs": timer.runs},
                         "rows": sorted(rows, key=lambda r: r[0]), "failed": failed})
        print(f"  {min(i + step, len(todo))}/{len(todo)} measured, {time.monotonic() - t0:.0f}s", flush=True)
    rows.sort(key=lambda r: r[0])
    print(f"{p.key()}: {len(valid)} valid configs, {time.monotonic() - t0:.0f}s, {len(failed)} failed; copy {copy:.1f} us")
    for us, name, _ in rows[:12]:
        print(f"  {us:8.1f} us  eff {copy / us:.2f}  {name}")
    if rows and "slice_in" in rows[0][2]:
        fam = collections.defaultdict(list)
        for us, name, cfg in rows:
            fam[(cfg["slice_in"], cfg["cluster"], cfg.get("groups_per_block"))].append(us)
        print("best per (slice_in, cluster, groups_per_block):",
              {f"{k[0]}/c{k[1]}/g{k[2]}": round(min(v), 1) for k, v in sorted(fam.items())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
