"""Host time per call of every public op, on tiny shapes (the GPU never limits), in one run:

    python bench/host_overhead.py [--out DIR] [--calls 2000] [--breakdown]

For each of the 8 public ops: host time per call = wall time of `--calls` back-to-back calls
(then one synchronize) / calls, median of 7 rounds, for
  - ckgen with torch tensors, and with CuPy arrays;
  - PyTorch eager doing the same job (the aten op that autograd runs);
  - the floor: a bare CuPy RawKernel launch of an empty kernel, and a bare cuLaunchKernel
    through cupy.cuda.driver (what ckgen's plans call);
  - a CUDA-graph replay of one captured ckgen call (torch.cuda.graph), per replay;
  - the op's GPU time (CUDA events, L2 flushed), to show the GPU is not the limit.
Writes DIR/<date>-host-overhead-<device>.md and .json (DIR: --out, else $OUT, else bench/results;
bench/reports.py names them).
Targets: <= 12 us per call for the forward ops and the pooling backward ops,
<= 15 us for the GroupNorm backward ops, never more than 1.5x PyTorch eager's host time."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def wall_per_call(fn, calls: int, rounds: int = 7, sync=None) -> tuple[float, float, float]:
    """(median, min, max) over rounds of wall time per call, in us, for `calls` calls + one sync."""
    for _ in range(50):
        fn()
    sync()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(out), min(out), max(out)


def interleaved(fns: list, calls: int, rounds: int = 9, sync=None) -> list[list[float]]:
    """Wall time per call (us) of each of `fns`, measured in alternating rounds (A B C A B C ...),
    so that the host's drift (this machine's speed varies by tens of percent over seconds) hits
    every column alike. Returns the per-round times of each fn."""
    for fn in fns:
        for _ in range(50):
            fn()
    sync()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            out[i].append((time.perf_counter() - t0) * 1e6 / calls)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).with_name("results")))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--breakdown", action="store_true", help="also time the pieces of one GroupNorm call")
    args = ap.parse_args()

    import cupy
    import torch
    import torch.nn.functional as F

    import ckgen
    from ckgen.runtime.bench import Timer
    from ckgen.runtime.target import device_info

    info = device_info(None)
    timer = Timer(info.l2_bytes, warmup=5, runs=30)
    sync = torch.cuda.synchronize
    aten = torch.ops.aten
    dt = torch.bfloat16
    dev = "cuda"

    # tiny shapes
    N, C, H, W, G = 2, 32, 8, 8, 8
    x = torch.randn(N, C, H, W, device=dev, dtype=dt)
    gamma = torch.randn(C, device=dev, dtype=dt)
    beta = torch.randn(C, device=dev, dtype=dt)
    dy = torch.randn_like(x)
    _, mean, rstd = ckgen.groupnorm_fwd(x, gamma, beta, G)
    _, tmean, trstd = aten.native_group_norm(x, gamma, beta, N, C, H * W, G, 1e-5)
    k, s, p = 3, 2, 1
    xp = torch.randn(2, 16, 8, 8, device=dev, dtype=dt)
    yp, idx = ckgen.maxpool2d_fwd(xp, k, s, p, return_indices=True)
    dyp = torch.randn_like(yp)
    _, tidx = aten.max_pool2d_with_indices(xp, [k, k], [s, s], [p, p], [1, 1], False)

    # the same calls with CuPy arrays (bf16 as ckgen.bfloat16 of the uint16 bits)
    def cp16(t):
        return ckgen.bfloat16(cupy.from_dlpack(t.view(torch.int16).detach()).view(cupy.uint16))

    cx, cg, cb, cdy = cp16(x), cp16(gamma), cp16(beta), cp16(dy)
    cmean, crstd = cupy.from_dlpack(mean), cupy.from_dlpack(rstd)
    cxp, cdyp, cidx = cp16(xp), cp16(dyp), cupy.from_dlpack(idx)

    cases = [
        ("groupnorm_fwd", lambda: ckgen.groupnorm_fwd(x, gamma, beta, G),
         lambda: ckgen.groupnorm_fwd(cx, cg, cb, G),
         lambda: aten.native_group_norm(x, gamma, beta, N, C, H * W, G, 1e-5), "aten.native_group_norm"),
        ("groupnorm_fwd swish", lambda: ckgen.groupnorm_fwd(x, gamma, beta, G, activation="swish"),
         lambda: ckgen.groupnorm_fwd(cx, cg, cb, G, activation="swish"),
         lambda: F.silu(F.group_norm(x, G, gamma, beta)), "F.silu(F.group_norm)"),
        ("groupnorm_bwd", lambda: ckgen.groupnorm_bwd(dy, x, mean, rstd, gamma, G),
         lambda: ckgen.groupnorm_bwd(cdy, cx, cmean, crstd, cg, G),
         lambda: aten.native_group_norm_backward(dy, x, tmean, trstd, gamma, N, C, H * W, G, [True, True, True]),
         "aten.native_group_norm_backward"),
        ("groupnorm_bwd_data", lambda: ckgen.groupnorm_bwd_data(dy, x, mean, rstd, gamma, G),
         lambda: ckgen.groupnorm_bwd_data(cdy, cx, cmean, crstd, cg, G),
         lambda: aten.native_group_norm_backward(dy, x, tmean, trstd, gamma, N, C, H * W, G, [True, False, False]),
         "aten.native_group_norm_backward (dx)"),
        ("groupnorm_bwd_gamma_beta", lambda: ckgen.groupnorm_bwd_gamma_beta(dy, x, mean, rstd, G),
         lambda: ckgen.groupnorm_bwd_gamma_beta(cdy, cx, cmean, crstd, G),
         lambda: aten.native_group_norm_backward(dy, x, tmean, trstd, gamma, N, C, H * W, G, [False, True, True]),
         "aten.native_group_norm_backward (dgamma, dbeta)"),
        ("maxpool2d_fwd", lambda: ckgen.maxpool2d_fwd(xp, k, s, p),
         lambda: ckgen.maxpool2d_fwd(cxp, k, s, p),
         lambda: F.max_pool2d(xp, k, s, p), "F.max_pool2d"),
        ("maxpool2d_fwd indices", lambda: ckgen.maxpool2d_fwd(xp, k, s, p, return_indices=True),
         lambda: ckgen.maxpool2d_fwd(cxp, k, s, p, return_indices=True),
         lambda: aten.max_pool2d_with_indices(xp, [k, k], [s, s], [p, p], [1, 1], False),
         "aten.max_pool2d_with_indices"),
        ("maxpool2d_bwd", lambda: ckgen.maxpool2d_bwd(dyp, xp, k, s, p, indices=idx),
         lambda: ckgen.maxpool2d_bwd(cdyp, cxp, k, s, p, indices=cidx),
         lambda: aten.max_pool2d_with_indices_backward(dyp, xp, [k, k], [s, s], [p, p], [1, 1], False, tidx),
         "aten.max_pool2d_with_indices_backward"),
        ("avgpool2d_fwd", lambda: ckgen.avgpool2d_fwd(xp, k, s, p),
         lambda: ckgen.avgpool2d_fwd(cxp, k, s, p),
         lambda: F.avg_pool2d(xp, k, s, p), "F.avg_pool2d"),
        ("avgpool2d_bwd", lambda: ckgen.avgpool2d_bwd(dyp, xp, k, s, p),
         lambda: ckgen.avgpool2d_bwd(cdyp, cxp, k, s, p),
         lambda: aten.avg_pool2d_backward(dyp, xp, [k, k], [s, s], [p, p], False, True, None),
         "aten.avg_pool2d_backward"),
    ]

    # the floor: an empty kernel, launched bare
    mod = cupy.RawModule(code='extern "C" __global__ void empty_kernel() {}')
    empty = mod.get_function("empty_kernel")
    fptr = empty.kernel.ptr
    from cupy.cuda import driver

    floor_raw = wall_per_call(lambda: empty((1,), (32,), ()), args.calls, sync=sync)
    floor_drv = wall_per_call(lambda: driver.launchKernel(fptr, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0), args.calls, sync=sync)
    print(f"floor: CuPy RawKernel {floor_raw[0]:.2f} us, cuLaunchKernel {floor_drv[0]:.2f} us", flush=True)

    rows = []
    for name, ours, ours_cupy, eager, eager_kind in cases:
        r_ours, r_cupy, r_eager = interleaved([ours, ours_cupy, eager], args.calls, sync=sync)
        t_ours = statistics.median(r_ours), min(r_ours), max(r_ours)
        t_cupy = statistics.median(r_cupy), min(r_cupy), max(r_cupy)
        t_eager = statistics.median(r_eager), min(r_eager), max(r_eager)
        ratio = statistics.median(a / b for a, b in zip(r_ours, r_eager))  # round by round
        gpu = timer.time(ours).median_us
        # CUDA graph: capture one call (after the warm-up above), replay back to back
        replay = None
        try:
            s_ = torch.cuda.Stream()
            s_.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s_):
                for _ in range(3):
                    ours()
            torch.cuda.current_stream().wait_stream(s_)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ours()
            replay = wall_per_call(g.replay, args.calls, sync=sync)[0]
        except Exception as e:  # noqa: BLE001 - recorded in the table
            print(f"{name}: graph capture failed: {e.__class__.__name__}: {e}", file=sys.stderr)
        choice = plan = None
        try:
            from ckgen.runtime.api import planners

            op = name.split()[0]
            plan = planners[op](*{"groupnorm_fwd": (x, gamma, beta, G),
                                         "groupnorm_bwd": (dy, x, mean, rstd, gamma, G),
                                         "groupnorm_bwd_data": (dy, x, mean, rstd, gamma, G),
                                         "groupnorm_bwd_gamma_beta": (dy, x, mean, rstd, G),
                                         "maxpool2d_fwd": (xp, k, s, p), "maxpool2d_bwd": (dyp, xp, k, s, p),
                                         "avgpool2d_fwd": (xp, k, s, p), "avgpool2d_bwd": (dyp, xp, k, s, p)}[op],
                                  **({"activation": "swish"} if "swish" in name else
                                     {"return_indices": True} if "indices" in name else
                                     {"indices": idx} if op == "maxpool2d_bwd" else {}))[0]
            choice = plan.choice
        except Exception as e:  # noqa: BLE001
            print(f"{name}: explain failed: {e}", file=sys.stderr)
        rows.append({"op": name, "ckgen_us": t_ours[0], "ckgen_min_us": t_ours[1], "ckgen_max_us": t_ours[2],
                     "ckgen_cupy_us": t_cupy[0], "eager_us": t_eager[0], "eager": eager_kind,
                     "ratio_eager": ratio, "graph_replay_us": replay, "gpu_us": gpu,
                     "launches": plan.launches if plan else None, "instance": choice.instance if choice else None})
        r = rows[-1]
        print(f"{name:28s} ckgen {r['ckgen_us']:6.2f} us (cupy {r['ckgen_cupy_us']:6.2f}) | eager {r['eager_us']:6.2f} "
              f"| x{r['ratio_eager']:.2f} | graph {replay or float('nan'):6.2f} | gpu {gpu:6.2f}", flush=True)

    if args.breakdown:
        breakdown(x, gamma, beta, G, args.calls, sync)

    from reports import report_stem  # bench/reports.py

    stem = report_stem("host-overhead", info.name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    limit = {"groupnorm_bwd": 15.0, "groupnorm_bwd_data": 15.0, "groupnorm_bwd_gamma_beta": 15.0}
    lines = [f"# Host time per call on {info.name} ({info.target.arch})", "",
             f"Measured in one run by bench/host_overhead.py ({torch.__version__=}, CuPy {cupy.__version__}): "
             f"wall time of {args.calls} back-to-back calls, then one synchronize, / {args.calls}; median of 9 rounds, "
             "the rounds of ckgen (torch), ckgen (CuPy) and eager interleaved; ckgen / eager is the median of the "
             "per-round ratios. "
             "Tiny shapes (GroupNorm 2x32x8x8 G=8, pooling 2x16x8x8 k3 s2 p1, bf16 NCHW), so the GPU never limits "
             "(its time per call, L2 flushed, is the last column). eager: the aten op PyTorch runs for the same job. "
             "graph: torch.cuda.graph replay of one captured ckgen call, per replay.", "",
             f"Floor: a bare CuPy RawKernel launch of an empty kernel {floor_raw[0]:.2f} us; "
             f"a bare cuLaunchKernel (cupy.cuda.driver.launchKernel, what ckgen's plans call) {floor_drv[0]:.2f} us.", "",
             "| op | launches | ckgen us (torch) | ckgen us (CuPy) | eager us | ckgen / eager | target | met | graph replay us | GPU us | eager op |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lim = limit.get(r["op"].split()[0], 12.0)
        met = r["ckgen_us"] <= lim and r["ratio_eager"] <= 1.5
        g = f"{r['graph_replay_us']:.2f}" if r["graph_replay_us"] else "failed"
        lines.append(f"| {r['op']} | {r['launches']} | {r['ckgen_us']:.2f} | {r['ckgen_cupy_us']:.2f} | {r['eager_us']:.2f} | "
                     f"{r['ratio_eager']:.2f} | <= {lim:g} us, <= 1.5x | {'yes' if met else 'NO'} | {g} | "
                     f"{r['gpu_us']:.2f} | {r['eager']} |")
    lines.append("")
    (out / f"{stem}.md").write_text("\n".join(lines))
    (out / f"{stem}.json").write_text(json.dumps(
        {"device": info.name, "floor_rawkernel_us": floor_raw[0], "floor_culaunch_us": floor_drv[0], "rows": rows},
        indent=1))
    print("\n".join(lines))
    return 0


def breakdown(x, gamma, beta, G, calls, sync) -> None:
    """Time the pieces of one groupnorm_fwd call (printed only; to see where the time goes)."""
    import torch

    from ckgen.runtime.api import groupnorm as gn
    from ckgen.runtime.tensors import sig

    plan, ins = gn._plan_fwd(x, gamma, beta, G)
    dev = x.device
    pieces = {
        "sig(x)": lambda: sig(x),
        "3x sig": lambda: (sig(x), sig(gamma), sig(beta)),
        "plan lookup (_plan_fwd)": lambda: gn._plan_fwd(x, gamma, beta, G),
        "plan.run": lambda: plan.run(ins, 1e-5, x),
        "torch.empty_strided": lambda: torch.empty_strided((2, 32, 8, 8), (2048, 64, 8, 1), dtype=x.dtype, device=dev),
        "torch.empty (N,G) f32": lambda: torch.empty((2, 8), dtype=torch.float32, device=dev),
        "raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "cupy getDevice": lambda: __import__("cupy").cuda.runtime.getDevice(),
        "full call": lambda: gn.groupnorm_fwd(x, gamma, beta, G),
    }
    for name, fn in pieces.items():
        t = wall_per_call(fn, calls, rounds=5, sync=sync)[0]
        print(f"  breakdown {name:28s} {t:6.3f} us", flush=True)


if __name__ == "__main__":
    sys.exit(main())
