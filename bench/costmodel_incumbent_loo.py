"""The dispatcher's sibling rule (ckgen.model.NEAREST_MARGIN / NEAREST_DISTANCE), checked by
leave-one-problem-out over the shipped records, CPU only (about 8 minutes per shard):

    python bench/costmodel_incumbent_loo.py [SHARD NSHARDS]    # then: --summary FILES...

For each recorded problem with 2+ timed configs: fit on every other record, take the model's
two-tier pick among the candidates dispatch would rank (restricted to the timed ones) and the
nearest other recorded problem's winner (if timed), and score, for each margin M, "the model's
pick if predicted M faster than the winner, else the winner", as time / the problem's best timed.
One ROW line per problem: op, layout, key, timed configs, distance to the nearest, one ratio per
margin. --summary groups the ROW lines of the given files by (max distance, margin)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MARGINS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, math.inf)


def rows(shard: int, nshards: int) -> None:
    from ckgen import model as cm
    from ckgen.model import records
    from ckgen.ops import get_op
    from ckgen.ops.spec import Target

    recs = records.read(records.packaged_records_path())
    for i, ((op_name, arch, key), rs) in enumerate(cm.recmod_by_problem(recs)):
        if i % nshards != shard:
            continue
        timed = cm.timed_configs(rs)
        if len(timed) < 2:
            continue
        op, target = get_op(op_name), Target.named(arch)
        p = op.problem_from_key(key)
        rest = [r for r in recs if (r["op"], r["problem"]) != (op_name, key)]
        model = cm.fit(rest)
        best = min(timed.values())
        every, n = cm.candidate_tiers(op, p, target, model.winner_configs(op), lambda c: bool(op.validate(p, c, target)))
        cands = [c for c in every if c in timed]
        n_near = sum(c in timed for c in every[:n])
        if not cands:
            cands, n_near = cm.candidate_tiers(op, p, target, model.winner_configs(op),
                                               lambda c: c in timed and bool(op.validate(p, c, target)))
        pred_pick, pick = model.select(op, p, cands, n_near, target)[0]
        near = cm.nearest_recorded_winner(rest, op, p, arch, lambda c: c in timed and bool(op.validate(p, c, target)))
        if near is None:
            continue
        inc, nk = near
        pred_inc = model.predict(op, p, inc, target)
        out = [timed[pick if pred_pick.total_us < pred_inc.total_us / (1 + m) else inc] / best for m in MARGINS]
        print("ROW", op_name, p.layout, key, len(timed), f"{op.distance(p, op.problem_from_key(nk)):.2f}",
              " ".join(f"{x:.4f}" for x in out), flush=True)


def summary(files: list[str]) -> None:
    got = [line.split() for f in files for line in open(f) if line.startswith("ROW")]
    geo = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    print(f"{len(got)} problems; pick / best timed: geomean, worst, within 1.15x (sweeps: 50+ timed configs)")
    for dmax in (0.5, 2.0, 2.5, 3.0, math.inf):
        for mi, m in enumerate(MARGINS):
            vals, sw = [], []
            for r in got:
                v = float(r[6 + mi]) if float(r[5]) <= dmax else float(r[6])
                vals.append(v)
                if int(r[4]) >= 50:
                    sw.append(v)
            print(f"  distance <= {dmax:<4} margin {m:<5}: {geo(vals):.3f} {max(vals):.2f} "
                  f"{sum(v <= 1.15 for v in vals)}/{len(vals)}; sweeps {geo(sw) if sw else math.nan:.3f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summary"]:
        summary(sys.argv[2:])
    else:
        rows(*(map(int, sys.argv[1:3])) if len(sys.argv) > 2 else (0, 1))
