"""ckgen on shapes no DB entry covers (bench/heldout.yaml), the dispatcher choosing on its own,
against PyTorch eager, in one run:

    python bench/heldout.py [--out DIR] [--limit N] [--tune-trials 40 [--tuned-db FILE] [--tune-budget S]]

For each held-out problem: the dispatcher's pick (tuned / model / nearest / default, as
`ckgen.explain` says), then ckgen's public op and PyTorch eager doing the same job, timed two ways
with the same Timer: GPU time (CUDA events, L2 flushed before every run, which hides host time)
and host-inclusive time per call (back-to-back calls, no flush, as a model's loop runs them).
Also the max abs difference to PyTorch as a sanity check.

With --tune-trials N each problem is also tuned on its own (`tune_problem`, N trials) into
--tuned-db, a separate file (never the user or shipped DB; problems already in it are not tuned
again, so a run cut short by --tune-budget resumes from it); then the public op is timed again
with that file as the user DB: "own best", the reference the pick is judged against (target:
pick within 1.15x of own best, geomean; worst 1.5x), timed in the same run by the same Timer.

Writes DIR/heldout-<device>.md and .json (DIR: --out, else $OUT, else bench/results)."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import yaml

HELDOUT = Path(__file__).with_name("heldout.yaml")
POOL_OPTS = ("ceil_mode", "return_indices", "indices", "count_include_pad", "divisor_override")


def load_cases(path: Path = HELDOUT) -> list[dict[str, Any]]:
    return yaml.safe_load(path.read_text())["heldout"]


def problem_of(case: dict[str, Any]):
    """(op, Problem) of a held-out case."""
    from ckgen.ops import get_op

    op = get_op(case["op"])
    N, C, H, W = case["shape"]
    if case["op"].startswith("groupnorm"):
        return op, op.parse_problem(N=N, C=C, H=H, W=W, G=case["G"], dtype=case["dtype"], layout=case["layout"],
                                    activation=case.get("activation", "none"))
    extra = {k: case[k] for k in POOL_OPTS if k in case}
    return op, op.parse_problem(N=N, C=C, H=H, W=W, dtype=case["dtype"], layout=case["layout"], kernel=case["kernel"],
                                stride=case.get("stride"), padding=case.get("padding", 0), **extra)


def calls(case: dict[str, Any]):
    """(ours, eager, explain) closures for a case, on fresh random inputs."""
    import torch
    import torch.nn.functional as F

    import ckgen

    aten = torch.ops.aten
    dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[case["dtype"]]
    fmt = torch.channels_last if case["layout"] == "nhwc" else torch.contiguous_format
    N, C, H, W = case["shape"]
    x = (torch.randn(N, C, H, W, device="cuda") + 0.25).to(dt).contiguous(memory_format=fmt)
    name = case["op"]
    if name.startswith("groupnorm"):
        G = case["G"]
        act = case.get("activation")
        swish = act == "swish"
        gamma = (1 + 0.1 * torch.randn(C, device="cuda")).to(dt)
        beta = (0.1 * torch.randn(C, device="cuda")).to(dt)
        if name == "groupnorm_fwd":
            def eager():
                y = F.group_norm(x, G, gamma, beta, 1e-5)
                return F.silu(y) if swish else y
            return (lambda: ckgen.groupnorm_fwd(x, gamma, beta, G, activation=act)[0], eager,
                    lambda: ckgen.explain(name, x, gamma, beta, G, activation=act))
        dy = torch.randn(N, C, H, W, device="cuda").to(dt).contiguous(memory_format=fmt)
        _, mean, rstd = ckgen.groupnorm_fwd(x, gamma, beta, G)
        xr, wr, br = (t.detach().requires_grad_() for t in (x, gamma, beta))
        yr = F.group_norm(xr, G, wr, br, 1e-5)
        yr = F.silu(yr) if swish else yr
        want = {"groupnorm_bwd": (xr, wr, br), "groupnorm_bwd_data": (xr,), "groupnorm_bwd_gamma_beta": (wr, br)}[name]

        def eager():  # what autograd runs for this job (any layout; the native op rejects channels-last)
            return torch.autograd.grad(yr, want, dy, retain_graph=True)

        if name == "groupnorm_bwd_gamma_beta":
            def ours():
                return ckgen.groupnorm_bwd_gamma_beta(dy, x, mean, rstd, G, gamma, beta, activation=act)
            return ours, eager, lambda: ckgen.explain(name, dy, x, mean, rstd, G, gamma, beta, activation=act)
        fn = getattr(ckgen, name)

        def ours():
            return fn(dy, x, mean, rstd, gamma, G, beta, activation=act)
        return ours, eager, lambda: ckgen.explain(name, dy, x, mean, rstd, gamma, G, beta, activation=act)
    k, s, p = case["kernel"], case.get("stride", case["kernel"]), case.get("padding", 0)
    cm = case.get("ceil_mode", False)
    if name == "maxpool2d_fwd":
        ri = case.get("return_indices", False)
        return (lambda: ckgen.maxpool2d_fwd(x, k, s, p, ceil_mode=cm, return_indices=ri),
                lambda: F.max_pool2d(x, k, s, p, ceil_mode=cm, return_indices=ri),
                lambda: ckgen.explain(name, x, k, s, p, ceil_mode=cm, return_indices=ri))
    if name == "maxpool2d_bwd":
        y, idx = F.max_pool2d(x, k, s, p, ceil_mode=cm, return_indices=True)
        dy = torch.randn_like(y)
        ind = None if case.get("indices") == "recompute" else idx
        return (lambda: ckgen.maxpool2d_bwd(dy, x, k, s, p, ceil_mode=cm, indices=ind),
                lambda: aten.max_pool2d_with_indices_backward(dy, x, [k, k], [s, s], [p, p], [1, 1], cm, idx),
                lambda: ckgen.explain(name, dy, x, k, s, p, ceil_mode=cm, indices=ind))
    cip = case.get("count_include_pad", True)
    if name == "avgpool2d_fwd":
        return (lambda: ckgen.avgpool2d_fwd(x, k, s, p, ceil_mode=cm, count_include_pad=cip),
                lambda: F.avg_pool2d(x, k, s, p, ceil_mode=cm, count_include_pad=cip),
                lambda: ckgen.explain(name, x, k, s, p, ceil_mode=cm, count_include_pad=cip))
    dy = torch.randn_like(F.avg_pool2d(x, k, s, p, ceil_mode=cm, count_include_pad=cip))
    return (lambda: ckgen.avgpool2d_bwd(dy, x, k, s, p, ceil_mode=cm, count_include_pad=cip),
            lambda: aten.avg_pool2d_backward(dy, x, [k, k], [s, s], [p, p], cm, cip, None),
            lambda: ckgen.explain(name, dy, x, k, s, p, ceil_mode=cm, count_include_pad=cip))


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, (tuple, list)) else v


def _tune_own_best(cases, args, info, log) -> dict[tuple[str, str], Any]:
    """Tune every case not yet in --tuned-db (within --tune-budget seconds); {(op, key): entry}."""
    from ckgen import db as dbmod
    from ckgen.tune import db_entry, tune_problem

    path = Path(args.tuned_db)
    t0 = time.monotonic()
    for case in cases:
        op, p = problem_of(case)
        have = dbmod.InstanceDB.load(path) if path.is_file() else None
        if have is not None and have.lookup(op.name, info.target.arch, p.key()) is not None:
            continue
        if time.monotonic() - t0 > args.tune_budget:
            log(f"tune budget ({args.tune_budget:.0f} s) spent: {op.name} {p.key()} not tuned")
            continue
        try:
            r = tune_problem(op, p, info, trials=args.tune_trials, storage=None)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            log(f"tuning {op.name} {p.key()} failed: {e.__class__.__name__}: {e}")
            continue
        dbmod.save_entries(path, [db_entry(r, info)])
        log(f"tuned {op.name:24s} {p.key():75s} best {r.best.timing.median_us:8.1f} us ({r.trials} trials, "
            f"{r.seconds:.0f} s; {time.monotonic() - t0:.0f} s in tuning)")
    db = dbmod.InstanceDB.load(path) if path.is_file() else None
    return {} if db is None else {(e.op, e.problem): e for e in db.select(arch=info.target.arch)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).with_name("results")))
    ap.add_argument("--limit", type=int, default=0, help="only the first N cases (0: all)")
    ap.add_argument("--tune-trials", type=int, default=0,
                    help="also tune each problem on its own with this many trials (0: no own-best column)")
    ap.add_argument("--tuned-db", default="", help="the own-best DB file (default DIR/heldout-tuned-db.yaml)")
    ap.add_argument("--tune-budget", type=float, default=float("inf"),
                    help="seconds of tuning at most in this run (the rest is left for a resumed run)")
    args = ap.parse_args()
    if args.tune_trials < 0:
        ap.error("--tune-trials: expected >= 0")
    args.tuned_db = args.tuned_db or str(Path(args.out) / "heldout-tuned-db.yaml")

    import torch

    import ckgen
    from ckgen.bench import Timer
    from ckgen.target import device_info

    info = device_info(None)
    timer = Timer(info.l2_bytes, warmup=3, runs=20)
    cases = load_cases()[: args.limit or None]
    rows, t0 = [], time.monotonic()

    def log(msg: str) -> None:
        print(f"{msg} ({time.monotonic() - t0:.0f} s)", flush=True)

    for case in cases:
        op, p = problem_of(case)
        ours, eager, explain = calls(case)
        choice = explain()
        got, want = _first(ours()), _first(eager())
        diff = (got.float() - want.float()).abs().max().item()
        g_ours, g_eager = timer.time(ours), timer.time(eager)
        h_ours = timer.back_to_back(ours, g_ours.median_us)
        h_eager = timer.back_to_back(eager, g_eager.median_us)
        rows.append({"op": op.name, "problem": p.key(), "source": choice.source, "instance": choice.instance,
                     "reason": choice.reason,
                     "gpu_us": g_ours.median_us, "eager_gpu_us": g_eager.median_us,
                     "host_us": h_ours.median_us, "eager_host_us": h_eager.median_us,
                     "speedup_gpu": g_eager.median_us / g_ours.median_us,
                     "speedup_host": h_eager.median_us / h_ours.median_us, "max_abs_diff_vs_torch_first_output": diff})
        r = rows[-1]
        log(f"{op.name:24s} {p.key():75s} [{choice.source:7s}] gpu {r['gpu_us']:8.1f} vs {r['eager_gpu_us']:8.1f} "
            f"(x{r['speedup_gpu']:.2f}) | host {r['host_us']:8.1f} vs {r['eager_host_us']:8.1f} "
            f"(x{r['speedup_host']:.2f})")
        del ours, eager
        torch.cuda.empty_cache()

    own: dict[tuple[str, str], Any] = {}
    if args.tune_trials:
        own = _tune_own_best(cases, args, info, log)
        saved = os.environ.get("CKGEN_DB")
        os.environ["CKGEN_DB"] = str(Path(args.tuned_db).resolve())
        ckgen.reload_db()
        try:
            for case, r in zip(cases, rows):
                if (r["op"], r["problem"]) not in own:
                    continue
                ours, _, explain = calls(case)
                choice = explain()
                if choice.source != "tuned":
                    log(f"{r['op']} {r['problem']}: own-best DB entry not used ({choice.source}: {choice.reason})")
                    continue
                ours()
                g = timer.time(ours)
                r.update(own_gpu_us=g.median_us, own_instance=choice.instance, pick_vs_own=r["gpu_us"] / g.median_us)
                log(f"own best {r['op']:24s} {r['problem']:75s} gpu {g.median_us:8.1f} (pick {r['gpu_us']:8.1f}: "
                    f"x{r['pick_vs_own']:.2f} of own best)")
                del ours
                torch.cuda.empty_cache()
        finally:
            if saved is None:
                os.environ.pop("CKGEN_DB", None)
            else:
                os.environ["CKGEN_DB"] = saved
            ckgen.reload_db()

    def geo(vals: list[float]) -> float:
        return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")

    slow_gpu = [r for r in rows if r["speedup_gpu"] < 1.0]
    slow_host = [r for r in rows if r["speedup_host"] < 1.0]
    judged = [r for r in rows if "pick_vs_own" in r]
    dev = re.sub(r"[^A-Za-z0-9]+", "-", info.name).strip("-")
    lines = [f"# Held-out shapes on {info.name} ({info.target.arch})", "",
             "Measured in one run by bench/heldout.py on bench/heldout.yaml (shapes no shipped DB entry covers), "
             "the dispatcher choosing alone (shipped DB + user DB; `source` as `ckgen.explain` says). "
             "GPU: CUDA events, L2 flushed before every run (hides host time), median of 20. "
             "host-incl: back-to-back calls without a flush, time per call (median of 7 rounds): what a model's "
             "loop sees. eager: PyTorch doing the same job (F.group_norm(+F.silu), autograd of it for the "
             "GroupNorm backward ops, F.max_pool2d / F.avg_pool2d and their aten backward ops). "
             + (f"own best: the problem tuned on its own ({args.tune_trials} trials, a separate DB file), the "
                "public op timed again with it in the same run; pick/own > 1 means the pick is slower."
                if args.tune_trials else "No own-best column in this run (--tune-trials 0)."), "",
             "| op | problem | source | ckgen GPU us | own best GPU us | pick/own | eager GPU us | vs eager GPU | "
             "ckgen host-incl us | eager host-incl us | vs eager host-incl | instance |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ob = f"{r['own_gpu_us']:.1f}" if "own_gpu_us" in r else "-"
        po = f"{r['pick_vs_own']:.2f}x" if "pick_vs_own" in r else "-"
        lines.append(f"| {r['op']} | {r['problem']} | {r['source']} | {r['gpu_us']:.1f} | {ob} | {po} | "
                     f"{r['eager_gpu_us']:.1f} | {r['speedup_gpu']:.2f}x | {r['host_us']:.1f} | "
                     f"{r['eager_host_us']:.1f} | {r['speedup_host']:.2f}x | {r['instance']} |")
    lines += ["", f"Geomean over {len(rows)} problems: {geo([r['speedup_gpu'] for r in rows]):.2f}x eager GPU time, "
              f"{geo([r['speedup_host'] for r in rows]):.2f}x eager host-inclusive. Slower than eager: "
              f"{len(slow_gpu)} in GPU time, {len(slow_host)} host-inclusive."]
    if judged:
        worst = max(judged, key=lambda r: r["pick_vs_own"])
        lines += [f"Pick vs own best over the {len(judged)} problems tuned on their own: geomean "
                  f"{geo([r['pick_vs_own'] for r in judged]):.2f}x, worst {worst['pick_vs_own']:.2f}x "
                  f"({worst['op']} {worst['problem']}); within 1.15x: "
                  f"{sum(r['pick_vs_own'] <= 1.15 for r in judged)}/{len(judged)}."]
        by_src: dict[str, list[float]] = {}
        for r in judged:
            by_src.setdefault(r["source"], []).append(r["pick_vs_own"])
        lines += ["By source: " + ", ".join(f"{k} {geo(v):.2f}x over {len(v)}" for k, v in sorted(by_src.items())) + "."]
    lines.append("")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"heldout-{dev}.md").write_text("\n".join(lines))
    (out / f"heldout-{dev}.json").write_text(json.dumps({"device": info.name, "tune_trials": args.tune_trials,
                                                         "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
