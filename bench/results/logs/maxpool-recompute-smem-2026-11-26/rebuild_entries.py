"""Rebuild the tune run's DB entries (its tuned.yaml did not come back from the device) from its
records: per problem, the winner is the fastest `final` re-timing (as ckgen tune picks it), the
default's time its own final/trial time; provenance as the device reported in the same image."""
import json, sys, collections, datetime as dt
sys.path.insert(0, ".")
from ckgen.db import Entry, InstanceDB
from ckgen.ops import get_op
from ckgen.types import Config, Target, DTYPES
from ckgen.instance import render_instance
import yaml

recs = [json.loads(l) for l in open(sys.argv[1])]
printed = {}  # problem -> (instance, time, gbps) from the run's printed table
for line in open(sys.argv[2]):
    f = line.rstrip("\n").split("\t")
    if len(f) >= 6 and f[0].startswith("N="):
        printed[f[0]] = (f[1], float(f[2]), float(f[4]), float(f[3].rstrip("%")) / 100)
by = collections.defaultdict(list)
for r in recs:
    by[r["problem"]].append(r)
t = Target.named("sm_90")
out = []
for prob, rs in by.items():
    op = get_op(rs[0]["op"])
    p = op.problem_from_key(prob)
    final = [r for r in rs if r["phase"] == "final" and r["ok"]]
    best = min(final, key=lambda r: r["time_us"])
    cfg = Config.of(best["config"])
    src = render_instance(op, p, cfg, t)
    inst, tp, gbps, spread = printed[prob]
    assert inst == src.name, (prob, inst, src.name)
    default = op.space.nearest_default(lambda c: bool(op.validate(p, c, t)))
    dts = [r["time_us"] for r in rs if Config.of(r["config"]) == default and r["ok"]]
    dates = sorted(r["date"] for r in rs)
    secs = (dt.datetime.fromisoformat(dates[-1]) - dt.datetime.fromisoformat(dates[0])).total_seconds()
    prov = dict(ckgen="0.1.0", cuda_driver=13000, cuda_runtime=13020, cupy="14.2.0", date=dates[-1],
                trials=len([r for r in rs if r["phase"] == "trial"]), tuning_seconds=round(secs, 1))
    e = Entry(op=op.name, vendor="cuda", arch="sm_90", device=best["device"], problem=prob, config=cfg.items,
              instance=src.name, source_sha256=src.sha256, time_us=round(tp, 3), gbps=round(gbps, 1),
              default_time_us=round(min(dts), 3) if dts else -1.0, spread=round(spread, 4),
              provenance=tuple(sorted(prov.items())))
    out.append(e)
    print(prob, src.name, tp, "final best", best["time_us"], "default", min(dts) if dts else None)
from ckgen.db import save_entries
print(len(save_entries(sys.argv[3], out)), "entries written")
