"""Where does ck_compile's host time go on VGG-16 train (bf16 NHWC 16x3x224x224)? Host-inclusive
ms per step of compile vs ck_compile, sync-debug warnings, and the CPU-side profile (top ops by
self CPU time, CUDA runtime calls that synchronize)."""
import copy, os, sys, time, warnings, collections
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch
import models as M
import ckgen.torch as ct
from torch.profiler import ProfilerActivity, profile

out = sys.argv[1]
dev = torch.device("cuda")
name, shape, layout = sys.argv[2], tuple(int(v) for v in sys.argv[3].split("x")), sys.argv[4]
row = M.Row(name, shape, layout, "train")
base, _ = M.build(row, torch.bfloat16, dev)
fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
x = torch.randn(row.shape, device=dev).to(torch.bfloat16).contiguous(memory_format=fmt)
conv = copy.deepcopy(base)
ct.convert(conv)
steps = {}
for col in ("compile", "ck_compile", "ck_eager", "eager"):
    m = copy.deepcopy(conv if col.startswith("ck") else base)
    fn = m if col.endswith("eager") else torch.compile(m, fullgraph=col.startswith("ck"))
    steps[col] = M.make_step(fn, m, x, "train")
    for _ in range(3):
        steps[col]()
torch.cuda.synchronize()
f = open(out, "w")
print(M.interleaved_host_ms(steps, dev, 7, 20), file=f, flush=True)
for col in ("compile", "ck_compile"):
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        steps[col]()
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    print(col, "sync warnings:", [str(x.message)[:200] for x in w][:10], file=f, flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            steps[col]()
        torch.cuda.synchronize()
    print(f"\n===== {col}: top 40 by self CPU", file=f)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70), file=f, flush=True)
    cnt = collections.Counter(e.name for e in prof.events() if "cuda" in e.name.lower() or e.name.startswith("cu"))
    print(col, "runtime/driver calls (5 steps):", dict(cnt.most_common(30)), file=f, flush=True)
f.close()
