"""Issue 5's GPU check of `ckgen retune`: a DB holding entries for another arch only.

    python bench/retune_check.py OUT_DIR [--trials 20] [--total-timeout 150]

No DB tuned on another GPU exists in this repo, so the check relabels the shipped DB's entries
(H100, sm_90) as sm_80 entries in a fresh DB file, with the shipped DB switched off. Then
`ckgen retune` must re-tune every problem on this GPU, warm-started from those (relabelled)
winners, write entries for this GPU's arch, and report old config here vs new winner."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import yaml


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--from-arch", default="sm_80")
    ap.add_argument("--trials", default="20")
    ap.add_argument("--total-timeout", default="150")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shipped = Path(__file__).resolve().parents[1] / "ckgen" / "data" / "instances.yaml"
    doc = yaml.safe_load(shipped.read_text())
    for e in doc["entries"]:
        e["target"]["arch"] = args.from_arch
        e["target"]["device"] = f"{e['target']['device']} (relabelled {args.from_arch} for this check)"
    db = out / "retune_db.yaml"
    db.write_text(yaml.safe_dump(doc, sort_keys=True))
    print(f"{db}: {len(doc['entries'])} entries, all for {args.from_arch}")
    env = dict(os.environ, CKGEN_SHIPPED_DB=str(out / "no-shipped-db.yaml"), COLUMNS="220")
    r = subprocess.run([sys.executable, "-m", "ckgen.cli", "--db", str(db), "retune", "--trials", args.trials,
                        "--total-timeout", args.total_timeout], env=env)
    after = yaml.safe_load(db.read_text())["entries"]
    archs = sorted({e["target"]["arch"] for e in after})
    print(f"after retune: {len(after)} entries, archs {archs}")
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
