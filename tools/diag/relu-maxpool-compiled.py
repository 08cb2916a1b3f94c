"""Compiled ct.ReLUMaxPool2d fwd+bwd: why slower than compiled ct.MaxPool2d by far more than a relu? Variants, output code, trace.

    python3 tools/diag/relu-maxpool-compiled.py OUT.txt [VARIANT]

With VARIANT (a key of `variants`), only that one, in this process: the ckgen modules of one class
share a forward code object, so compiling several instances in one process stacks Dynamo cache
entries (a guard on `self.indices` recompiles) that every call then walks."""
import sys, time, gzip, json, os
import torch, torch.nn as nn, torch.nn.functional as F
import ckgen.torch as ct
from torch.profiler import profile, ProfilerActivity
out = open(sys.argv[1], "a")
def P(*a): print(*a, file=out, flush=True)
dev = torch.device("cuda")
x = torch.randn(2, 64, 56, 56, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
dy = torch.randn(2, 64, 28, 28, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
xg = x.clone().requires_grad_(True)
def bench(fn, n=300):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    best = []
    for r in range(5):
        t = time.perf_counter()
        for _ in range(n): fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t) / n * 1e6)
    return sorted(best)[2]
def stepf(f):
    def st():
        o = f(xg)
        o.backward(dy)
    return st
variants = {
    "ct.ReLUMaxPool2d": ct.ReLUMaxPool2d(2, 2),
    "ct.ReLUMaxPool2d recompute": ct.ReLUMaxPool2d(2, 2, indices="recompute"),
    "Seq(nn.ReLU, ct.MaxPool2d)": nn.Sequential(nn.ReLU(), ct.MaxPool2d(2, 2)),
    "ct.MaxPool2d": ct.MaxPool2d(2, 2),
    "ct.MaxPool2d then relu (lambda)": (lambda m: (lambda t: torch.relu(m(t))))(ct.MaxPool2d(2, 2)),
    "nn relu+maxpool": lambda t: F.max_pool2d(F.relu(t), 2, 2),
}
only = sys.argv[2] if len(sys.argv) > 2 else None
if only:
    variants = {only: variants[only]}
steps = {k: stepf(torch.compile(v, fullgraph=True)) for k, v in variants.items()}
for rep in range(2):
    for k, st in steps.items():
        P(f"rep {rep} compiled {k:40s} {bench(st):8.1f} us")
for k in ([] if only else ["ct.ReLUMaxPool2d", "ct.MaxPool2d"]):
    st = steps[k]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5): st()
        torch.cuda.synchronize()
    path = os.path.join(os.path.dirname(sys.argv[1]), "trace.json")
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    os.remove(path)
    cpu = sorted([e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "python_function")], key=lambda e: e["ts"])
    # last step only: from the last "Torch-Compiled Region" start
    starts = [e["ts"] for e in cpu if e["name"].startswith("Torch-Compiled Region")]
    t0 = starts[-1] if starts else cpu[0]["ts"]
    P(f"\n== {k}: events of the last step (ts rel us, dur us)")
    for e in cpu:
        if e["ts"] >= t0:
            P(f"  {e['ts'] - t0:9.1f} {e['dur']:8.1f}  {e['cat'][:8]:8s} {e['name'][:110]}")
