"""Re-time DB entries whose source a template change re-hashed: each entry's config, rendered
with today's templates, measured by bench/template_ab.py (the tuner's harness: checked against
the reference, then timed with L2 flushed, median of 25), replaces the entry's source hash,
time and bandwidth. The config stays the one the tuner chose with the old templates: a re-timed
entry is not a re-tuned one, and its provenance says so (retimed, retimed_from_us).

    python bench/template_ab.py --db AFFECTED.yaml --max-numel 60000000 --out times.json   # on the GPU
    python tools/retime-entries.py --times times.json [--db ckgen/data/instances.yaml]

Only entries on the JSON's device and arch whose (op, problem, config) it timed, with a result,
and whose stored hash no longer matches today's render, change; the rest are kept as they are.
With --other-device, entries tuned on another device of the same arch are re-timed too: the
entry's device becomes the one that timed it, its provenance keeps the device it was tuned on
(`tuned_on`), and its default_time_us stays that device's (the tuner's default-config time)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--times", required=True, help="bench/template_ab.py's JSON, run with today's templates")
    ap.add_argument("--db", default=str(ROOT / "ckgen" / "data" / "instances.yaml"))
    ap.add_argument("--other-device", action="store_true",
                    help="also re-time entries tuned on another device of the JSON's arch (see above)")
    a = ap.parse_args()
    from ckgen.runtime import db as dbmod
    from ckgen.runtime.bench import gbps
    from ckgen.instance import render_instance
    from ckgen.ops import get_op
    from ckgen.types import Config, Target

    doc = json.loads(Path(a.times).read_text())
    times = {(r["op"], r["problem"], json.dumps(r["config"], sort_keys=True)): r for r in doc["rows"]}
    when = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    d = dbmod.InstanceDB.load(a.db)
    out, changed, failed = [], 0, []
    for e in d.entries:
        r = times.get((e.op, e.problem, json.dumps(e.config_dict(), sort_keys=True)))
        if r is None or (e.device != doc["device"] and not a.other_device) or e.arch != doc["arch"] \
                or dbmod.entry_verified(e):
            out.append(e)
            continue
        if not r.get("us"):
            failed.append(f"{e.op} {e.problem}: {r.get('error', 'no time')}")
            out.append(e)
            continue
        op = get_op(e.op)
        p = op.problem_from_key(e.problem)
        src = render_instance(op, p, Config.of(e.config_dict()), Target.named(e.arch))
        us = float(r["us"])
        prov = {**e.provenance_dict(), "retimed": when, "retimed_from_us": e.time_us}
        if e.device != doc["device"]:
            prov.setdefault("tuned_on", e.device)
        out.append(dataclasses.replace(e, device=doc["device"], instance=src.name, source_sha256=src.sha256,
                                       time_us=round(us, 3), gbps=round(gbps(op.min_bytes(p), us), 1),
                                       provenance=prov, spread=None))
        changed += 1
    if failed:
        print("not re-timed (kept stale):\n  " + "\n  ".join(failed), file=sys.stderr)
    dbmod.write_db(a.db, out)
    print(f"re-timed {changed} entries of {len(d.entries)} in {a.db}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
