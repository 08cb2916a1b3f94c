"""PDL experiment: the same kernels with griddepcontrol.wait / launch_dependents patched in,
launched plainly or with programmatic stream serialization (cuLaunchKernelEx), timed as ckgen
times (L2 flush + spin, GPU events) and back to back. Checks results against the reference."""
import ctypes, json, re, sys, time
import cupy as cp
import numpy as np
from ckgen.ops import get_op
from ckgen.instance import render_instance
from ckgen.types import Config, Target
from ckgen.verify import Harness
from ckgen.bench import Timer

cuda = ctypes.CDLL("libcuda.so.1")

class Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("val", ctypes.c_ubyte * 64)]

class LaunchConfig(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(Attr)), ("nattrs", ctypes.c_uint)]

cuda.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
PDL = Attr(); PDL.id = 6; PDL.val[0] = 1  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION

def patch(code):
    n = 0
    def rep(m):
        return m.group(0) + '\n  asm volatile("griddepcontrol.wait;" ::: "memory");\n  asm volatile("griddepcontrol.launch_dependents;");\n'
    out, n = re.subn(r"__global__ void[^{]*\{", rep, code)
    return out, n

def build(op, p, c, t, patched):
    src = render_instance(op, p, c, t)
    code = src.code
    n = 0
    if patched:
        code, n = patch(code)
    mod = cp.RawModule(code=code, options=("-std=c++17",), backend="nvrtc")
    return mod, n

def runner(h, op, p, c, t, mod, pdl):
    ws = cp.empty(max(op.workspace_bytes(p, c), 4), dtype=cp.uint8)
    ptrs = {k: a.data.ptr for k, a in {**h.dev_in, **h.dev_out}.items()}
    args = op.kernel_args(p, {**ptrs, "ws": ws.data.ptr}, h.eps)
    cargs = []
    for a in args:
        if isinstance(a, np.uint64): cargs.append(ctypes.c_uint64(int(a)))
        elif isinstance(a, np.float32): cargs.append(ctypes.c_float(float(a)))
        elif isinstance(a, (np.int32, int)): cargs.append(ctypes.c_int32(int(a)))
        elif isinstance(a, np.int64): cargs.append(ctypes.c_int64(int(a)))
        else: raise TypeError(type(a))
    params = (ctypes.c_void_p * len(cargs))(*[ctypes.cast(ctypes.pointer(x), ctypes.c_void_p) for x in cargs])
    steps = []
    for i, l in enumerate(op.launches(p, c, t)):
        k = mod.get_function(l.kernel)
        if l.shared_mem > 48 * 1024:
            k.max_dynamic_shared_size_bytes = l.shared_mem
        cfg = LaunchConfig(*l.grid, *l.block, l.shared_mem, None, None, 0)
        if pdl and i > 0:
            cfg.attrs = ctypes.pointer(PDL); cfg.nattrs = 1
        steps.append((ctypes.c_void_p(k.kernel.ptr), cfg))
    keep = (ws, cargs, params)
    def run():
        s = cp.cuda.get_current_stream().ptr
        for f, cfg in steps:
            cfg.stream = s
            r = cuda.cuLaunchKernelEx(ctypes.byref(cfg), f, params, None)
            if r: raise RuntimeError(f"cuLaunchKernelEx {r}")
        _ = keep
    return run

cases = json.loads(open(sys.argv[1]).read())
t = Target.named("sm_90")
timer = Timer(int(cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]), runs=40)
for opname, key, cfg in cases:
    op = get_op(opname); p = op.problem_from_key(key); c = Config.of(cfg)
    h = Harness(op, p, seed=1)
    res = {}
    for mode in ("plain", "patched", "patched+pdl"):
        mod, n = build(op, p, c, t, mode != "plain")
        run = runner(h, op, p, c, t, mod, mode == "patched+pdl")
        ok = h.check(run)
        for _ in range(3): ok2 = h.check(run)
        g = timer.time(run).median_us
        cp.cuda.Device().synchronize()
        for _ in range(20): run()
        cp.cuda.Device().synchronize()
        b2b = 1e9
        for _ in range(5):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            for _ in range(100): run()
            e1.record(); e1.synchronize()
            b2b = min(b2b, cp.cuda.get_elapsed_time(e0, e1) * 1000 / 100)
        res[mode] = (g, b2b)
        print(f"{opname} {key} {mode:12s} patched_kernels={n} ok={ok.ok and ok2.ok} ({ok2.detail}) gpu {g:.2f} us  back-to-back {b2b:.2f} us", flush=True)
    print(f"  -> pdl/plain gpu {res['patched+pdl'][0]/res['plain'][0]:.3f}  b2b {res['patched+pdl'][1]/res['plain'][1]:.3f}; patched/plain gpu {res['patched'][0]/res['plain'][0]:.3f}", flush=True)
