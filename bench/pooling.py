"""Benchmark tuned ckgen pooling against PyTorch eager and torch.compile, in one run.

    python bench/pooling.py [--quick] [--tune-trials 16] [--out DIR]   # DIR default: $OUT or bench/results

For each suite shape (bench/pool_suite.yaml): tune (unless tuned already) on a proxy problem with
the same pooling params and layout but a batch small enough for a fast float64 check (the config
does not depend on the shape, and the dispatcher then uses that winner as the nearest tuned
problem), then time ckgen's public op, PyTorch eager and torch.compile with the same Timer
(CUDA events, GPU time with L2 flushed before every run (hides host time), median), and a device copy of the op's minimum bytes.
Writes a markdown table to DIR/<date>-pooling-<device>.md (and .json; bench/reports.py names them)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import yaml

PROXY_ELEMS = 8 << 20  # tune on at most ~8M input elements (the reference is float64 NumPy)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default=str(Path(__file__).with_name("pool_suite.yaml")))
    ap.add_argument("--tune-trials", type=int, default=16, help="trials per untuned shape (0: don't tune)")
    ap.add_argument("--quick", action="store_true", help="the quick subset, 8 trials")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).with_name("results")))
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = ap.parse_args()
    trials = min(args.tune_trials, 8) if args.quick else args.tune_trials

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
    timer = Timer(info.l2_bytes, warmup=5, runs=30)
    suite = [c for c in yaml.safe_load(Path(args.suite).read_text())["pooling"] if c.get("quick") or not args.quick]
    dts = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    rows, t_start = [], time.monotonic()
    for case in suite:
        op = get_op(case["op"])
        N, C, H, W = case["shape"]
        k, s, pad = case["kernel"], case.get("stride", case["kernel"]), case.get("padding", 0)
        extra = {key: case[key] for key in ("return_indices", "indices", "count_include_pad", "divisor_override")
                 if key in case}
        pkw = dict(C=C, H=H, W=W, dtype=case["dtype"], layout=case["layout"], kernel=k, stride=s, padding=pad, **extra)
        p = op.parse_problem(N=N, **pkw)
        explained = ckgen.explain(op.name, N=N, arch=info.target.arch, **pkw)
        if explained.source != "tuned" and trials > 0:
            n_proxy = max(1, min(N, PROXY_ELEMS // (C * H * W)))
            proxy = op.parse_problem(N=n_proxy, **pkw)
            r = tune_problem(TuneRequest.on(op, proxy, info, trials=trials, storage=None, seed=0), info)  # in-memory study
            dbmod.save_entries(settings.user_db_path(), [db_entry(r, info)])
            ckgen.reload_db()
        fmt = torch.channels_last if case["layout"] == "nhwc" else torch.contiguous_format
        x = torch.randn(N, C, H, W, device="cuda", dtype=dts[case["dtype"]]).contiguous(memory_format=fmt)
        mk = dict(kernel_size=k, stride=s, padding=pad)
        if op.name == "maxpool2d_fwd":
            ri = bool(extra.get("return_indices", False))

            def ours():
                return ckgen.maxpool2d_fwd(x, **mk, return_indices=ri)

            def eager():
                return F.max_pool2d(x, **mk, return_indices=ri)
        elif op.name == "maxpool2d_bwd":
            y, idx = F.max_pool2d(x, **mk, return_indices=True)
            dy = torch.randn_like(y)
            stored = extra.get("indices", "stored") == "stored"

            def ours():
                return ckgen.maxpool2d_bwd(dy, x, **mk, indices=idx if stored else None)

            def eager():  # PyTorch always reads stored indices
                return torch.ops.aten.max_pool2d_with_indices_backward(dy, x, [k, k], [s, s], [pad, pad], [1, 1],
                                                                       False, idx)
        elif op.name == "avgpool2d_fwd":
            cip = extra.get("count_include_pad", True)

            def ours():
                return ckgen.avgpool2d_fwd(x, **mk, count_include_pad=cip)

            def eager():
                return F.avg_pool2d(x, **mk, count_include_pad=cip)
        else:
            cip = extra.get("count_include_pad", True)
            dy = torch.randn_like(F.avg_pool2d(x, **mk, count_include_pad=cip))

            def ours():
                return ckgen.avgpool2d_bwd(dy, x, **mk, count_include_pad=cip)

            def eager():
                return torch.ops.aten.avg_pool2d_backward(dy, x, [k, k], [s, s], [pad, pad], False, cip, None)

        got, want = ours(), eager()
        if op.name == "avgpool2d_bwd" and case["layout"] == "nhwc" and pad > 0:
            # PyTorch's CUDA channels-last avg_pool2d backward drops the padding offset and returns
            # wrong gradients when padding > 0 (pytorch/pytorch#188344, fixed after 2.11): the error
            # column compares against its NCHW kernel instead; the eager time is still the NHWC one
            want = torch.ops.aten.avg_pool2d_backward(dy.contiguous(), x.contiguous(), [k, k], [s, s], [pad, pad],
                                                      False, cip, None)
        got = got[0] if isinstance(got, tuple) else got
        want = want[0] if isinstance(want, tuple) else want
        err = (got.float() - want.float()).abs().max().item()
        choice = ckgen.explain(op.name, N=N, arch=info.target.arch, **pkw)
        sb = timer.side_by_side(ours, eager, op.min_bytes(p),
                                None if args.no_compile else (lambda: torch.compile(eager, dynamic=False)),
                                lambda e: print(f"torch.compile failed for {p.key()}: {e.__class__.__name__}: {e}",
                                                file=sys.stderr))
        rows.append({
            "op": op.name, "problem": p.key(), **sb.suite_columns(),
            "instance": choice.instance, "source": choice.source, "max_abs_err_vs_torch": err,
        })
        r_ = rows[-1]
        print(f"{op.name} {p.key():90s} ckgen {r_['ckgen_us']:8.1f} us eff {r_['ckgen_eff']:.2f} | eager "
              f"{r_['eager_us']:8.1f} | compile {r_['compile_us'] or float('nan'):8.1f} | err {err:.3g} "
              f"[{choice.source}] ({time.monotonic() - t_start:.0f} s)", flush=True)

    from reports import report_stem  # bench/reports.py

    stem = report_stem("pooling", info.name)
    geo = math.exp(sum(math.log(r["speedup_eager"]) for r in rows) / len(rows))
    comp = [r["speedup_compile"] for r in rows if r["speedup_compile"]]
    geo_c = math.exp(sum(math.log(v) for v in comp) / len(comp)) if comp else float("nan")
    lines = [f"# pooling on {info.name} ({info.target.arch})", "",
             "Measured in one run by bench/pooling.py: CUDA events, GPU time with L2 flushed before every run (hides host time), median of 30. "
             "Copy = device-to-device copy of the op's minimum bytes, same run; eff = copy time / op time. "
             "maxpool2d_bwd eager/compile read stored int64 indices (PyTorch has no recompute path). "
             "avgpool2d_bwd NHWC with padding: the error column is against PyTorch's NCHW kernel, because its "
             "CUDA channels-last backward returns wrong gradients there (pytorch/pytorch#188344). "
             + ("Configs: what the dispatcher picks from the instance DB (shipped + user); `(tuned)`: this "
              "exact problem's DB entry, `(nearest)`: the winner of the nearest tuned problem with the same "
              "pooling params, layout and dtype. "
              + (f"Untuned suite shapes were first tuned with {trials} trials on a proxy batch "
                 f"(<= {PROXY_ELEMS >> 20}M input elements)." if trials else "No tuning in this run.")), "",
             "| op | problem | min MB | copy us | ckgen us | GB/s | eff | eager us | compile us | vs eager | vs compile "
             "| host-incl us: ckgen / eager / compile | vs eager, host-incl | vs compile, host-incl | max err vs torch | instance |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cu = f"{r['compile_us']:.1f}" if r["compile_us"] else "n/a"
        sc = f"{r['speedup_compile']:.2f}x" if r["speedup_compile"] else "n/a"
        lines.append(f"| {r['op']} | {r['problem']} | {r['min_MB']:.1f} | {r['copy_us']:.1f} | {r['ckgen_us']:.1f} | "
                     f"{r['ckgen_GBps']:.0f} | {r['ckgen_eff']:.2f} | {r['eager_us']:.1f} | {cu} | "
                     f"{r['speedup_eager']:.2f}x | {sc} | "
                     + host_cells(r) + f"{r['max_abs_err_vs_torch']:.3g} | {r['instance']} ({r['source']}) |")
    geo_h = math.exp(sum(math.log(r["speedup_eager_host"]) for r in rows) / len(rows))
    lines += ["", f"Geomean speedup: {geo:.2f}x over PyTorch eager, {geo_c:.2f}x over torch.compile (GPU time); "
              f"{geo_h:.2f}x over eager host-inclusive (back-to-back calls, no flush)", ""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text("\n".join(lines))
    (out / f"{stem}.json").write_text(json.dumps({"device": info.name, "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
