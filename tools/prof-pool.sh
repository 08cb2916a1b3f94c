#!/bin/bash
# Nsight Compute one ckgen pooling instance and torch.compile's kernel for the same problem.
#   tools/prof-pool.sh OP KEY CONFIG_JSON TORCH_EXPR OUTDIR
# TORCH_EXPR: python evaluated with x (bf16 input in the problem's layout) and F; e.g. "F.max_pool2d(x,3,2,1)"
set -u
op=$1; key=$2; cfg=$3; expr=$4; out=$5
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis"
ncu -k regex:ckgen_ -c 1 $sections python3 bench/sweep.py --op "$op" --key "$key" --config "$cfg" > "$out/ncu-ckgen-$op.txt" 2>&1
cat > /tmp/tc.py <<PY
import torch, torch.nn.functional as F
from ckgen.ops import get_op
p = get_op("$op").problem_from_key("$key")
x = torch.randn(p.N, p.C, p.H, p.W, device="cuda", dtype=torch.bfloat16)
if p.layout == "nhwc":
    x = x.to(memory_format=torch.channels_last)
f = torch.compile(lambda x: $expr)
for _ in range(3):
    f(x)
torch.cuda.synchronize()
PY
ncu -k regex:triton_ -c 1 $sections python3 /tmp/tc.py > "$out/ncu-compile-$op.txt" 2>&1
