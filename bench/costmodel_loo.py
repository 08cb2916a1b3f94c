"""Which model for the config selector? Leave-one-out on the recorded sweeps, CPU only:

    python bench/costmodel_loo.py

Each exhaustive sweep (tests/data/sweeps) is held out in turn; a model is fit on every other
shipped record (ckgen/data/records.jsonl.gz) and picks among the held-out problem's candidates
(ckgen.model.candidates) that the sweep timed. Printed as the picked config's time / the
sweep's best, for:
  - roofline: ckgen's model (ckgen/model/), an analytical roofline with fitted terms;
  - gbt: scikit-learn's HistGradientBoostingRegressor on the same phi terms plus the problem's
    features (log sizes, layout, dtype bytes), predicting log time (when scikit-learn is installed);
  - nearest: the winner of the nearest other recorded problem (the dispatcher without a model);
  - default: the space's default config;
  - best candidate: what a perfect ranking of the candidates would give.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def gbt_pick(rest, op, p, target, cands):
    import numpy as np
    from sklearn.ensemble import HistGradientBoostingRegressor

    from ckgen import model as cm
    from ckgen.model.features import _phi_matrix
    from ckgen.model.fit import _usable_records

    def row(op_, p_, c_, t_):
        g = cm.geometry(op_, p_, c_, t_)
        phi = _phi_matrix([g], 2e6)[0]
        return [*phi, g.launches, g.log_roof, g.log_inflight, math.log(p_.N), math.log(p_.C), math.log(p_.H * p_.W),
                float(p_.layout == "nhwc"), float(p_.dtype != "fp32")]

    X, y = [], []
    for r, op_, p_, t_, c_ in _usable_records(rest):
        X.append(row(op_, p_, c_, t_))
        y.append(math.log(float(r["time_us"])))
    model = HistGradientBoostingRegressor(max_iter=300, learning_rate=0.05, random_state=0)
    model.fit(np.array(X), np.array(y))
    pred = model.predict(np.array([row(op, p, c, target) for c in cands]))
    return cands[int(np.argmin(pred))]


def geomean(xs) -> float:
    xs = [x for x in xs if x == x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def summarize(res, attrs=("model", "nearest", "default", "oracle")) -> list[str]:
    """Per op/layout and overall: geomean, worst and share within 1.15x of each column of `res`
    (LooResult rows)."""
    groups: dict[str, list] = {}
    for r in res:
        groups.setdefault(f"{r.op}/{r.layout}", []).append(r)
    groups["all"] = list(res)
    head = f"{'op/layout':<26} {'n':>3} " + " ".join(f"{a + ' geo/worst/<=1.15':>26}" for a in attrs)
    lines = [head]
    for name, rs in groups.items():
        cells = []
        for a in attrs:
            xs = [getattr(r, a) for r in rs if getattr(r, a) == getattr(r, a)]
            within = sum(x <= 1.15 + 1e-9 for x in xs)
            cells.append(f"{geomean(xs):>9.3f} {max(xs, default=math.nan):>7.3f} {within:>4}/{len(xs):<3}")
        lines.append(f"{name:<26} {len(rs):>3} " + " ".join(f"{c:>26}" for c in cells))
    return lines


def all_problems(recs, fitter=None, as_dispatched=True) -> list:
    """Every recorded problem with at least two timed configs held out in turn (fit on the rest,
    pick among its timed candidates: those the dispatcher would rank, by default); returns the
    LooResult rows."""
    from ckgen import model as cm

    return cm.leave_one_out(recs, min_recorded=2, fitter=fitter, as_dispatched=as_dispatched, source=None)


MARGINS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, math.inf)  # inf: the near tier alone


def margins(recs, subsets: int = 30) -> None:
    """How large must a wide-tier candidate's predicted gain be (ckgen.model.WIDE_MARGIN)? Each
    problem held out (fit on the rest, once), its picks under each margin: over every recorded
    problem (candidates as dispatched, restricted to the timed ones), and on the exhaustive sweeps
    (every candidate timed: the check of ranking among many untimed configs), there also from
    `subsets` seeded random thirds of the winners (other starting points, the same sweep)."""
    import random

    from ckgen import model as cm
    from ckgen.ops import get_op
    from ckgen.ops.spec import Target
    from ckgen.model.records import by_problem

    def pick(model, op, p, target, winners, ok, timed, m):
        cands, near = cm.candidate_tiers(op, p, target, winners, ok)
        kept = [c for c in cands if c in timed]
        if not kept:
            return None
        return timed[model.select(op, p, kept, sum(c in timed for c in cands[:near]), target, m)[0][1]]

    rows: dict[float, list[float]] = {m: [] for m in MARGINS}
    sweep_rows: list[tuple[str, dict[float, list[float]]]] = []
    for (op_name, arch, key), rs in by_problem(recs):
        timed = cm.timed_configs(rs)
        if len(timed) < 2:
            continue
        op, target = get_op(op_name), Target.named(arch)
        p = op.problem_from_key(key)
        model = cm.fit([r for r in recs if (r["op"], r["problem"]) != (op_name, key)])
        best, W = min(timed.values()), model.winner_configs(op)
        valid = lambda c: bool(op.validate(p, c, target))  # noqa: E731
        usable = lambda c: c in timed and valid(c)  # noqa: E731
        for m in MARGINS:
            t = pick(model, op, p, target, W, valid, timed, m) or pick(model, op, p, target, W, usable, timed, m)
            rows[m].append(t / best)
        if len(timed) >= 50:
            got: dict[float, list[float]] = {m: [] for m in MARGINS}
            starts = [W] + [random.Random(s).sample(W, max(3, len(W) // 3)) for s in range(subsets)]
            for ws in starts:
                for m in MARGINS:
                    got[m].append(pick(model, op, p, target, ws, usable, timed, m) / best)
            sweep_rows.append((f"{op_name} {p.layout} {key[:28]}", got))
    print(f"{'margin':>6}  {'all problems: geo worst <=1.15':>31}  " + "  ".join(
        f"{name[:30]:>30} (all winners; {subsets} thirds: geo worst >1.5 better/worse)" for name, _ in sweep_rows))
    for m in MARGINS:
        xs = rows[m]
        cells = []
        for _, got in sweep_rows:
            full, sub = got[m][0], got[m][1:]
            ref = got[math.inf][1:]
            better = sum(x * 1.02 < y for x, y in zip(sub, ref))
            worse = sum(x > y * 1.02 for x, y in zip(sub, ref))
            cells.append(f"{full:>8.3f}  {geomean(sub):.3f} {max(sub):.3f} {sum(x > 1.5 for x in sub):>2} {better:>2}/{worse:<2}")
        label = "near" if m == math.inf else f"{m:g}"
        print(f"{label:>6}  {geomean(xs):>13.3f} {max(xs):>7.2f} {sum(x <= 1.15 + 1e-9 for x in xs):>3}/{len(xs):<3}  "
              + "  ".join(f"{c:>60}" for c in cells))


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description="leave-one-out comparisons of config selectors, CPU only")
    ap.add_argument("--all", action="store_true",
                    help="every recorded problem with a choice (2+ timed configs), grouped by op/layout")
    ap.add_argument("--rows", action="store_true", help="with --all: one line per held-out problem too")
    ap.add_argument("--reach", action="store_true",
                    help="with --all: candidates searched among timed configs only (reaches further than dispatch)")
    ap.add_argument("--margins", action="store_true",
                    help="the wide tier's margin (ckgen.model.WIDE_MARGIN): all problems and the sweeps per margin")
    args = ap.parse_args()
    if args.margins:
        from ckgen.model import records

        margins(records.read(records.packaged_records_path()))
        return 0
    if args.all:
        from ckgen.model import records

        recs = records.read(records.packaged_records_path())
        res = all_problems(recs, as_dispatched=not args.reach)
        if args.rows:
            for r in res:
                print(f"{r.op:<16} {r.problem[:70]:<70} model {r.model:.3f}x near-only {r.near_only:.3f}x cand-best {r.oracle:.3f}x "
                      f"nearest {r.nearest:.3f}x default {r.default:.3f}x ({r.candidates}/{r.recorded})")
        print("\nleave-one-problem-out over the records: picked / best timed "
              "(model: the roofline's two-tier pick; near_only: its pick among the near tier; oracle: the best timed candidate)")
        print("\n".join(summarize(res, ("model", "near_only", "nearest", "default", "oracle"))))
        return 0
    from ckgen import model as cm
    from ckgen.model import records
    from ckgen.ops import get_op
    from ckgen.ops.spec import Target

    recs = records.read(records.packaged_records_path())
    try:
        import sklearn  # noqa: F401
        have_gbt = True
    except ImportError:
        have_gbt = False
    print(f"{'held-out sweep':<58} {'roofline':>8} {'gbt':>6} {'nearest':>8} {'default':>8} {'best cand':>9}")
    for r in cm.leave_one_out(recs):
        gbt = math.nan
        if have_gbt:
            op, target = get_op(r.op), Target.named("sm_90")
            p = op.problem_from_key(r.problem)
            rest = [x for x in recs if (x["op"], x["problem"]) != (r.op, r.problem)]
            timed = cm.timed_configs(x for x in recs if (x["op"], x["problem"]) == (r.op, r.problem))
            model = cm.fit(rest)
            cands = cm.candidates(op, p, target, model.winner_configs(op),
                                  lambda c: c in timed and bool(op.validate(p, c, target)))
            gbt = timed[gbt_pick(rest, op, p, target, cands)] / min(timed.values())
        print(f"{r.op + ' ' + r.problem[:44]:<58} {r.model:>7.3f}x {gbt:>5.3f}x {r.nearest:>7.3f}x "
              f"{r.default:>7.3f}x {r.oracle:>8.3f}x")
    if not have_gbt:
        print("(gbt: scikit-learn is not installed)")
    pairs(recs)
    return 0


def pairs(recs) -> None:
    """Every other recorded problem holds a winner and the default's time (the shipped DB): held
    out in turn, does the roofline model rank the two the right way round (where they differ by
    5% or more)? A weak check (one pair per problem), over every op."""
    from ckgen import model as cm
    from ckgen.ops import get_op
    from ckgen.ops.spec import Config, Target

    right: dict[str, list[bool]] = {}
    for (op_name, arch, key), rs in __import__("ckgen.model.records", fromlist=["by_problem"]).by_problem(recs):
        win = [r for r in rs if r["phase"] == "winner"]
        dft = [r for r in rs if r["phase"] == "default"]
        if not win or not dft or win[0]["config"] == dft[0]["config"]:
            continue
        tw, td = win[0]["time_us"], dft[0]["time_us"]
        if max(tw, td) < 1.05 * min(tw, td):
            continue
        op, target = get_op(op_name), Target.named(arch)
        p = op.problem_from_key(key)
        cw, cd = Config.of(win[0]["config"]), Config.of(dft[0]["config"])
        if not (op.validate(p, cw, target) and op.validate(p, cd, target)):
            continue
        model = cm.fit([r for r in recs if (r["op"], r["problem"]) != (op_name, key)])
        pw, pd = model.predict(op, p, cw, target), model.predict(op, p, cd, target)
        right.setdefault(op_name, []).append((pw.gpu_us < pd.gpu_us) == (tw < td))
    total = [x for v in right.values() for x in v]
    print(f"\nwinner vs default, each problem held out: the roofline ranks {sum(total)}/{len(total)} pairs right")
    for name, v in sorted(right.items()):
        print(f"  {name:<26} {sum(v)}/{len(v)}")


if __name__ == "__main__":
    raise SystemExit(main())
