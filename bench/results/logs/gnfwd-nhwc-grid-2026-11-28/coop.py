"""Cooperative vs plain launch of the same merge=grid kernels (GPU time, L2 flushed; back to back)."""
import json, sys
import cupy as cp
from ckgen.bench import Timer
from ckgen.compile import load_kernel
from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.target import device_info
from ckgen.verify import Harness
op = get_op("groupnorm_fwd"); info = device_info(None); T = info.target
timer = Timer(info.l2_bytes, runs=40)
out = {"device": info.name, "rows": []}
D = op.space.default
for key, cfgs in [
    ("N=2,C=320,H=64,W=64,G=32,dtype=bf16,layout=nhwc,act=swish", [
        D.replace(slice_in="reload", merge="global", global_split=16, groups_per_block=4, threads=256, vec_bytes=8, items=4, min_blocks=4),
        D.replace(slice_in="regs", merge="grid", global_split=64, threads=512, vec_bytes=16, items=8),
        D.replace(slice_in="regs", merge="grid", global_split=32, threads=512, vec_bytes=16, items=16),
        D.replace(slice_in="regs", merge="grid", global_split=64, threads=1024, vec_bytes=8, items=8),
        D.replace(slice_in="rows", merge="grid", global_split=32, threads=512, vec_bytes=16, items=4),
        D.replace(slice_in="rows", merge="global", global_split=32, threads=512, vec_bytes=16, items=4)]),
    ("N=4,C=320,H=32,W=32,G=32,dtype=fp16,layout=nhwc,act=swish", [
        D.replace(slice_in="regs", merge="grid", global_split=16, threads=512, vec_bytes=16, items=8)]),
    ("N=1,C=4,H=1024,W=1024,G=2,dtype=bf16,layout=nhwc,act=none", [
        D.replace(slice_in="rows", merge="grid", global_split=128, threads=1024, vec_bytes=8, items=4),
        D.replace(slice_in="rows", merge="global", global_split=128, threads=1024, vec_bytes=8, items=4)]),
]:
    p = op.problem_from_key(key)
    h = Harness(op, p)
    copy = timer.copy_time(op.min_bytes(p)).median_us
    for c in cfgs:
        assert op.validate(p, c, T), (op.instance_name(p, c), op.validate(p, c, T).reason)
        src = render_instance(op, p, c, T)
        modes = {"coop": h.runner(src, c, T)}
        if c["merge"] == "grid":
            ws = cp.zeros(op.workspace_bytes(p, c), dtype=cp.uint8)
            ptrs = {k: a.data.ptr for k, a in {**h.dev_in, **h.dev_out}.items()}
            args = op.kernel_args(p, {**ptrs, "ws": ws.data.ptr}, 1e-5)
            (l,) = op.launches(p, c, T)
            k = load_kernel(src, T, l.kernel)
            modes["plain"] = lambda k=k, l=l, args=args, ws=ws: k(l.grid, l.block, args)
        for mode, fn in modes.items():
            chk = h.check(fn)
            g = timer.time(fn).median_us
            b = timer.back_to_back(fn, g).median_us
            row = dict(problem=key, instance=op.instance_name(p, c), mode=mode, gpu_us=g, b2b_us=b, copy_us=copy, ok=chk.ok, detail=chk.detail)
            out["rows"].append(row)
            print(f"{op.instance_name(p, c):70s} {mode:5s} gpu {g:6.1f} us eff {copy / g:.2f}  b2b {b:6.1f} us  {chk.detail}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
