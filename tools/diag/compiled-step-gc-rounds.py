"""VGG-16 (and 4 ResBlocks) ck_compile vs compile host time: round-by-round spread, GC, per-call ckgen time, traces."""
import copy, gc, os, sys, time, gzip, json, collections
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch
import models as M
import ckgen, ckgen.torch as ct
from torch.profiler import ProfilerActivity, profile
outdir = sys.argv[1]
name, shape, layout, mode = sys.argv[2], tuple(int(v) for v in sys.argv[3].split("x")), sys.argv[4], sys.argv[5]
torch.backends.cudnn.benchmark = True
dev = torch.device("cuda")
f = open(os.path.join(outdir, f"diag-{name}-{layout}-{mode}.txt"), "w")
def P(*a): print(*a, file=f, flush=True)
row = M.Row(name, shape, layout, mode)
base, _ = M.build(row, torch.bfloat16, dev)
fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
x = torch.randn(row.shape, device=dev).to(torch.bfloat16).contiguous(memory_format=fmt)
conv = copy.deepcopy(base)
P(ct.convert(conv))
steps = {}
for col in ("compile", "ck_compile", "ck_eager", "eager"):
    m = copy.deepcopy(conv if col.startswith("ck") else base)
    fn = m if col.endswith("eager") else torch.compile(m)
    steps[col] = M.make_step(fn, m, x, mode)
    for _ in range(3):
        steps[col]()
torch.cuda.synchronize()
# GC accounting
gcs = collections.Counter(); gct = collections.Counter(); t0 = [0.0]
def cb(phase, info):
    if phase == "start": t0[0] = time.perf_counter()
    else:
        gcs[info["generation"]] += 1; gct[info["generation"]] += time.perf_counter() - t0[0]
gc.callbacks.append(cb)
def rounds(label, R=9, n=20):
    times = {c: [] for c in steps}
    cols = list(steps)
    gcs.clear(); gct.clear()
    for r in range(R):
        for c in cols[r % len(cols):] + cols[: r % len(cols)]:
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(n): steps[c]()
            torch.cuda.synchronize(); times[c].append((time.perf_counter() - t) * 1e3 / n)
    P(f"\n== {label}: ms/step per round (sorted); gc collections {dict(gcs)} seconds {dict((k, round(v, 4)) for k, v in gct.items())}")
    for c, v in times.items():
        P(f"{c:12s} median {sorted(v)[len(v)//2]:.3f}  " + " ".join(f"{t:.2f}" for t in sorted(v)))
rounds("default gc")
gc.disable(); rounds("gc disabled"); gc.enable()
gc.freeze(); rounds("gc.freeze()"); gc.unfreeze()
# per-call ckgen host time inside the compiled step
calls = collections.defaultdict(list)
for fname in ("maxpool2d_fwd", "maxpool2d_bwd", "groupnorm_fwd", "groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta"):
    orig = getattr(ckgen, fname)
    def wrap(*a, _o=orig, _n=fname, **k):
        t = time.perf_counter_ns(); r = _o(*a, **k); calls[_n].append((time.perf_counter_ns() - t) / 1e3); return r
    setattr(ckgen, fname, wrap)
for col in ("ck_compile", "ck_eager"):
    calls.clear()
    for _ in range(50): steps[col]()
    torch.cuda.synchronize()
    for k, v in calls.items():
        v = sorted(v)
        P(f"{col} ckgen.{k}: {len(v)} calls, median {v[len(v)//2]:.1f} us, p90 {v[int(len(v)*.9)]:.1f}, max {v[-1]:.1f}")
for col in ("compile", "ck_compile"):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3): steps[col]()
        torch.cuda.synchronize()
    path = os.path.join(outdir, f"trace-{name}-{layout}-{mode}-{col}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as a, gzip.open(path + ".gz", "wb") as b: b.write(a.read())
    os.remove(path)
f.close()
