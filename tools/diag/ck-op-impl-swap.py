"""Where does ck_compile's extra host time on VGG-16 training come from: ckgen's call path (the
served check, the dispatcher, the CuPy launch), or the graph's structure (custom-op boundaries,
the ReLU no longer fused into the pool)? One process, one compiled converted model, whose ckgen
max pool ops' CUDA kernels are switched per round (a flag read at dispatch time):

    ckgen  - the shipped kernels (ckgen's call path);
    aten   - PyTorch's own max pool kernels behind the same ckgen ops (same graph, same op calls);
    empty  - outputs allocated, no kernel (the op call's floor: dispatcher + Python + allocation).

against torch.compile of the plain model, in interleaved rounds (bench/models.py's
`interleaved_host_ms`), ms per training step, host-inclusive; plus CUDA-event GPU time per step.

    python3 tools/diag/ck-op-impl-swap.py OUT.txt [vgg16 16x3x224x224 nhwc train]
"""
import copy
import os
import sys
import time

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch  # noqa: E402

import ckgen.torch as ct  # noqa: E402
import ckgen.torch.ops as O  # noqa: E402
import models as M  # noqa: E402

out = open(sys.argv[1], "a")
args = sys.argv[2:] or ["vgg16", "16x3x224x224", "nhwc", "train"]
name, shape, layout, mode = args[0], tuple(int(v) for v in args[1].split("x")), args[2], args[3]


def P(*a):
    print(*a, file=out, flush=True)


torch.backends.cudnn.benchmark = True
dev = torch.device("cuda")
MODE = ["ckgen"]
aten = torch.ops.aten


def fwd(x, k, s, p, d, c):
    if MODE[0] == "aten":
        return aten.max_pool2d_with_indices(x, k, s, p, d, c)[0]
    if MODE[0] == "empty":
        return torch.empty(O._pool_out_shape(x, k, s, p, d, c), device=x.device, dtype=x.dtype,
                           memory_format=O.memory_format_of(x))
    return O.cuda_maxpool2d_fwd(x, k, s, p, d, c)


def fwd_idx(x, k, s, p, d, c):
    if MODE[0] == "aten":
        return aten.max_pool2d_with_indices(x, k, s, p, d, c)
    if MODE[0] == "empty":
        fmt, shp = O.memory_format_of(x), O._pool_out_shape(x, k, s, p, d, c)
        return (torch.empty(shp, device=x.device, dtype=x.dtype, memory_format=fmt),
                torch.empty(shp, device=x.device, dtype=torch.int64, memory_format=fmt))
    return O.cuda_maxpool2d_fwd_with_indices(x, k, s, p, d, c)


def bwd(dy, x, k, s, p, d, c, indices=None):
    if MODE[0] == "aten":
        if indices is None:
            indices = aten.max_pool2d_with_indices(x, k, s, p, d, c)[1]
        return aten.max_pool2d_with_indices_backward(dy, x, k, s, p, d, c, indices)
    if MODE[0] == "empty":
        return torch.empty_like(x)
    return O.cuda_maxpool2d_bwd(dy, x, k, s, p, d, c, indices)


def reg(lib, overload, fn):
    """Override ckgen's Python CUDA kernel (torch refuses a second Python kernel for a key unless
    allowed)."""
    try:
        lib.impl(overload, fn, "CUDA", allow_override=True)
    except TypeError as e:
        raise SystemExit(f"this diagnosis needs a torch whose Library.impl takes allow_override ({e})")


lib = torch.library.Library("ckgen", "IMPL")
for op, fn in (("maxpool2d_fwd", fwd), ("maxpool2d_fwd_with_indices", fwd_idx), ("maxpool2d_bwd", bwd)):
    for overload in (op, op + "." + O.KERNEL):
        reg(lib, overload, fn)

row = M.Row(name, shape, layout, mode)
base, _ = M.build(row, torch.bfloat16, dev)
fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
x = torch.randn(row.shape, device=dev).to(torch.bfloat16).contiguous(memory_format=fmt)
conv = copy.deepcopy(base)
P(f"{name} {shape} {layout} {mode}; {torch.cuda.get_device_name()}; torch {torch.__version__}")
P(ct.convert(conv))
m_plain = copy.deepcopy(base)
m_ck = copy.deepcopy(conv)
step_plain = M.make_step(torch.compile(m_plain), m_plain, x, mode)
step_ck = M.make_step(torch.compile(m_ck, fullgraph=True), m_ck, x, mode)


def with_mode(m):
    def st():
        MODE[0] = m
        try:
            step_ck()
        finally:
            MODE[0] = "ckgen"
    return st


steps = {"compile": step_plain, "ck_compile[ckgen]": with_mode("ckgen"), "ck_compile[aten]": with_mode("aten"),
         "ck_compile[empty]": with_mode("empty")}
for st in steps.values():
    for _ in range(3):
        st()
torch.cuda.synchronize()
for rep in range(2):
    ms = M.interleaved_host_ms(steps, dev, 9, 20)
    P(f"\nrep {rep}: host-inclusive ms/step (median of 9 interleaved rounds of 20 steps)")
    for c, v in ms.items():
        P(f"  {c:20s} {v:7.3f}")
P("\nGPU ms/step (CUDA events around 20 steps, after a sync; includes any GPU idle the host causes)")
for c, st in steps.items():
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(20):
        st()
    e.record()
    torch.cuda.synchronize()
    P(f"  {c:20s} {s.elapsed_time(e) / 20:7.3f}")
# the ops' call counts per step, and host time per call under each mode
for c in ("ck_compile[ckgen]", "ck_compile[aten]", "ck_compile[empty]"):
    n = [0]
    t_acc = [0.0]

    def timed(fn):
        def w(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            t_acc[0] += time.perf_counter() - t
            n[0] += 1
            return r
        return w
    lib2 = torch.library.Library("ckgen", "IMPL")
    for op, fn in (("maxpool2d_fwd", timed(fwd)), ("maxpool2d_fwd_with_indices", timed(fwd_idx)),
                   ("maxpool2d_bwd", timed(bwd))):
        for overload in (op, op + "." + O.KERNEL):
            reg(lib2, overload, fn)
    for _ in range(20):
        steps[c]()
    torch.cuda.synchronize()
    P(f"{c}: {n[0] / 20:.0f} ckgen op calls a step, {t_acc[0] / max(n[0], 1) * 1e6:.1f} us each inside the CUDA kernel function")
    lib2._destroy()
