"""Register need of the pooling kernels against the validators' estimate (`_regs_needed`), offline:
every (vec_bytes, tw, th[, algo]) of a set of problems compiled at 64 threads and 1 block/SM (a cap
of 255 registers) with NVRTC and `ptxas -v`; one JSON line per kernel (registers, spill bytes, the
estimate) appended to bench/results/logs/pool-regs-sm90-nvrtc.jsonl (not kept in git: this script
regenerates it, no GPU needed), resuming where it stopped.

    PYTHONPATH=. python3 tools/pool-regs-study.py [WORKERS]

What it showed (fp32, both layouts): the NHWC forward kernels needed 2-4x the estimate then in use
(max pool median 2.1x, avg pool 2.2x: the loads-first footprint row was counted as 2 vectors, it
holds ((tw-1)*stride + kernel) of them), so the validator admitted configs that spill. The NHWC
forward estimate now counts min(FR, 3) footprint rows of FC input vectors (ops/pool/base.py
`_fwd_regs`), calibrated on every recorded instance at its own launch bounds
(tools/pool-spill-study.py, whose output tests/test_pool_regs.py reads)."""
import json, sys, itertools, concurrent.futures as cf
sys.path.insert(0, '.')
from ckgen.ops import get_op
from ckgen.types import Target
from ckgen.ops.spec import Config
from ckgen.offline import library
T = Target.named('sm_90')

def build(args):
    name, pkw, cd = args
    from ckgen.instance import render_instance
    op = get_op(name); p = op.parse_problem(**pkw); c = Config.of(cd)
    src = render_instance(op, p, c, T, check=False)  # configs validate rejects for registers too
    built = library.build([library.Instance(name, T, c, src, (p.key(),))], jobs=1)[0]
    if not built.ok:
        return None
    main = [r for k, r in built.report.items() if src.name in k] or list(built.report.values())
    regs = max(r["registers"] for r in main); spill = max(r["spill_stores"] for r in main)
    return dict(op=name, problem=p.key(), config=cd, regs=regs, spill=spill, est=op._regs_needed(p, c))

PROBS = []
for dt in ('fp32', 'bf16'):
    for lay in ('nchw', 'nhwc'):
        for geo in (dict(kernel=3, stride=1, padding=1), dict(kernel=3, stride=2, padding=1), dict(kernel=2, stride=2), dict(kernel=5, stride=1, padding=2)):
            base = dict(N=8, C=64, H=28, W=28, dtype=dt, layout=lay, **geo)
            PROBS.append(('maxpool2d_fwd', {**base, 'return_indices': True}))
            PROBS.append(('maxpool2d_fwd', {**base, 'return_indices': False}))
            PROBS.append(('avgpool2d_fwd', base))
            PROBS.append(('maxpool2d_bwd', {**base, 'indices': 'stored'}))
            PROBS.append(('maxpool2d_bwd', {**base, 'indices': 'recompute'}))
            PROBS.append(('avgpool2d_bwd', base))
jobs = []
for name, pkw in PROBS:
    op = get_op(name)
    p = op.parse_problem(**pkw)
    algos = ('gather', 'scatter') if op.backward else (None,)
    for vb, tw, th, al in itertools.product((2, 4, 8, 16), (1, 2, 4, 8), (1, 2, 4), algos):
        d = dict(threads=64, vec_bytes=vb, tw=tw, th=th, block_rows=1, min_blocks=1)
        if al: d['algo'] = al
        c = Config.of(d)
        if not op.space.check(c):
            continue
        try:
            if op.validate(p, c, T) or 'registers' in str(op.validate(p, c, T)):
                jobs.append((name, pkw, d))
        except Exception:
            pass
import os
os.makedirs('bench/results/logs', exist_ok=True)
done = set()
if os.path.exists('bench/results/logs/pool-regs-sm90-nvrtc.jsonl'):
    for l in open('bench/results/logs/pool-regs-sm90-nvrtc.jsonl'):
        r = json.loads(l); done.add((r['op'], r['problem'], json.dumps(r['config'], sort_keys=True)))
jobs = [j for j in jobs if (j[0], get_op(j[0]).parse_problem(**j[1]).key(), json.dumps(j[2], sort_keys=True)) not in done]
print(len(jobs), file=sys.stderr)
with cf.ProcessPoolExecutor(int(sys.argv[1]) if len(sys.argv) > 1 else 2) as ex, open('bench/results/logs/pool-regs-sm90-nvrtc.jsonl', 'a') as f:
    for r in ex.map(build, jobs, chunksize=4):
        if r: f.write(json.dumps(r) + '\n'); f.flush()
