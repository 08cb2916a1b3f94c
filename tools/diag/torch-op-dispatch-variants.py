"""Where do torch.ops.ckgen's ~24 us over the CUDA implementation go? Variants of the same op."""
import sys, time, torch
from typing import List
from torch import Tensor
import ckgen
from ckgen.torch import ops
out = open(sys.argv[1], "w")
def P(*a): print(*a, file=out, flush=True)
dev = torch.device("cuda")
x = torch.randn(2, 64, 56, 56, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
k, s, p, d = [2, 2], [2, 2], [0, 0], [1, 1]
y0, i0 = ckgen.maxpool2d_fwd(x, (2, 2), (2, 2), (0, 0), (1, 1), False, True)
def bench(name, fn, n=3000):
    for _ in range(100): fn()
    torch.cuda.synchronize()
    best = []
    for r in range(5):
        t = time.perf_counter()
        for _ in range(n): fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t) / n * 1e6)
    P(f"{name:60s} {sorted(best)[2]:7.2f} us")
lib = torch.library.Library("exp", "DEF")
impl = ops.cuda_maxpool2d_fwd_with_indices
def noop(x: Tensor, kernel_size: List[int], stride: List[int], padding: List[int], dilation: List[int], ceil_mode: bool) -> tuple[Tensor, Tensor]:
    return torch.empty_like(y0), torch.empty_like(i0)
schema = torch.library.infer_schema(impl, mutates_args=())
for name, fn in (("real_cxxag", impl), ("noop_cxxag", noop), ("noop_pyag", noop), ("real_pyag", impl)):
    lib.define(name + schema)
    lib.impl(name, fn, "CUDA")
C = torch._C
below = C._after_autograd_keyset
def mk(fn, opname):
    op = getattr(torch.ops.exp, opname).default
    def ak(keyset, *args, **kw):
        if C.is_grad_enabled() and C._any_requires_grad(*args):
            raise RuntimeError
        b = keyset & below
        if b.highestPriorityTypeId() == C.DispatchKey.CUDA:
            return fn(*args, **kw)
        with C._AutoDispatchBelowAutograd():
            return op.redispatch(b, *args, **kw)
    return ak
lib.impl("noop_pyag", mk(noop, "noop_pyag"), "Autograd", with_keyset=True)
lib.impl("real_pyag", mk(impl, "real_pyag"), "Autograd", with_keyset=True)
bench("empty_like x2 (python)", lambda: noop(x, k, s, p, d, False))
bench("exp.noop_cxxag (C++ autograd fallback)", lambda: torch.ops.exp.noop_cxxag.default(x, k, s, p, d, False))
bench("exp.noop_pyag (python autograd kernel)", lambda: torch.ops.exp.noop_pyag.default(x, k, s, p, d, False))
bench("exp.real_cxxag", lambda: torch.ops.exp.real_cxxag.default(x, k, s, p, d, False))
bench("exp.real_pyag", lambda: torch.ops.exp.real_pyag.default(x, k, s, p, d, False))
bench("torch.ops.ckgen.maxpool2d_fwd_with_indices.default", lambda: torch.ops.ckgen.maxpool2d_fwd_with_indices.default(x, k, s, p, d, False))
bench("ops.cuda_maxpool2d_fwd_with_indices (impl)", lambda: impl(x, k, s, p, d, False))
bench("ckgen.maxpool2d_fwd (public)", lambda: ckgen.maxpool2d_fwd(x, (2, 2), (2, 2), (0, 0), (1, 1), False, True))
bench("_not_served + _pool_fields", lambda: ops._not_served("maxpool2d_fwd", x, return_indices=True, **ops._pool_fields(k, s, p, d, False)))
bench("F.max_pool2d_with_indices (eager)", lambda: torch.nn.functional.max_pool2d_with_indices(x, 2, 2))
with torch.no_grad():
    bench("no_grad: torch.ops.ckgen...default", lambda: torch.ops.ckgen.maxpool2d_fwd_with_indices.default(x, k, s, p, d, False))
    bench("no_grad: exp.real_cxxag", lambda: torch.ops.exp.real_cxxag.default(x, k, s, p, d, False))
import cProfile, pstats, io
pr = cProfile.Profile(); pr.enable()
for _ in range(3000): ckgen.maxpool2d_fwd(x, (2, 2), (2, 2), (0, 0), (1, 1), False, True)
pr.disable(); s_ = io.StringIO(); pstats.Stats(pr, stream=s_).sort_stats("tottime").print_stats(25); P(s_.getvalue())
