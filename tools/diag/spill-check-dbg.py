"""Why did the device's prev-model held-out run take a spilling pick? Print the ranking and the check."""
import os
import ckgen
from ckgen.offline import library
from ckgen.runtime import spill
from ckgen import model as cm
from ckgen.runtime.dispatch import dispatcher
from ckgen.ops import get_op
from ckgen.ops.spec import Target
print("CKGEN_MODEL", os.environ.get("CKGEN_MODEL"), "ckgen at", ckgen.__file__)
print("nvrtc_missing:", library.nvrtc_missing())
t = Target.named("sm_90")
op = get_op("maxpool2d_fwd")
p = op.parse_problem(N=32, C=512, H=13, W=13, kernel=3, stride=1, padding=1, dtype="bf16", layout="nhwc", return_indices=True)
m = cm.load()
print("model", m.summary() if m else None)
db = dispatcher().database()
print("db entries for op", len(list(db.select(op.name))), "paths", getattr(db, "path", None))
usable = lambda c: bool(op.validate(p, c, t))
cands, near = cm.candidate_tiers(op, p, t, m.winner_configs(op), usable)
for pred, c in m.select(op, p, cands, near, t)[:10]:
    print(op.instance_name(p, c), round(pred.total_us, 2), "spill", spill.spill_bytes(op, p, c, t))
acc = spill.spill_free(op, p, t)
print("dispatch_pick", cm.dispatch_pick(op, p, t, db.select(op.name), usable, acc), "rejected", acc and acc.rejected)
print(ckgen.explain("maxpool2d_fwd", arch="sm_90", N=32, C=512, H=13, W=13, kernel=(3, 3), stride=(1, 1), padding=(1, 1),
                    dilation=(1, 1), ceil_mode=False, dtype="bf16", layout="nhwc", return_indices=True))
