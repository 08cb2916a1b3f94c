"""ckgen on shapes no DB entry covers (bench/heldout.yaml), the dispatcher choosing on its own,
against PyTorch eager, in one run:

    python bench/heldout.py [--out DIR] [--limit N] [--no-compile] [--tune-trials 40 [--tuned-db FILE] [--tune-budget S]]

For each held-out problem: the dispatcher's pick (tuned / model / nearest / default, as
`ckgen.explain` says), then ckgen's public op, PyTorch eager and torch.compile (dynamic=False)
doing the same job, timed two ways with the same Timer: GPU time (CUDA events, L2 flushed before
every run, which hides host time) and host-inclusive time per call (back-to-back calls, no flush,
as a model's loop runs them). Also a device copy of the op's minimum bytes in the same run (GB/s
and copy-equivalent efficiency = copy time / op time) and the max abs difference to PyTorch as a
sanity check.

With --tune-trials N each problem is also tuned on its own (`tune_problem`, N trials) into
--tuned-db, a separate file (never the user or shipped DB; problems already in it are not tuned
again, so a run cut short by --tune-budget resumes from it); then the public op is timed again
with that file as the user DB: "own best", the reference the pick is judged against (target:
pick within 1.15x of own best, geomean; worst 1.5x), timed in the same run by the same Timer.

Writes DIR/<date>-heldout-<device>.md and .json (DIR: --out, else $OUT, else bench/results; bench/reports.py
names them)."""
from __future__ import annotations

import argparse
import json
import math
import os
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
    """(ours, eager, explain, graph) closures for a case, on fresh random inputs. graph is the job
    as a functional PyTorch graph for torch.compile: the op itself, or for the GroupNorm backward
    ops what inductor sees in a training graph (aten.native_group_norm_backward with the outputs
    the job needs, after silu_backward for swish), not autograd.grad; None where eager already
    is that graph (the pooling ops: one aten op each)."""
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
                    lambda: ckgen.explain(name, x, gamma, beta, G, activation=act), eager)
        dy = torch.randn(N, C, H, W, device="cuda").to(dt).contiguous(memory_format=fmt)
        _, mean, rstd = ckgen.groupnorm_fwd(x, gamma, beta, G)
        xr, wr, br = (t.detach().requires_grad_() for t in (x, gamma, beta))
        yr = F.group_norm(xr, G, wr, br, 1e-5)
        yr = F.silu(yr) if swish else yr
        want = {"groupnorm_bwd": (xr, wr, br), "groupnorm_bwd_data": (xr,), "groupnorm_bwd_gamma_beta": (wr, br)}[name]

        def eager():  # what autograd runs for this job (any layout; the native op rejects channels-last)
            return torch.autograd.grad(yr, want, dy, retain_graph=True)

        # for torch.compile: mean/rstd as PyTorch's forward stores them (an NCHW copy: same values)
        ypre, tmean, trstd = aten.native_group_norm(x.contiguous(), gamma, beta, N, C, H * W, G, 1e-5)
        ypre = ypre.contiguous(memory_format=fmt)
        mask = {"groupnorm_bwd": [True, True, True], "groupnorm_bwd_data": [True, False, False],
                "groupnorm_bwd_gamma_beta": [False, True, True]}[name]

        def graph():
            g = aten.silu_backward(dy, ypre) if swish else dy
            return aten.native_group_norm_backward(g, x, tmean, trstd, gamma, N, C, H * W, G, mask)

        if name == "groupnorm_bwd_gamma_beta":
            def ours():
                return ckgen.groupnorm_bwd_gamma_beta(dy, x, mean, rstd, G, gamma, beta, activation=act)
            return ours, eager, lambda: ckgen.explain(name, dy, x, mean, rstd, G, gamma, beta, activation=act), graph
        fn = getattr(ckgen, name)

        def ours():
            return fn(dy, x, mean, rstd, gamma, G, beta, activation=act)
        return ours, eager, lambda: ckgen.explain(name, dy, x, mean, rstd, gamma, G, beta, activation=act), graph
    k, s, p = case["kernel"], case.get("stride", case["kernel"]), case.get("padding", 0)
    cm = case.get("ceil_mode", False)
    if name == "maxpool2d_fwd":
        ri = case.get("return_indices", False)
        return (lambda: ckgen.maxpool2d_fwd(x, k, s, p, ceil_mode=cm, return_indices=ri),
                lambda: F.max_pool2d(x, k, s, p, ceil_mode=cm, return_indices=ri),
                lambda: ckgen.explain(name, x, k, s, p, ceil_mode=cm, return_indices=ri),
                None)
    if name == "maxpool2d_bwd":
        y, idx = F.max_pool2d(x, k, s, p, ceil_mode=cm, return_indices=True)
        dy = torch.randn_like(y)
        ind = None if case.get("indices") == "recompute" else idx
        return (lambda: ckgen.maxpool2d_bwd(dy, x, k, s, p, ceil_mode=cm, indices=ind),
                lambda: aten.max_pool2d_with_indices_backward(dy, x, [k, k], [s, s], [p, p], [1, 1], cm, idx),
                lambda: ckgen.explain(name, dy, x, k, s, p, ceil_mode=cm, indices=ind),
                None)
    cip = case.get("count_include_pad", True)
    if name == "avgpool2d_fwd":
        return (lambda: ckgen.avgpool2d_fwd(x, k, s, p, ceil_mode=cm, count_include_pad=cip),
                lambda: F.avg_pool2d(x, k, s, p, ceil_mode=cm, count_include_pad=cip),
                lambda: ckgen.explain(name, x, k, s, p, ceil_mode=cm, count_include_pad=cip),
                None)
    dy = torch.randn_like(F.avg_pool2d(x, k, s, p, ceil_mode=cm, count_include_pad=cip))
    return (lambda: ckgen.avgpool2d_bwd(dy, x, k, s, p, ceil_mode=cm, count_include_pad=cip),
            lambda: aten.avg_pool2d_backward(dy, x, [k, k], [s, s], [p, p], cm, cip, None),
            lambda: ckgen.explain(name, dy, x, k, s, p, ceil_mode=cm, count_include_pad=cip),
            None)


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, (tuple, list)) else v


