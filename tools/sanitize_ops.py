"""Every op family's configs, round-robin, for compute-sanitizer (tools/sanitize.sh runs it).

    python tools/sanitize_ops.py [--configs 6] [--prepare]

Families: each registered op's `sanitize_problems` (OpSpec's hook; by default the smallest
default problem of each dtype and layout). ckgen's 8 ops: fp32/bf16 (+ fp16 for the forward ops)
x NCHW/NHWC, GroupNorm with and without swish, pooling on two geometries (one with padding,
ceil_mode and dilation) and both max-pool backward index modes; small problems with ragged tails
(odd H*W, C/G not a multiple of a vector). Per family: the space's default (or nearest valid) config, then seeded random valid
ones, each run through ckgen.runtime.verify.Harness (fresh random inputs, NaN-poisoned outputs, checked
against the float64 reference).

The order is round-robin (every family's first config, then every family's second, ...), so a
sanitizer run cut by a time limit has still covered every family. --prepare only compiles every
instance (into CKGEN_CACHE_DIR's cubin cache, in parallel), so that the run under the sanitizer
spends its time in kernels, not in NVRTC. One line per check; exit 1 if any check failed."""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def families():
    """(op, problem) for every registered op: its `sanitize_problems` (OpSpec's hook)."""
    from ckgen.ops import all_ops

    return [(op, p) for op in all_ops() for p in op.sanitize_problems()]


def configs(op, p, target, n):
    valid = [c for c in op.space.enumerate() if op.validate(p, c, target)]
    first = op.space.nearest_default(lambda c: bool(op.validate(p, c, target)))
    rest = [c for c in valid if c != first]
    random.Random(p.key()).shuffle(rest)
    return [first, *rest][:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=int, default=6, help="configs per family (default 6)")
    ap.add_argument("--prepare", action="store_true", help="only compile every instance into the cubin cache")
    ap.add_argument("--plan", default=None,
                    help="a pickle of the families and their configs: --prepare writes it, a run reads it "
                         "(enumerating the spaces takes tens of seconds; under a sanitizer, do it once)")
    args = ap.parse_args()

    import os
    import pickle

    from ckgen.runtime.compile import compile_many
    from ckgen.instance import render_instance
    from ckgen.ops import get_op
    from ckgen.runtime.target import current_target
    from ckgen.runtime.verify import Harness

    if os.environ.get("CKGEN_SANITIZE"):  # every buffer its own cudaMalloc: memcheck sees real bounds
        import cupy

        cupy.cuda.set_allocator(None)

    target = current_target()
    if args.plan and not args.prepare and Path(args.plan).exists():
        fams = [(get_op(name), p, cs) for name, p, cs in pickle.loads(Path(args.plan).read_bytes())]
    else:
        fams = [(op, p, configs(op, p, target, args.configs)) for op, p in families()]
    if args.plan and args.prepare:
        Path(args.plan).write_bytes(pickle.dumps([(op.name, p, cs) for op, p, cs in fams]))
    if args.prepare:
        srcs = [render_instance(op, p, c, target) for op, p, cs in fams for c in cs]
        failures = compile_many(srcs, target)
        print(f"compiled {len(srcs)} instances of {len(fams)} families; {len(failures)} failed")
        return 1 if failures else 0
    print(f"{len(fams)} families x up to {args.configs} configs, round-robin", flush=True)
    harness = {}
    bad = 0
    t0 = time.time()
    for r in range(max(len(cs) for _, _, cs in fams)):
        for op, p, cs in fams:
            if r >= len(cs):
                continue
            key = (op.name, p.key())
            h = harness.get(key) or harness.setdefault(key, Harness(op, p, seed=r))
            src = render_instance(op, p, cs[r], target)
            chk = h.check(h.runner(src, cs[r], target))
            bad += not chk.ok
            print(f"[{time.time() - t0:7.1f}s] round {r} {'ok  ' if chk.ok else 'FAIL'} {src.name} "
                  f"{p.key()} {'' if chk.ok else chk.detail}", flush=True)
        print(f"round {r} done: {len(fams)} families", flush=True)
    print(f"all done: {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
