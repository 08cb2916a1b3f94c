"""Which register count should the cost model's occupancy use for the pooling forward? K-fold
(5, seeded) over every recorded problem of the ops given (default: max/avg pool forward), CPU only:
the model is fit on the other folds' records and picks among each held-out problem's timed
candidates (as the dispatcher ranks them). Picked time / the problem's best recorded time.

    PYTHONPATH=. python3 bench/costmodel_kfold.py VARIANT [OPS]

VARIANT: legacy (the NHWC input counted as 2 vectors), needed (the spill bound `validate`
uses), used (`regs_used`: what the compiler allocates, up to the budget; what ckgen uses),
samefloor (as used, but every launch of a call costs the first launch's floor and no re-read
term for the max backward's recompute), norecompute (the floor split without the recompute
term), next025 / next05 / next1 (the further launches' floor pinned at 0.25 / 0.5 / 1 of the
first's, instead of fitted on FLOOR_NEXT_GRID), nochain / chainsum / chainmax / chainmax2
(GroupNorm's chain term: off, log1p(chain / roofline), log max(1, chain / roofline) (what ckgen
uses), the same at CHAIN_US = 2, the same with the term's prior weight 1 instead of 0.5).
OPS: comma-separated, or "all". Prints one line per variant and op family."""
import sys, math, random, collections, importlib
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ckgen import model as cm
from ckgen.model import records
from ckgen.model import features as F
fitmod=importlib.import_module('ckgen.model.fit')  # the module (ckgen.model.fit is the function)
from ckgen.ops.pool.bwd import _PoolBwd
from ckgen.ops import get_op
from ckgen.ops.spec import Config, Target
recs=records.read(records.packaged_records_path())
variant=sys.argv[1]; ops_sel=sys.argv[2].split(',') if len(sys.argv)>2 else ['maxpool2d_fwd','avgpool2d_fwd']
if ops_sel==['all']: ops_sel=sorted({r['op'] for r in recs})
orig=F._regs
def no_recompute():  # no re-read term for the max backward's recompute
    _PoolBwd.model_reread_bytes=lambda self,p,c: 0
def legacy(op,p,c):
    if op.name in ('maxpool2d_fwd','avgpool2d_fwd') and p.layout=='nhwc':
        th,tw=op.tile(c); vec=op.vec_elems(p,c); idx=getattr(p,'return_indices',False)
        return max(32, th*tw*vec*(2 if idx else 1)+2*vec+24)
    if op.name.startswith('groupnorm'): return orig(op,p,c)
    return max(32, op._regs_needed(p,c))
def needed(op,p,c):
    if op.name.startswith('groupnorm'): return orig(op,p,c)
    return max(32, op._regs_needed(p,c))
if variant=='samefloor':  # every launch of a call costs the same floor
    fitmod.FLOOR_NEXT_GRID=(1.0,); no_recompute(); variant_regs='used'
elif variant in ('next025','next05','next1'):  # the further launches' floor pinned at this fraction of the first
    fitmod.FLOOR_NEXT_GRID=({'next025':0.25,'next05':0.5,'next1':1.0}[variant],); variant_regs='used'
elif variant=='norecompute':  # the floor split, but no re-read term for the max backward's recompute
    no_recompute(); variant_regs='used'
elif variant in ('nochain','chainsum','chainmax','chainmax2','chainmaxp1'):  # the chain term: off, log1p, log max(1, .)
    F.CHAIN={'nochain':None,'chainsum':'sum','chainmax':'max','chainmax2':'max','chainmaxp1':'max'}[variant]; variant_regs='used'
    if variant=='chainmax2': F.CHAIN_US=2.0
    if variant=='chainmaxp1': F.PRIOR[F.TERM_NAMES.index('chain')]=1.0
else:
    variant_regs=variant
# most records were timed with the NCHW backward's wide rows (only the re-timed shipped winners,
# one record per problem, ran the narrow ones): score picks against the wide-row rule
# (the fit itself counts each record's chain with the rule of its date)
F.PREDICT_NARROW_ROWS=False
F._regs={'legacy':legacy,'needed':needed,'used':orig}[variant_regs]
probs=sorted({(r['op'],r['arch'],r['problem']) for r in recs if r['op'] in ops_sel})
random.Random(0).shuffle(probs)
K=5; out=[]
byp=collections.defaultdict(list)
for r in recs: byp[(r['op'],r['arch'],r['problem'])].append(r)
for k in range(K):
    fold=set(probs[k::K])
    model=cm.fit([r for r in recs if (r['op'],r['arch'],r['problem']) not in fold])
    for key in fold:
        opn,arch,pk=key; timed=cm.timed_configs(byp[key])
        if len(timed)<2: continue
        op=get_op(opn); T=Target.named(arch); p=op.problem_from_key(pk)
        valid=lambda c: bool(op.validate(p,c,T))
        every,n=cm.candidate_tiers(op,p,T,model.winner_configs(op),valid)
        cands=[c for c in every if c in timed]; nn=sum(c in timed for c in every[:n])
        if not cands:
            cands,nn=cm.candidate_tiers(op,p,T,model.winner_configs(op),lambda c: c in timed and valid(c))
        if not cands: continue
        pick=model.select(op,p,cands,nn,T)[0][1]
        out.append((opn,p.layout,timed[pick]/min(timed.values()),pk))
import os
if os.environ.get('KFOLD_ROWS'):  # every held-out problem's ratio, for comparing variants
    with open(os.environ['KFOLD_ROWS'],'w') as f:
        for t in sorted(out): f.write('%s\t%s\t%.4f\t%s\n'%t)
g=lambda xs: math.exp(sum(map(math.log,xs))/len(xs))
for lay in ('nchw','nhwc'):
    xs=[x for o,l,x,_ in out if l==lay]
    print(variant, lay, len(xs), 'geo %.3f worst %.3f within1.15 %d'%(g(xs),max(xs),sum(x<=1.15 for x in xs)))
for o in sorted({t[0] for t in out}) if len(ops_sel)>2 else []:
    xs=[t[2] for t in out if t[0]==o]
    print(variant, o, len(xs), 'geo %.3f worst %.3f within1.15 %d'%(g(xs),max(xs),sum(x<=1.15 for x in xs)))
xs=[t[2] for t in out]; print(variant,'all',len(xs),'geo %.3f worst %.3f'%(g(xs),max(xs)))
w=max(out,key=lambda t:t[2]); print(variant,'worst problem',w)