def _tune_own_best(cases, args, info, log) -> dict[tuple[str, str], Any]:
    """Tune every case not yet in --tuned-db, or whose entry there is stale (its template changed since),
    within --tune-budget seconds; {(op, key): entry}."""
    from ckgen.runtime import db as dbmod
    from ckgen.tuner.tune import TuneRequest, db_entry, tune_problem

    path = Path(args.tuned_db)
    t0 = time.monotonic()
    for case in cases:
        op, p = problem_of(case)
        have = dbmod.InstanceDB.load(path) if path.is_file() else None
        e = have.lookup(op.name, info.target.arch, p.key()) if have is not None else None
        if e is not None and dbmod.entry_verified(e):
            continue  # tuned with today's templates (a stale entry is tuned again, and replaced)
        if time.monotonic() - t0 > args.tune_budget:
            log(f"tune budget ({args.tune_budget:.0f} s) spent: {op.name} {p.key()} not tuned")
            continue
        try:
            r = tune_problem(TuneRequest.on(op, p, info, trials=args.tune_trials, storage=None), info)
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
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
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
    from ckgen.runtime.bench import Timer, gbps
    from ckgen.runtime.target import device_info

    from reports import report_stem  # bench/reports.py

    info = device_info(None)
    stem = report_stem("heldout", info.name)  # one date for the whole run
    timer = Timer(info.l2_bytes, warmup=3, runs=20)
    cases = load_cases()[: args.limit or None]
    rows, t0 = [], time.monotonic()

    def log(msg: str) -> None:
        print(f"{msg} ({time.monotonic() - t0:.0f} s)", flush=True)

    def report() -> list[str]:
        """Write DIR/<date>-heldout-<device>.md and .json from the rows so far (after every problem, so a
        run cut short keeps what it measured); the Markdown lines."""
        def geo(vals: list[float]) -> float:
            return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")

        slow_gpu = [r for r in rows if r["speedup_gpu"] < 1.0]
        slow_host = [r for r in rows if r["speedup_host"] < 1.0]
        comp_rows = [r for r in rows if r.get("speedup_compile_gpu")]
        slow_comp_gpu = [r for r in comp_rows if r["speedup_compile_gpu"] < 1.0]
        slow_comp_host = [r for r in comp_rows if r["speedup_compile_host"] < 1.0]
        judged = [r for r in rows if "pick_vs_own" in r]

        def num(v: Any, fmt: str = ".1f", suffix: str = "") -> str:
            return "n/a" if v is None else f"{v:{fmt}}{suffix}"

        lines = [f"# Held-out shapes on {info.name} ({info.target.arch})", "",
                 "Measured in one run by bench/heldout.py on bench/heldout.yaml (shapes no shipped DB entry covers), "
                 "the dispatcher choosing alone (shipped DB + user DB; `source` as `ckgen.explain` says). "
                 "GPU: CUDA events, L2 flushed before every run (hides host time), median of 20. "
                 "host-incl: back-to-back calls without a flush, time per call (median of 7 rounds): what a model's "
                 "loop sees. eager: PyTorch doing the same job (F.group_norm(+F.silu), autograd of it for the "
                 "GroupNorm backward ops, F.max_pool2d / F.avg_pool2d and their aten backward ops). compile: "
                 "torch.compile(dynamic=False) of the same job as a functional graph (for the GroupNorm backward ops "
                 "aten.native_group_norm_backward with the job's outputs, after silu_backward for swish). "
                 "copy: a device-to-device copy of the op's minimum bytes, same run; GB/s = minimum bytes / ckgen GPU "
                 "time; eff = copy time / op time (ckgen / eager / compile). "
                 + (f"own best: the problem tuned on its own ({args.tune_trials} trials, a separate DB file), the "
                    "public op timed again with it in the same run; pick/own > 1 means the pick is slower."
                    if args.tune_trials else "No own-best column in this run (--tune-trials 0)."), "",
                 ("| op | problem | source | min MB | ckgen GPU us | own best GPU us | pick/own | eager GPU us | "
                 "compile GPU us | vs eager GPU | vs compile GPU | GB/s | eff: ckgen / eager / compile | "
                 "host-incl us: ckgen / eager / compile | vs eager host-incl | vs compile host-incl | instance |"),
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ob = num(r.get("own_gpu_us"))
            po = num(r.get("pick_vs_own"), ".2f", "x")
            lines.append(f"| {r['op']} | {r['problem']} | {r['source']} | {r['min_MB']:.2f} | {r['gpu_us']:.1f} | {ob} | "
                         f"{po} | {r['eager_gpu_us']:.1f} | {num(r['compile_gpu_us'])} | {r['speedup_gpu']:.2f}x | "
                         f"{num(r['speedup_compile_gpu'], '.2f', 'x')} | {r['GBps']:.0f} | {r['eff']:.2f} / "
                         f"{r['eager_eff']:.2f} / {num(r['compile_eff'], '.2f')} | {r['host_us']:.1f} / "
                         f"{r['eager_host_us']:.1f} / {num(r['compile_host_us'])} | {r['speedup_host']:.2f}x | "
                         f"{num(r['speedup_compile_host'], '.2f', 'x')} | {r['instance']} |")
        lines += ["", (f"Geomean over {len(rows)} problems: {geo([r['speedup_gpu'] for r in rows]):.2f}x eager GPU time, "
                  f"{geo([r['speedup_host'] for r in rows]):.2f}x eager host-inclusive. Slower than eager: "
                  f"{len(slow_gpu)} in GPU time, {len(slow_host)} host-inclusive.")]
        if comp_rows:
            lines += [(f"torch.compile ({len(comp_rows)} problems compiled): geomean "
                      f"{geo([r['speedup_compile_gpu'] for r in comp_rows]):.2f}x in GPU time, "
                      f"{geo([r['speedup_compile_host'] for r in comp_rows]):.2f}x host-inclusive. Slower than "
                      f"compile: {len(slow_comp_gpu)} in GPU time, {len(slow_comp_host)} host-inclusive.")]
        lines += [f"Copy-equivalent efficiency, geomean: ckgen {geo([r['eff'] for r in rows]):.2f}, eager "
                  f"{geo([r['eager_eff'] for r in rows]):.2f}"
                  + (f", compile {geo([r['compile_eff'] for r in comp_rows]):.2f} (over the compiled problems)"
                     if comp_rows else "") + "."]
        if judged:
            worst = max(judged, key=lambda r: r["pick_vs_own"])
            lines += [(f"Pick vs own best over the {len(judged)} problems tuned on their own: geomean "
                      f"{geo([r['pick_vs_own'] for r in judged]):.2f}x, worst {worst['pick_vs_own']:.2f}x "
                      f"({worst['op']} {worst['problem']}); within 1.15x: "
                      f"{sum(r['pick_vs_own'] <= 1.15 for r in judged)}/{len(judged)}.")]
            by_src: dict[str, list[float]] = {}
            for r in judged:
                by_src.setdefault(r["source"], []).append(r["pick_vs_own"])
            lines += ["By source: " + ", ".join(f"{k} {geo(v):.2f}x over {len(v)}" for k, v in sorted(by_src.items())) + "."]
        lines.append("")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.md").write_text("\n".join(lines))
        (out / f"{stem}.json").write_text(json.dumps({"device": info.name, "tune_trials": args.tune_trials,
                                                             "rows": rows}, indent=1))
        return lines

    for case in cases:
        op, p = problem_of(case)
        ours, eager, explain, graph = calls(case)
        choice = explain()
        got, want = _first(ours()), _first(eager())
        diff = (got.float() - want.float()).abs().max().item()
        nbytes = op.min_bytes(p)
        sb = timer.side_by_side(ours, eager, nbytes,
                                None if args.no_compile else (lambda: torch.compile(graph or eager, dynamic=False)),
                                lambda e: log(f"torch.compile failed for {op.name} {p.key()}: "
                                              f"{e.__class__.__name__}: {e}"))
        if not args.no_compile:
            torch._dynamo.reset()  # one compiled graph per problem: no recompile limit, no cache growth
        copy, g_ours, g_eager, g_comp = sb.copy, sb.ours, sb.eager, sb.comp
        h_ours, h_eager, h_comp = sb.ours_host, sb.eager_host, sb.comp_host
        rows.append({"op": op.name, "problem": p.key(), "source": choice.source, "instance": choice.instance,
                     "reason": choice.reason, "min_MB": nbytes / 1e6, "copy_us": copy.median_us,
                     "gpu_us": g_ours.median_us, "eager_gpu_us": g_eager.median_us,
                     "compile_gpu_us": g_comp.median_us if g_comp else None,
                     "GBps": gbps(nbytes, g_ours.median_us), "eff": copy.median_us / g_ours.median_us,
                     "eager_eff": copy.median_us / g_eager.median_us,
                     "compile_eff": copy.median_us / g_comp.median_us if g_comp else None,
                     "host_us": h_ours.median_us, "eager_host_us": h_eager.median_us,
                     "compile_host_us": h_comp.median_us if h_comp else None,
                     "speedup_gpu": g_eager.median_us / g_ours.median_us,
                     "speedup_host": h_eager.median_us / h_ours.median_us,
                     "speedup_compile_gpu": g_comp.median_us / g_ours.median_us if g_comp else None,
                     "speedup_compile_host": h_comp.median_us / h_ours.median_us if h_comp else None,
                     "max_abs_diff_vs_torch_first_output": diff})
        r = rows[-1]
        cg = f"{r['compile_gpu_us']:8.1f}" if g_comp else "     n/a"
        log(f"{op.name:24s} {p.key():75s} [{choice.source:7s}] gpu {r['gpu_us']:8.1f} vs {r['eager_gpu_us']:8.1f} "
            f"(x{r['speedup_gpu']:.2f}) compile {cg} eff {r['eff']:.2f} | host {r['host_us']:8.1f} vs "
            f"{r['eager_host_us']:8.1f} (x{r['speedup_host']:.2f})")
        del ours, eager, graph
        torch.cuda.empty_cache()
        report()

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
                ours, _, explain, _ = calls(case)
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

    print("\n".join(report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
