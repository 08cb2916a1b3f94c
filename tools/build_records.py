"""Rebuild ckgen/data/records.jsonl.gz, the tuning records the package ships (ckgen/offline/shipped.py,
`build_shipped`), from the repo's sweeps, shipped DB and suite benchmarks; then refit the cost
model on them (ckgen/data/costmodel.json):

    python tools/build_records.py            # both
    python tools/build_records.py --check    # exit 1 if either file differs from a rebuild
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    args = ap.parse_args()
    import gzip
    import json

    from ckgen import model
    from ckgen.model import records
    from ckgen.offline import shipped

    recs = shipped.build_shipped(ROOT)
    rec_path = ROOT / "ckgen" / "data" / "records.jsonl.gz"
    fitted = model.fit(recs)
    model_path = ROOT / "ckgen" / "data" / "costmodel.json"
    text = model.dumps(fitted)
    if args.check:
        same_rec = rec_path.exists() and gzip.decompress(rec_path.read_bytes()).decode() == "".join(
            json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in recs)
        same_model = model_path.exists() and model_path.read_text() == text
        print(f"records {'up to date' if same_rec else 'DIFFER'}; model {'up to date' if same_model else 'DIFFERS'}")
        return 0 if same_rec and same_model else 1
    records.write_gz(rec_path, recs)
    model_path.write_text(text)
    ops: dict[str, int] = {}
    for r in recs:
        ops[r["op"]] = ops.get(r["op"], 0) + 1
    print(f"wrote {rec_path.relative_to(ROOT)}: {len(recs)} records "
          f"({', '.join(f'{k} {v}' for k, v in sorted(ops.items()))}), "
          f"{len({(r['op'], r['problem']) for r in recs})} problems")
    print(f"wrote {model_path.relative_to(ROOT)}: {model.summary()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
