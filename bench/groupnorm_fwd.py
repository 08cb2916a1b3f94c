"""Benchmark tuned ckgen GroupNorm forward against PyTorch eager and torch.compile, in one run.

    python bench/groupnorm_fwd.py [--tune-trials 30] [--out bench/results]

Writes DIR/<date>-groupnorm-fwd-<device>.md and .json (bench/reports.py names them).

Every number is measured in this run: device events, L2 flushed before each run, median.
Copy-equivalent efficiency = time of a device copy moving the op's minimum bytes / op time."""
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
    op = get_op("groupnorm_fwd")
    timer = Timer(info.l2_bytes, warmup=5, runs=40)
    suite = yaml.safe_load(Path(args.suite).read_text())["groupnorm_fwd"]
    dts = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    rows = []
    for case in suite:
        N, C, H, W, G = case["shape"]
        act = case["activation"]
        p = op.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=case["dtype"], layout=case["layout"], activation=act)
        explained = ckgen.explain("groupnorm_fwd", N=N, C=C, H=H, W=W, G=G, dtype=case["dtype"],
                                  layout=case["layout"], activation=act, arch=info.target.arch)
        if explained.source != "tuned" and args.tune_trials > 0:
            r = tune_problem(TuneRequest.on(op, p, info, trials=args.tune_trials, storage=None, seed=0), info)  # in-memory study
            dbmod.save_entries(settings.user_db_path(), [db_entry(r, info)])
            ckgen.reload_db()
        fmt = torch.channels_last if case["layout"] == "nhwc" else torch.contiguous_format
        x = torch.randn(N, C, H, W, device="cuda", dtype=dts[case["dtype"]]).contiguous(memory_format=fmt)
        gamma = (1 + 0.1 * torch.randn(C, device="cuda")).to(x.dtype)
        beta = (0.1 * torch.randn(C, device="cuda")).to(x.dtype)
        swish = act == "swish"

        def eager():
            y = F.group_norm(x, G, gamma, beta, 1e-5)
            return F.silu(y) if swish else y

        def ours():
            return ckgen.groupnorm_fwd(x, gamma, beta, G, activation=act if swish else None)

        choice = ckgen.explain("groupnorm_fwd", x, gamma, beta, G, activation=act if swish else None)
        y_ours = ours()[0]
        y_ref = eager()
        err = (y_ours.float() - y_ref.float()).abs().max().item()
        sb = timer.side_by_side(ours, eager, op.min_bytes(p),
                                None if args.no_compile else (lambda: torch.compile(eager, dynamic=False)),
                                lambda e: print(f"torch.compile failed for {p.key()}: {e.__class__.__name__}: {e}",
                                                file=sys.stderr))
        rows.append({
            "problem": p.key(), **sb.suite_columns(),
            "instance": choice.instance, "source": choice.source, "max_abs_err_vs_torch": err,
        })
        r_ = rows[-1]
        print(f"{p.key():70s} ckgen {r_['ckgen_us']:8.1f} us eff {r_['ckgen_eff']:.2f} | eager {r_['eager_us']:8.1f} "
              f"| compile {r_['compile_us'] or float('nan'):8.1f} | x{r_['speedup_eager']:.2f} [{choice.source}]",
              flush=True)

    geo = math.exp(sum(math.log(r["speedup_eager"]) for r in rows) / len(rows))
    from reports import report_stem  # bench/reports.py

    stem = report_stem("groupnorm-fwd", info.name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# groupnorm_fwd on {info.name} ({info.target.arch})", "",
             "Measured in one run by bench/groupnorm_fwd.py: CUDA events, GPU time with L2 flushed before every run (hides host time), median of 40. "
             "Copy = device-to-device copy of the op's minimum bytes (x read + y written), same run. "
             "eff = copy time / op time.", "",
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
    (out / f"{stem}.json").write_text(json.dumps({"device": info.name, "rows": [{"op": "groupnorm_fwd", **r} for r in rows]},
                                                 indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
