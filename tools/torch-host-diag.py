"""Issue 12 diagnosis: does any ckgen.torch call make the host wait for the GPU?

For each call: enqueue ~5 ms of GPU work (bf16 matmuls), then time the call on the host. A call
that returns in microseconds does not wait; one that takes ~ms waits for the queue. Then plan/
kernel-load counters over repeated steps, and a profile of converted steps listing sync-like API
calls."""
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, "bench")
import ckgen  # noqa: E402
import ckgen.runtime.compile as ccomp  # noqa: E402
import ckgen.runtime.dispatch as cd  # noqa: E402
import ckgen.torch as ct  # noqa: E402

dev = torch.device("cuda")
A = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def gpu_busy(n=3):
    for _ in range(n):
        A @ A


def host_us(fn, reps=5):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        gpu_busy()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    return sorted(out)[len(out) // 2], out


torch.cuda.synchronize()
t = time.perf_counter(); gpu_busy(); torch.cuda.synchronize()
print(f"queue length of gpu_busy(): {(time.perf_counter() - t) * 1e3:.2f} ms", flush=True)

loads = {"n": 0}
_orig_load = ccomp.load_kernel


def counting_load(*a, **k):
    loads["n"] += 1
    return _orig_load(*a, **k)


ccomp.load_kernel = counting_load

bf = torch.bfloat16
cl = torch.channels_last
x = torch.randn(2, 320, 64, 64, device=dev, dtype=bf).contiguous(memory_format=cl).requires_grad_()
xp = torch.randn(32, 64, 112, 112, device=dev, dtype=bf).contiguous(memory_format=cl).requires_grad_()
gn = ct.GroupNormSwish(32, 320).to(dev, bf)
mp = ct.MaxPool2d(3, 2, 1).to(dev)
gamma, beta = gn.weight.detach(), gn.bias.detach()
xd, xpd = x.detach(), xp.detach()

cases = {
    "torch F.max_pool2d": lambda: F.max_pool2d(xpd, 3, 2, 1),
    "ckgen.maxpool2d_fwd (raw)": lambda: ckgen.maxpool2d_fwd(xpd, 3, 2, 1),
    "torch.ops.ckgen.maxpool2d_fwd": lambda: torch.ops.ckgen.maxpool2d_fwd(xpd, [3, 3], [2, 2], [1, 1], [1, 1], False),
    "ct.MaxPool2d no-grad input": lambda: mp(xpd),
    "ct.MaxPool2d grad input (fwd)": lambda: mp(xp),
    "torch group_norm+silu": lambda: F.silu(F.group_norm(xd, 32, gamma, beta)),
    "ckgen.groupnorm_fwd (raw)": lambda: ckgen.groupnorm_fwd(xd, gamma, beta, 32, activation="swish"),
    "torch.ops.ckgen.groupnorm_fwd": lambda: torch.ops.ckgen.groupnorm_fwd(xd, gamma, beta, 32, 1e-5, "swish"),
    "ct.GroupNormSwish (fwd, grad)": lambda: gn(x),
}
for name, fn in cases.items():
    fn(); fn()
    med, all_ = host_us(fn)
    print(f"{name:34s} host {med:9.1f} us  (all {[round(v) for v in all_]})", flush=True)

# backward paths
y = mp(xp); gy = torch.randn_like(y)
g2 = gn(x); gg = torch.randn_like(g2)


def mp_bwd():
    y = mp(xp)
    torch.autograd.grad(y, xp, gy)


def gn_bwd():
    y = gn(x)
    torch.autograd.grad(y, (x, gn.weight, gn.bias), gg)


def mp_bwd_torch():
    y = F.max_pool2d(xp, 3, 2, 1)
    torch.autograd.grad(y, xp, gy)


def gn_bwd_torch():
    y = F.silu(F.group_norm(x, 32, gn.weight, gn.bias))
    torch.autograd.grad(y, (x, gn.weight, gn.bias), gg)


for name, fn in {"ct.MaxPool2d fwd+bwd": mp_bwd, "torch maxpool fwd+bwd": mp_bwd_torch,
                 "ct.GroupNormSwish fwd+bwd": gn_bwd, "torch GN+silu fwd+bwd": gn_bwd_torch}.items():
    fn(); fn()
    med, all_ = host_us(fn)
    print(f"{name:34s} host {med:9.1f} us  (all {[round(v) for v in all_]})", flush=True)

print(f"plans {len(cd._dispatcher.plans)} calls {len(cd._dispatcher.calls)} kernel loads {loads['n']}", flush=True)
n0, p0 = loads["n"], len(cd._dispatcher.plans)
for _ in range(10):
    mp_bwd(); gn_bwd()
torch.cuda.synchronize()
print(f"after 10 more steps: new plans {len(cd._dispatcher.plans) - p0} new kernel loads {loads['n'] - n0}", flush=True)

# model steps: ResBlocks 2x320x64x64 and resnet50 (one max pool), eager vs converted
from models import resblock_stack, resnet50  # noqa: E402


def step_fn(model, xin):
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        out = model(xin)
        out.float().mean().backward()
        for p in params:
            p.grad = None
    return step


def time_steps(step, n=20):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / n


def per_step_host(step, n=5):
    """host time of step() alone with the GPU kept busy beforehand (does the step wait?)"""
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        gpu_busy(6)
        t = time.perf_counter()
        step()
        out.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    return out


for label, make, shape in (("resblocks", lambda: resblock_stack(320), (2, 320, 64, 64)),
                           ("resnet50", lambda: resnet50()[0], (32, 3, 224, 224))):
    torch.manual_seed(0)
    m = make().to(dev, bf).to(memory_format=cl).train()
    xin = torch.randn(*shape, device=dev, dtype=bf).contiguous(memory_format=cl)
    e = time_steps(step_fn(m, xin))
    eh = per_step_host(step_fn(m, xin))
    rep = ct.convert(m)
    c = time_steps(step_fn(m, xin))
    chh = per_step_host(step_fn(m, xin))
    print(f"{label}: eager {e:.2f} ms/step, converted {c:.2f} ms/step; convert: {rep}", flush=True)
    print(f"  host of one step with 10 ms queued: eager {[round(v, 2) for v in eh]} converted {[round(v, 2) for v in chh]}",
          flush=True)
    from torch.profiler import ProfilerActivity, profile

    st = step_fn(m, xin)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            st()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    for ev in ka:
        n = ev.key.lower()
        if any(s in n for s in ("synchron", "malloc", "memcpy", "free", "moduleload", "query", "wait")):
            print(f"  API {ev.key:50s} count {ev.count:6d} self cpu {ev.self_cpu_time_total:10.0f} us", flush=True)
    del m, xin, prof
    torch.cuda.empty_cache()
