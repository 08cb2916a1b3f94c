"""Host us per call, back to back, of the max pool paths a compiled graph and eager take (tiny shape: host-bound)."""
import time, torch, torch.nn.functional as F
import ckgen, ckgen.torch as ct
from ckgen.torch import ops
dev = torch.device("cuda")
x = torch.randn(2, 64, 56, 56, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
k, s, p, d = [2, 2], [2, 2], [0, 0], [1, 1]
y, idx = ckgen.maxpool2d_fwd(x, (2, 2), (2, 2), (0, 0), (1, 1), False, True)
dy = torch.randn_like(y)
def bench(name, fn, n=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    best = []
    for r in range(5):
        t = time.perf_counter()
        for _ in range(n): fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t) / n * 1e6)
    print(f"{name:55s} {sorted(best)[2]:7.2f} us", flush=True)
bench("eager F.max_pool2d_with_indices", lambda: F.max_pool2d_with_indices(x, 2, 2))
bench("ckgen.maxpool2d_fwd idx (public API)", lambda: ckgen.maxpool2d_fwd(x, (2, 2), (2, 2), (0, 0), (1, 1), False, True))
bench("ops.cuda_maxpool2d_fwd_with_indices (op impl)", lambda: ops.cuda_maxpool2d_fwd_with_indices(x, k, s, p, d, False))
bench("torch.ops.ckgen.maxpool2d_fwd_with_indices", lambda: torch.ops.ckgen.maxpool2d_fwd_with_indices(x, k, s, p, d, False))
bench("torch.ops.ckgen.maxpool2d_fwd_with_indices.default", lambda: torch.ops.ckgen.maxpool2d_fwd_with_indices.default(x, k, s, p, d, False))
bench("eager aten max_pool2d_with_indices_backward", lambda: torch.ops.aten.max_pool2d_with_indices_backward(dy, x, k, s, p, d, False, idx))
bench("ckgen.maxpool2d_bwd (public API)", lambda: ckgen.maxpool2d_bwd(dy, x, (2, 2), (2, 2), (0, 0), (1, 1), False, indices=idx))
bench("torch.ops.ckgen.maxpool2d_bwd.default", lambda: torch.ops.ckgen.maxpool2d_bwd.default(dy, x, k, s, p, d, False, idx))
m = ct.ReLUMaxPool2d(2, 2)
xg = x.clone().requires_grad_(True)
def stepf(f):
    def st():
        out = f(xg)
        out.backward(dy)
    return st
bench("ct.ReLUMaxPool2d fwd+bwd eager", stepf(m), 500)
bench("nn relu+maxpool fwd+bwd eager", stepf(lambda t: F.max_pool2d(F.relu(t), 2, 2)), 500)
cm = torch.compile(m, fullgraph=True)
bench("compiled ct.ReLUMaxPool2d fwd+bwd", stepf(cm), 500)
cn = torch.compile(lambda t: F.max_pool2d(F.relu(t), 2, 2))
bench("compiled nn relu+maxpool fwd+bwd", stepf(cn), 500)
