"""Host-inclusive time per call (back to back, no flush) and GPU time of ckgen.groupnorm_bwd on the
held-out 2x48x33x17 G=1 bf16 NCHW, with whatever the DB in effect picks (run once with the shipped
DB, once with the own-best DB as CKGEN_DB):

    python3 tools/diag/groupnorm-bwd-pick-vs-own-host.py
    CKGEN_DB=bench/results/heldout/own-best-db-NVIDIA-H100-80GB-HBM3.yaml python3 tools/diag/groupnorm-bwd-pick-vs-own-host.py
"""
import os, time, torch, ckgen
dev = torch.device("cuda")
torch.manual_seed(0)
x = torch.randn(2, 48, 33, 17, device=dev, dtype=torch.bfloat16)
g = torch.randn(48, device=dev, dtype=torch.bfloat16); b = torch.randn(48, device=dev, dtype=torch.bfloat16)
dy = torch.randn_like(x)
_, mean, rstd = ckgen.groupnorm_fwd(x, g, b, 1)
f = lambda: ckgen.groupnorm_bwd(dy, x, mean, rstd, g, 1)
for _ in range(50): f()
torch.cuda.synchronize()
host = []
for r in range(7):
    t = time.perf_counter()
    for _ in range(500): f()
    torch.cuda.synchronize()
    host.append((time.perf_counter() - t) / 500 * 1e6)
gpu = []
cache = torch.empty(256 << 20, dtype=torch.int8, device=dev)
for r in range(30):
    cache.zero_()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); f(); e.record(); torch.cuda.synchronize()
    gpu.append(s.elapsed_time(e) * 1e3)
eager_host = []
xg = x.clone().requires_grad_(True); gg = g.clone().requires_grad_(True); bg = b.clone().requires_grad_(True)
def ef():
    y = torch.nn.functional.group_norm(xg, 1, gg, bg)
    return torch.autograd.grad(y, (xg, gg, bg), dy)
for _ in range(50): ef()
for r in range(7):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(500): ef()
    torch.cuda.synchronize()
    eager_host.append((time.perf_counter() - t) / 500 * 1e6)
print(f"{os.environ.get('CKGEN_DB', 'shipped')}: {ckgen.explain('groupnorm_bwd', dy, x, mean, rstd, g, 1)}")
print(f"  host-inclusive per call (median of 7 x 500): {sorted(host)[3]:.1f} us; GPU (L2 flushed, median of 30): {sorted(gpu)[15]:.1f} us; eager fwd+autograd per call {sorted(eager_host)[3]:.1f} us")
