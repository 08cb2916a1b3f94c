"""Issue 14: why the templated regs+grid NHWC GroupNorm fwd kernel lags the hand-written prototype.
python3 scratch/prof.py time OUT.json   |  python3 scratch/prof.py ncu   (launch each kernel twice, for ncu)"""
import dataclasses, hashlib, importlib.util, json, sys
import cupy as cp
import numpy as np
from ckgen.bench import Timer
from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.target import device_info
from ckgen.verify import Harness

mode = sys.argv[1]
spec = importlib.util.spec_from_file_location("onepass", "bench/results/logs/gnfwd-nhwc-onepass-prototype-2026-11-27/onepass.py")
onepass = importlib.util.module_from_spec(spec); spec.loader.exec_module(onepass)
op = get_op("groupnorm_fwd"); info = device_info(None); T = info.target
timer = Timer(info.l2_bytes, runs=40)
D = op.space.default
KEY = "N=2,C=320,H=64,W=64,G=32,dtype=bf16,layout=nhwc,act=swish"
p = op.problem_from_key(KEY)
H = {"h": Harness(op, p, seed=0)}
rows = []

def patch(src, tag, pairs):
    code = src.code
    for a, b in pairs:
        assert a in code, (tag, a)
        code = code.replace(a, b)
    return dataclasses.replace(src, code=code, sha256=hashlib.sha256(code.encode()).hexdigest())

CONST = [("int C, int HW, int G, float eps)\n{", "int C_, int HW_, int G_, float eps)\n{\n  constexpr int C = 320, HW = 4096, G = 32;")]
NOBAR = [("while (((old ^ *reinterpret_cast<volatile unsigned*>(bar)) & 0x80000000u) == 0u) { }", "(void)old;")]
NOSHIFT = [("ks[i] = ck_to_f(x[xn + (long long)((c0 + i) / Cg) * Cg]);", "ks[i] = 0.f;"),
           ("const float mu = ck_to_f(x[xn + (long long)gi * Cg]) + dm;", "const float mu = dm;")]

def bench(name, fn, check=False):
    if mode == "ncu":
        fn(); fn(); cp.cuda.Device().synchronize(); return
    det = ""
    if check == "y":
        h = H["h"]; h.poison(); fn(); cp.cuda.Device().synchronize()
        got = op.unpack_outputs(h.problem, h.dev_out)["y"]
        det = f"y max abs err vs ref {float(cp.abs(cp.asarray(got, dtype=cp.float64) - cp.asarray(h.ref['y'], dtype=cp.float64)).max()):.4g}"
    elif check:
        chk = H["h"].check(fn); det = chk.detail if chk.ok else "FAIL " + chk.detail
    g = timer.time(fn).median_us
    b = timer.back_to_back(fn, g).median_us
    rows.append(dict(name=name, gpu_us=round(g, 2), b2b_us=round(b, 2), check=det))
    print(f"{name:80s} gpu {g:6.2f}  b2b {b:6.2f}  {det}", flush=True)

h = H["h"]
cfgs = {
    "shipped reload": D.replace(slice_in="reload", merge="global", global_split=16, groups_per_block=4, threads=256, vec_bytes=8, items=4, min_blocks=4),
    "regs gb64 t512 i8": D.replace(slice_in="regs", merge="grid", global_split=64, threads=512, vec_bytes=16, items=8),
    "regs gb32 t512 i16": D.replace(slice_in="regs", merge="grid", global_split=32, threads=512, vec_bytes=16, items=16),
}
for name, c in cfgs.items():
    src = render_instance(op, p, c, T)
    bench(f"{name} [{src.name}]", h.runner(src, c, T), check=True)
    if c["merge"] == "grid" and mode != "ncu":
        for tag, pairs in [("const", CONST), ("nobar", NOBAR), ("const+nobar", CONST + NOBAR)]:
            bench(f"{name} {tag}", h.runner(patch(src, tag, pairs), c, T), check=(tag == "const"))
    if mode == "ncu": break

# the prototype, on the harness's buffers
x, gamma, beta, y = h.dev_in["x"], h.dev_in["gamma"], h.dev_in["beta"], h.dev_out["y"]
for R, ITEMS, flag in [(16, 4, ""), (8, 8, ""), (16, 4, "NOBAR")]:
    if mode == "ncu" and flag:
        continue
    block, S = 40 * R, 4096 // (R * ITEMS); grid = 2 * S
    opts = ("-std=c++17", f"-DR={R}", f"-DITEMS={ITEMS}", "-DMINB=1") + ((f"-D{flag}",) if flag else ())
    k = cp.RawModule(code=onepass.SRC, options=opts).get_function("gn_onepass")
    ws = cp.zeros(2 * S * 32 * 2, cp.float32); bar = cp.zeros(2, cp.uint32)
    a = (x, gamma, beta, y, ws, bar, np.float32(1e-5))
    fn = lambda k=k, grid=grid, block=block, a=a: k((grid,), (block,), a)
    bench(f"prototype R{R} I{ITEMS} {flag} (block {block}, grid {grid}) regs {k.num_regs}", fn, check="y" if not flag else False)

# NCHW one-kernel regs reference (same bytes)
pn = op.problem_from_key("N=2,C=320,H=64,W=64,G=32,dtype=fp16,layout=nchw,act=none")
H["h"] = Harness(op, pn, seed=0)
cn = D.replace(slice_in="regs", threads=1024, vec_bytes=16, items=8)
src = render_instance(op, pn, cn, T)
bench(f"NCHW fp16 regs t1024 [{src.name}]", H["h"].runner(src, cn, T), check=True)
if mode != "ncu":
    json.dump(dict(device=info.name, copy_us=timer.copy_time(op.min_bytes(p)).median_us, rows=rows), open(sys.argv[2], "w"), indent=1)
