"""DB entries from bench/sweep.py files: each sweep's fastest config becomes its problem's entry
where it beats, in that same sweep (same device, same run), the config of the problem's current
entry by at least --min-gain. A sweep that did not measure the current entry's config changes
nothing (there is no same-device comparison), and neither does one whose best is the current
config. Every config in a sweep was checked against the float64 reference before it was timed
(the tuner's harness: L2 flushed, median of 25).

    python bench/sweep.py --op groupnorm_bwd --key KEY --where "... or c == CURRENT" --out DIR   # on the GPU
    python tools/db-from-sweeps.py DIR/sweep-*.json.gz --db ckgen/data/instances.yaml [-o OUT.yaml]

Writes the DB (-o, default: --db in place) with the replaced and new entries; prints one line
per sweep saying what it did and why."""
from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", nargs="+", help="bench/sweep.py output files (.json.gz)")
    ap.add_argument("--db", default=str(ROOT / "ckgen" / "data" / "instances.yaml"))
    ap.add_argument("-o", "--output", help="DB file to write (default: --db)")
    ap.add_argument("--min-gain", type=float, default=0.03,
                    help="replace an entry only if the sweep's best is this much faster than its config (default 0.03)")
    ap.add_argument("--new", action="store_true", help="also add entries for problems the DB lacks")
    a = ap.parse_args()
    from ckgen import __version__
    from ckgen.runtime import db as dbmod
    from ckgen.runtime.bench import gbps
    from ckgen.instance import render_instance
    from ckgen.ops import get_op
    from ckgen.tuner.replay import read_sweep_doc
    from ckgen.types import Config, Target

    d = dbmod.InstanceDB.load(a.db)
    by_key = {(e.op, e.arch, e.problem): e for e in d.entries}
    when = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    changed: dict[tuple[str, str, str], dbmod.Entry] = {}
    for path in a.sweeps:
        doc = read_sweep_doc(path)
        op = get_op(doc["op"])
        p = op.problem_from_key(doc["problem"])
        target = Target.named(doc["arch"])
        rows = sorted(doc["rows"], key=lambda r: r[0])
        if not rows:
            print(f"{Path(path).name}: no measured config; nothing changed")
            continue
        times = {Config.of(cfg): us for us, _, cfg in rows}
        best_us, _, best_cfg = rows[0]
        best = Config.of(best_cfg)
        key = (op.name, target.arch, p.key())
        cur = by_key.get(key)
        cur_us = 0.0  # the current entry's config, timed in this sweep
        if cur is None and not a.new:
            print(f"{p.key()}: no DB entry (use --new to add one); nothing changed")
            continue
        if cur is not None:
            cur_cfg = Config.of(cur.config_dict())
            if cur_cfg not in times:
                print(f"{p.key()}: the sweep did not measure the entry's config; nothing changed")
                continue
            cur_us = times[cur_cfg]
            if best == cur_cfg or best_us > cur_us * (1 - a.min_gain):
                print(f"{p.key()}: kept {cur.instance} ({cur_us:.1f} us; sweep best {best_us:.1f} us)")
                continue
        src = render_instance(op, p, best, target)
        default = op.space.nearest_default(lambda c: bool(op.validate(p, c, target)))
        entry = dbmod.Entry(
            op=op.name, vendor=target.vendor, arch=target.arch, device=doc.get("device", ""), problem=p.key(),
            config=best.items, instance=src.name, source_sha256=src.sha256, time_us=round(best_us, 3),
            gbps=round(gbps(op.min_bytes(p), best_us), 1),
            default_time_us=round(times.get(default, 0.0), 3) if default else 0.0,
            provenance={"ckgen": __version__, "date": when, "from_sweep": Path(path).name, "configs_measured": len(rows),
                        "replaced_us": round(cur_us, 3)})
        changed[key] = entry
        was = f"{cur.instance} {cur_us:.1f} us" if cur else "no entry"
        print(f"{p.key()}: {src.name} {best_us:.1f} us (was {was})")
    entries = [changed.pop((e.op, e.arch, e.problem), e) for e in d.entries] + list(changed.values())
    dbmod.save_entries(Path(a.output or a.db), entries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
