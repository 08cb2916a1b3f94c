"""GroupNorm forward, merge=global configs: where the time goes. For each problem (its shipped
winner): the whole call's GPU time (L2 flushed before), the stats kernel's, and the two
kernels with an event between them (stats | gap + normalize). Copy time of the op's bytes and
of x alone (the stats kernel's floor) in the same run."""
import json, sys, os
import numpy as np, cupy as cp
sys.path.insert(0, os.getcwd())
from ckgen.ops import get_op
from ckgen.ops.spec import Config, Target
from ckgen.ops.numeric import to_storage
from ckgen.instance import render_instance
from ckgen.compile import load_kernel
from ckgen.bench import Timer
from ckgen.db import InstanceDB
from pathlib import Path
T = Target.named("sm_90")
op = get_op("groupnorm_fwd")
db = InstanceDB.load(Path("ckgen/data/instances.yaml"))
keys = sys.argv[2:]
l2 = cp.cuda.Device().attributes.get("L2CacheSize", 50 << 20)
timer = Timer(l2, runs=40)
out = []
for pk in keys:
    p = op.problem_from_key(pk)
    e = next(e for e in db.entries if e.op == "groupnorm_fwd" and e.problem == pk and e.arch == "sm_90")
    c = Config.of(e.config_dict())
    src = render_instance(op, p, c, T)
    ls = op.launches(p, c, T)
    fns = [load_kernel(src, T, symbol=l.kernel) for l in ls]
    rng = np.random.default_rng(0)
    x = cp.asarray(to_storage(rng.standard_normal(p.numel).astype(np.float32), p.dtype))
    g = cp.asarray(to_storage(np.ones(p.C, np.float32), p.dtype)); b = cp.asarray(to_storage(np.zeros(p.C, np.float32), p.dtype))
    y = cp.empty_like(x); mean = cp.empty(p.N * p.G, cp.float32); rstd = cp.empty_like(mean)
    ws = cp.zeros(max(1, op.workspace_bytes(p, c) // 4), cp.float32)
    args = (x, g, b, y, mean, rstd, ws, np.int32(p.C), np.int32(p.H * p.W), np.int32(p.G), np.float32(1e-5))
    def launch(i):
        l = ls[i]; fns[i](l.grid, l.block, args, shared_mem=l.shared_mem)
    t_full = timer.time(lambda: [launch(i) for i in range(len(ls))])
    t_first = timer.time(lambda: launch(0))
    # stats | normalize with an event between (flush before each run)
    mids = []
    for i in range(40):
        timer.flush(i)
        a, m, z = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
        a.record(); launch(0); m.record()
        for j in range(1, len(ls)): launch(j)
        z.record(); z.synchronize()
        mids.append((cp.cuda.get_elapsed_time(a, m) * 1e3, cp.cuda.get_elapsed_time(m, z) * 1e3))
    mids.sort(key=lambda t: t[0] + t[1]); s1, s2 = mids[len(mids) // 2]
    nbytes = op.min_bytes(p)
    cp_full = timer.copy_time(nbytes); cp_x = timer.copy_time(nbytes // 2)
    hb = timer.back_to_back(lambda: [launch(i) for i in range(len(ls))], gpu_us=None)
    row = dict(problem=pk, instance=src.name, launches=len(ls), grid=ls[0].grid[0], block=ls[0].block[0],
               gpu_us=round(t_full.median_us, 2), first_kernel_us=round(t_first.median_us, 2),
               event_split_us=[round(s1, 2), round(s2, 2)], copy_us=round(cp_full.median_us, 2),
               copy_half_us=round(cp_x.median_us, 2), raw_back_to_back_us=round(hb.median_us, 2))
    print(json.dumps(row), flush=True); out.append(row)
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
