"""Do the pooling forward's recorded NHWC instances spill? Offline, no GPU: every NHWC max/avg pool
forward instance in a records file is compiled with NVRTC for sm_90 at its own launch bounds
(`ptxas -v`: registers, spill-store bytes), with today's `_regs_needed` estimate beside it,
and joined with the records' H100 times (`best_ratio`: the instance's best time over the fastest
recorded config of its problem; `wins`: the problems it was fastest on). One JSON line per
instance in tests/data/pool-spill-sm90-nvrtc.jsonl.gz; resumes where it stopped (the join
is redone for every line).

    PYTHONPATH=. python3 tools/pool-spill-study.py [--records FILE] [--workers N]

The records default to the shipped ones. An instance no longer in them (a refit that changes
`_regs_needed` drops configs that no longer validate) keeps the join made when it was.
tests/test_pool_regs.py reads the output. Findings (2026-11-25, 3,442 instances of the
67,098-record set): 439 spill; none of them was any problem's fastest; their median best_ratio
is 1.38 against 1.18 for the rest. With the Inception average pools' records (3,818 instances):
448 spill, still none the fastest (median 1.37 against 1.16); `validate` admits 144 of them. With
the DenseNet average pools' records (3,989 instances): 457 spill, none the fastest (median 1.36
against 1.15); `validate` admits 153."""
from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "tests" / "data" / "pool-spill-sm90-nvrtc.jsonl.gz"
OPS = ("maxpool2d_fwd", "avgpool2d_fwd")


def build(job: tuple[str, str, dict]) -> dict | None:
    from ckgen.offline import library
    from ckgen.instance import render_instance
    from ckgen.ops import get_op
    from ckgen.ops.spec import Config, Target

    name, key, cd = job
    t = Target.named("sm_90")
    op = get_op(name)
    p, c = op.problem_from_key(key), Config.of(cd)
    src = render_instance(op, p, c, t, check=False)  # a config validate rejects is studied too
    built = library.build([library.Instance(name, t, c, src, (key,))], jobs=1)[0]
    if not built.ok:
        return None
    return dict(op=name, instance=src.name, problem=key, config=cd,
                regs=max(r["registers"] for r in built.report.values()),
                spill=max(r["spill_stores"] for r in built.report.values()), est=op._regs_needed(p, c))


def main() -> int:
    from ckgen.model import records
    from ckgen.ops import get_op
    from ckgen.ops.spec import Config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=Path, default=records.packaged_records_path())
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    recs = [r for r in records.read(args.records) if r.get("ok") and r.get("time_us")]
    best: dict[tuple, float] = collections.defaultdict(lambda: float("inf"))
    for r in recs:
        best[(r["op"], r["problem"])] = min(best[(r["op"], r["problem"])], r["time_us"])
    jobs: dict[str, tuple] = {}
    ratios: dict[str, list] = collections.defaultdict(list)
    for r in recs:
        if r["op"] in OPS and "layout=nhwc" in r["problem"]:
            op = get_op(r["op"])
            name = op.instance_name(op.problem_from_key(r["problem"]), Config.of(r["config"]))
            jobs.setdefault(name, (r["op"], r["problem"], r["config"]))
            ratios[name].append((r["time_us"] / best[(r["op"], r["problem"])], r["problem"]))
    rows = {}
    if OUT.exists():
        rows = {d["instance"]: d for d in map(json.loads, gzip.decompress(OUT.read_bytes()).decode().splitlines())}
    todo = [j for n, j in sorted(jobs.items()) if n not in rows]
    print(f"{len(jobs)} instances; {len(todo)} to build", file=sys.stderr, flush=True)
    with cf.ProcessPoolExecutor(args.workers) as ex:
        for i, d in enumerate(ex.map(build, todo, chunksize=4)):
            if d:
                rows[d["instance"]] = d
            if i % 200 == 199:
                print(f"  {i + 1}/{len(todo)}", file=sys.stderr, flush=True)
    for name in sorted(rows):
        d = rows[name]
        op = get_op(d["op"])
        d["est"] = op._regs_needed(op.problem_from_key(d["problem"]), Config.of(d["config"]))  # today's
        rs = ratios.get(name, [])
        if rs:
            d["best_ratio"] = round(min(x for x, _ in rs), 4)
            d["wins"] = sorted({k for x, k in rs if x <= 1.0})
        else:  # not in these records (a refit dropped configs validate now rejects): keep the join made with the records that had it
            d.setdefault("best_ratio", None)
            d.setdefault("wins", [])
    records.write_gz(OUT, (rows[name] for name in sorted(rows)))  # deterministic bytes
    spill = [d for d in rows.values() if d["spill"] > 0]
    print(f"wrote {OUT}: {len(rows)} instances, {len(spill)} spill", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
