"""Diagnose avgpool2d_bwd NHWC on a GPU: the dispatcher's config and 24 sampled gather configs
against the float64 reference, at a few shapes, through the harness (packed buffers, NaN-poisoned
output)."""
import itertools, sys
import numpy as np
from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.runtime.target import current_target
from ckgen.runtime.verify import Harness
op = get_op("avgpool2d_bwd")
t = current_target()
for N, C, H, W in [(2, 64, 112, 112), (16, 64, 112, 112), (64, 64, 112, 112)]:
    p = op.parse_problem(N=N, C=C, H=H, W=W, kernel=3, stride=2, padding=1, dtype="bf16", layout="nhwc")
    h = Harness(op, p, seed=0)
    bad = []
    import random
    cfgs = [c for c in op.space.enumerate() if op.validate(p, c, t) and c["algo"] == "gather" and c["min_blocks"] == 1
            and c["threads"] == 256]
    from ckgen.runtime.dispatch import dispatcher
    chosen = dispatcher().choose(op, p, t)[0].config  # what the dispatcher runs for this shape
    cfgs = [chosen] + random.Random(0).sample([c for c in cfgs if c != chosen], min(24, len(cfgs) - 1))
    for c in cfgs:
        chk = h.check(h.runner(render_instance(op, p, c, t), c, t))
        if not chk.ok:
            bad.append(f"{c.key()} {chk.detail}")
    print((N, C, H, W), f"{len(bad)} of {len(cfgs)} wrong", *bad[:6], sep="\n  ", flush=True)
