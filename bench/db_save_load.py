"""What a save into a large user DB costs, and the first call of a new process after it (no GPU).

    python bench/db_save_load.py [--entries 20000] [--saves 3]

Builds a user DB of --entries GroupNorm forward entries (a merged team DB: ~750 bytes an entry, as
the packaged DB's), in a fresh cache dir, and runs one first call in a new process (the caches of
the templates and the shipped DB, as any earlier process leaves them). Then, --saves times: `db.save_entries` of one new entry (the CPU it
takes, in this process: what a `ckgen tune`, online tuning or `db pull` pays under the DB's lock),
then, in a fresh interpreter, the first call's DB work (`ckgen.explain` of a problem the DB holds,
with --arch: the dispatcher loads the user DB layered over the shipped one; the CPU of the call,
after `import ckgen`).

Prints the CPU seconds of each save and of each first call, and the DB's size."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckgen.ops import get_op  # noqa: E402
from ckgen.runtime import db  # noqa: E402

OP = get_op("groupnorm_fwd")

FIRST_CALL = """
import json, sys, time
import ckgen
t = time.process_time()
choice = ckgen.explain("groupnorm_fwd", arch="sm_90", **json.loads(sys.argv[1]))
print(time.process_time() - t, choice.source)
"""
REPO = Path(__file__).resolve().parents[1]


def problems(n: int) -> list:
    """n distinct GroupNorm forward problems (batch, channels, size, dtype, layout)."""
    shapes = itertools.product(range(1, 1000), (32, 64, 128, 256, 320, 512, 640, 960, 1280, 1920), (8, 16, 32, 64),
                               ("bf16", "fp16", "fp32"), ("nhwc", "nchw"))
    return [OP.parse_problem(N=b, C=c, H=hw, W=hw, G=32, dtype=dt, layout=lay)
            for b, c, hw, dt, lay in itertools.islice(shapes, n)]


def entry(problem, i: int) -> db.Entry:
    return db.Entry(op=OP.name, vendor="cuda", arch="sm_90", device="NVIDIA H200", problem=problem.key(),
                    config=OP.space.default.items, instance=OP.instance_name(problem, OP.space.default),
                    source_sha256=f"{i:064x}", time_us=10.0 + i % 997 / 10, gbps=1000.0 + i % 89,
                    default_time_us=30.0, spread=0.01,
                    provenance={"ckgen": "0.1.0", "cupy": "14.2.0", "cuda_runtime": 13020, "cuda_driver": 13000,
                                "date": "2026-11-29T10:00:00+00:00", "trials": 40, "tuning_seconds": 93.7,
                                "host": f"host-{i % 7}"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=20000)
    ap.add_argument("--saves", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckgen-db-bench-") as tmp:
        os.environ["CKGEN_CACHE_DIR"] = str(Path(tmp) / "cache")
        path = Path(tmp) / "instances.yaml"
        os.environ["CKGEN_DB"] = str(path)
        os.environ["CKGEN_MODEL"] = "off"
        every = problems(a.entries + a.saves)
        t = time.process_time()
        db.write_db(path, [entry(p, i) for i, p in enumerate(every[:a.entries])])
        print(f"built {a.entries} entries, {path.stat().st_size / 2**20:.1f} MiB, in {time.process_time() - t:.1f} s CPU")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

        def first_call(p) -> str:
            asked = json.dumps({"N": p.N, "C": p.C, "H": p.H, "W": p.W, "G": p.G, "dtype": p.dtype, "layout": p.layout})
            cpu, source = subprocess.run([sys.executable, "-c", FIRST_CALL, asked], capture_output=True, text=True,
                                         env=env, cwd=tmp, check=True).stdout.split()
            return f"{float(cpu):.2f} s CPU ({source})"

        # a process has run before (its template and shipped-DB caches are there), as on any machine in use
        print(f"first call of a new process before the saves: {first_call(every[0])}")
        for k in range(a.saves):
            p = every[a.entries + k]
            t = time.process_time()
            db.save_entries(path, [entry(p, a.entries + k)])
            save_s = time.process_time() - t
            print(f"save {k + 1}: {save_s:.2f} s CPU; first call of a new process after it: {first_call(p)}")


if __name__ == "__main__":
    main()
