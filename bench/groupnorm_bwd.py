"""Benchmark tuned ckgen GroupNorm backward (dx, dgamma, dbeta) against PyTorch eager and
torch.compile, in one run.

    python bench/groupnorm_bwd.py [--tune-trials 30] [--out bench/results]

Writes DIR/<date>-groupnorm-bwd-<device>.md and .json (bench/reports.py names them).

PyTorch eager: NCHW runs aten.native_group_norm_backward (after aten.silu_backward on the saved
pre-activation for swish), what autograd runs; channels-last, which that op rejects, runs the
autograd backward of F.group_norm (then F.silu) itself. torch.compile compiles the native
function (inductor decomposes it into Triton kernels), for both layouts.
Every number is measured in this run: device events, GPU time with L2 flushed before every run (hides host time), median.
Copy-equivalent efficiency = time of a device copy moving the minimum bytes (x + dy read, dx
written) / op time."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import yaml


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default=str(Path(__file__).with_name("suite.yaml")))
    ap.add_argument("--tune-trials", type=int, default=30, help="tune untuned suite shapes first (0: don't)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results")))
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    import ckgen
    from ckgen.runtime import db as dbmod
    from ckgen import settings
    from ckgen.runtime.bench import Timer, host_cells
    from ckgen.ops import get_op
    from ckgen.runtime.target import device_info
    from ckgen.tuner.tune import TuneRequest, db_entry, tune_problem

    info = device_info(None)
    op = get_op("groupnorm_bwd")
    timer = Timer(info.l2_bytes, warmup=5, runs=40)
    suite = yaml.safe_load(Path(args.suite).read_text())["groupnorm_bwd"]
    dts = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    aten = torch.ops.aten
    rows = []
    for case in suite:
        N, C, H, W, G = case["shape"]
        act = case["activation"]
        swish = act == "swish"
        p = op.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=case["dtype"], layout=case["layout"], activation=act)
        explained = ckgen.explain("groupnorm_bwd", N=N, C=C, H=H, W=W, G=G, dtype=case["dtype"],
                                  layout=case["layout"], activation=act, arch=info.target.arch)
        tuned_here = None
        if explained.source != "tuned" and args.tune_trials > 0:
            r = tune_problem(TuneRequest.on(op, p, info, trials=args.tune_trials, storage=None, seed=0), info)  # in-memory study
            dbmod.save_entries(settings.user_db_path(), [db_entry(r, info)])
            ckgen.reload_db()
            tuned_here = r
        fmt = torch.channels_last if case["layout"] == "nhwc" else torch.contiguous_format
        dt = dts[case["dtype"]]
        x = (torch.randn(N, C, H, W, device="cuda") + 0.5).to(dt).contiguous(memory_format=fmt)
        dy = torch.randn(N, C, H, W, device="cuda").to(dt).contiguous(memory_format=fmt)
        gamma = (1 + 0.1 * torch.randn(C, device="cuda")).to(dt)
        beta = (0.1 * torch.randn(C, device="cuda")).to(dt)
        # mean/rstd as PyTorch's forward stores them (computed on an NCHW copy: same values)
        ypre, mean, rstd = aten.native_group_norm(x.contiguous(), gamma, beta, N, C, H * W, G, 1e-5)
        ypre = ypre.contiguous(memory_format=fmt)
        mean32, rstd32 = mean.float(), rstd.float()  # PyTorch keeps them in x's dtype; ckgen takes fp32

        def native(dy=dy, x=x, mean=mean, rstd=rstd, gamma=gamma, ypre=ypre):
            g = aten.silu_backward(dy, ypre) if swish else dy
            return aten.native_group_norm_backward(g, x, mean, rstd, gamma, N, C, H * W, G, [True, True, True])

        if case["layout"] == "nchw":
            eager, eager_kind = native, "native_group_norm_backward"
        else:  # the native op rejects channels-last input: time what autograd runs for it
            xr, wr, br = (t.detach().requires_grad_() for t in (x, gamma, beta))
            yr = F.group_norm(xr, G, wr, br, 1e-5)
            yr = F.silu(yr) if swish else yr

            def eager(yr=yr, xr=xr, wr=wr, br=br, dy=dy):
                return torch.autograd.grad(yr, (xr, wr, br), dy, retain_graph=True)

            eager_kind = "autograd"

        def ours():
            return ckgen.groupnorm_bwd(dy, x, mean32, rstd32, gamma, G, beta, activation=act if swish else None)

        choice = ckgen.explain("groupnorm_bwd", dy, x, mean32, rstd32, gamma, G, beta, activation=act if swish else None)
        got, ref = ours(), eager()
        errs = [(a.float() - b.float()).abs().max().item() for a, b in zip(got, ref)]
        sb = timer.side_by_side(ours, eager, op.min_bytes(p),
                                None if args.no_compile else (lambda: torch.compile(native, dynamic=False)),
                                lambda e: print(f"torch.compile failed for {p.key()}: {e.__class__.__name__}: {e}",
                                                file=sys.stderr))
        rows.append({
            "problem": p.key(), **sb.suite_columns(),
            "instance": choice.instance, "source": choice.source, "eager": eager_kind,
            "max_abs_diff_vs_torch": {"dx": errs[0], "dgamma": errs[1], "dbeta": errs[2]},
            "tuned_in_this_run": bool(tuned_here),
            "default_config_us": tuned_here.default.timing.median_us if tuned_here and tuned_here.default else None,
        })
        r_ = rows[-1]
        print(f"{p.key():70s} ckgen {r_['ckgen_us']:8.1f} us eff {r_['ckgen_eff']:.2f} | eager {r_['eager_us']:8.1f} "
              f"| compile {r_['compile_us'] or float('nan'):8.1f} | x{r_['speedup_eager']:.2f} [{choice.source}] "
              f"{choice.instance} diff {errs}", flush=True)

    geo = math.exp(sum(math.log(r["speedup_eager"]) for r in rows) / len(rows))
    from reports import report_stem  # bench/reports.py

    stem = report_stem("groupnorm-bwd", info.name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# groupnorm_bwd on {info.name} ({info.target.arch})", "",
             "Measured in one run by bench/groupnorm_bwd.py: CUDA events, GPU time with L2 flushed before every run (hides host time), median of 40. "
             "ckgen: `ckgen.groupnorm_bwd` (dx, dgamma, dbeta; deterministic). eager: NCHW aten.native_group_norm_backward "
             "(after aten.silu_backward for swish), what autograd runs; channels-last: torch.autograd.grad of "
             "F.group_norm (+F.silu), since the native op rejects channels-last input. "
             "compile: torch.compile of the native-op function. Copy = device-to-device copy of the minimum bytes "
             "(x + dy read, dx written), same run. eff = copy time / op time.", "",
             "| problem | min MB | copy us | ckgen us | GB/s | eff | eager us | eager eff | compile us | vs eager | vs compile | host-incl us: ckgen / eager / compile | vs eager, host-incl | vs compile, host-incl | instance |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        comp = f"{r['compile_us']:.1f}" if r["compile_us"] else "n/a"
        spc = f"{r['speedup_compile']:.2f}x" if r["speedup_compile"] else "n/a"
        lines.append(f"| {r['problem']} | {r['min_MB']:.1f} | {r['copy_us']:.1f} | {r['ckgen_us']:.1f} | "
                     f"{r['ckgen_GBps']:.0f} | {r['ckgen_eff']:.2f} | {r['eager_us']:.1f} | {r['eager_eff']:.2f} | "
                     f"{comp} | {r['speedup_eager']:.2f}x | {spc} | "
                     + host_cells(r) + f"{r['instance']} ({r['source']}) |")
    geo_h = math.exp(sum(math.log(r["speedup_eager_host"]) for r in rows) / len(rows))
    lines += ["", f"Geomean speedup over PyTorch eager: {geo:.2f}x GPU time, {geo_h:.2f}x host-inclusive "
              "(back-to-back calls, no flush: what a model's loop sees)", ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    (out / f"{stem}.json").write_text(json.dumps({"device": info.name, "rows": [{"op": "groupnorm_bwd", **r} for r in rows]},
                                                 indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
