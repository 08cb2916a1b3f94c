"""`ckgen bench`: every op's suite on this GPU, ckgen against PyTorch eager and torch.compile.

For each op (default: every registered op with a benchmark, `OpSpec.bench_callables`; ckgen's
eight: GroupNorm forward, backward, backward dx only and backward dgamma/dbeta only, max and avg
pooling forward and backward) the suite is the op's default problems (its tuning space's list:
Stable Diffusion UNet/VAE, detection and batch-1 shapes for GroupNorm; ResNet/VGG-style shapes
for pooling); `--quick` takes every third. Each problem is timed three ways, on torch tensors,
as the op's `bench_callables` gives them:

- ckgen: the public ckgen function (what `ckgen.torch`'s ops call);
- eager: PyTorch's op: F.group_norm (+ F.silu), native_group_norm_backward (after silu_backward
  for swish; its output mask asks for what the ckgen op computes: dx, dgamma/dbeta or all three;
  channels-last: the autograd path for those gradients, since the native op takes NCHW only),
  F.max_pool2d / F.avg_pool2d and aten's pooling backward ops;
- compile: torch.compile of the eager function (dynamic=False).

GPU-only us: CUDA events around each call with L2 flushed before it, median (ckgen.runtime.bench.Timer,
as the tuner times). Host-inclusive us: Timer.back_to_back, rounds of back-to-back calls timed
event to event, per call, median: what a Python caller sees, dispatch overhead included (no L2
flush between calls), as bench/*.py report it.

Writes DIR/bench-<device>.md, .json and .png (the plot needs matplotlib). Needs PyTorch and a GPU.
"""
from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

class _BenchOps(Sequence):
    """The names of the registered ops `ckgen bench` times (those with `bench_callables`), in
    registration order; read at each use, so an op registered later is in it."""

    def _names(self) -> tuple[str, ...]:
        from ..ops import registered_ops

        return tuple(o.name for o in registered_ops() if o.bench_ready)

    def __getitem__(self, i: Any) -> Any:
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


OPS: Sequence[str] = _BenchOps()


def suite(op_name: str, quick: bool) -> list[Any]:
    from ..ops import get_op

    problems = get_op(op_name).default_problems()
    return problems[::3] if quick else problems


def callables(op_name: str, p: Any, device: str = "cuda") -> tuple[Callable[[], Any], Callable[[], Any], str]:
    """(ckgen call, eager call, what eager runs) on fresh inputs for problem p, on `device` (the
    ckgen call runs on a GPU only; the eager one anywhere, which the CPU tests use): the op's
    `bench_callables`."""
    from ..runtime.api import functions
    from ..ops import get_op

    if op_name not in OPS:
        raise ValueError(f"op: {op_name!r} is not one of {', '.join(OPS)}")
    return get_op(op_name).bench_callables(p, device, functions.get(op_name))


def run(ops: list[str], out: Path, quick: bool = False, compile: bool = True, log=print) -> Path:
    """Time every problem of `ops`; write the report; return the markdown's path."""
    import torch

    from ..runtime.api import explain
    from ..runtime.bench import Timer
    from ..runtime.target import device_info

    info = device_info(None)
    timer = Timer(info.l2_bytes, warmup=3, runs=20)
    rows: list[dict[str, Any]] = []
    for op_name in ops:
        for p in suite(op_name, quick):
            row: dict[str, Any] = {"op": op_name, "problem": p.key()}
            try:
                ours, eager, eager_kind = callables(op_name, p)
                row["eager_kind"] = eager_kind
                row["source"] = explain(op_name, arch=info.target.arch,
                                              **_explain_fields(op_name, p)).source
                fns = {"ckgen": ours, "eager": eager}
                if compile:
                    try:
                        torch._dynamo.reset()
                        comp = torch.compile(eager, dynamic=False)
                        comp()
                        fns["compile"] = comp
                    except Exception as e:  # noqa: BLE001 - recorded; the row goes on
                        row["compile_error"] = f"{e.__class__.__name__}: {str(e)[:200]}"
                for name, fn in fns.items():
                    gpu = row[f"{name}_gpu_us"] = timer.time(fn).median_us
                    row[f"{name}_host_us"] = timer.back_to_back(fn, gpu_us=gpu).median_us
            except Exception as e:  # noqa: BLE001 - one problem's failure is data
                row["error"] = f"{e.__class__.__name__}: {str(e)[:300]}"
            rows.append(row)
            log(_line(row))
            torch.cuda.empty_cache()
    return write(rows, info, out, quick)


def _explain_fields(op_name: str, p: Any) -> dict[str, Any]:
    from ..ops import get_op

    return get_op(op_name).explain_fields(p)


def _ratio(row: dict[str, Any], other: str, kind: str) -> float | None:
    a, b = row.get(f"ckgen_{kind}_us"), row.get(f"{other}_{kind}_us")
    return b / a if a and b else None


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['op']} {row['problem']}: error {row['error']}"
    parts = [f"{row['op']} {row['problem']}:"]
    for kind in ("gpu", "host"):
        vals = " ".join(f"{n} {row[f'{n}_{kind}_us']:.1f}" for n in ("ckgen", "eager", "compile")
                        if f"{n}_{kind}_us" in row)
        parts.append(f"{kind} us {vals}")
    return " | ".join(parts)


def _f(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def write(rows: list[dict[str, Any]], info: Any, out: Path, quick: bool) -> Path:
    import torch

    from .._version import __version__

    out.mkdir(parents=True, exist_ok=True)
    dev = re.sub(r"[^A-Za-z0-9]+", "-", info.name).strip("-")
    ok = [r for r in rows if "error" not in r]
    lines = [f"# ckgen bench on {info.name} ({info.target.arch})", "",
             f"ckgen {__version__}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
             f"{', --quick' if quick else ''}. GPU-only: CUDA events, L2 flushed before each call, median of 20. "
             "Host-inclusive: rounds of back-to-back calls, event to event, per call, median. "
             "eager: PyTorch's op (column 'eager runs'); compile: torch.compile of it. "
             "source: the dispatcher's choice (tuned / nearest / default).", ""]
    for kind, title in (("gpu", "GPU-only us"), ("host", "host-inclusive us")):
        geo = {o: [r for r in (_ratio(x, o, kind) for x in ok) if r] for o in ("eager", "compile")}
        gm = {o: math.exp(sum(map(math.log, v)) / len(v)) if v else None for o, v in geo.items()}
        lines += [f"## {title} (geomean speedup: {_f(gm['eager'], '.2f')}x over eager, "
                  f"{_f(gm['compile'], '.2f')}x over torch.compile)", "",
                  "| op | problem | ckgen | eager | compile | vs eager | vs compile | source | eager runs |",
                  "|---|---|---:|---:|---:|---:|---:|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['op']} | {r['problem']} | error: {r['error']} | | | | | | |")
                continue
            lines.append(f"| {r['op']} | {r['problem']} | {_f(r.get(f'ckgen_{kind}_us'))} | "
                         f"{_f(r.get(f'eager_{kind}_us'))} | {_f(r.get(f'compile_{kind}_us'))} | "
                         f"{_f(_ratio(r, 'eager', kind), '.2f')}x | {_f(_ratio(r, 'compile', kind), '.2f')}x | "
                         f"{r.get('source', '')} | {r.get('eager_kind', '')} |")
        lines.append("")
    errs = [f"- {r['op']} {r['problem']}: torch.compile failed: {r['compile_error']}" for r in rows
            if "compile_error" in r]
    if errs:
        lines += ["## Notes", "", *errs, ""]
    md = out / f"bench-{dev}.md"
    md.write_text("\n".join(lines))
    (out / f"bench-{dev}.json").write_text(json.dumps({"device": info.name, "arch": info.target.arch,
                                                       "rows": rows}, indent=1))
    try:
        plot(ok, out / f"bench-{dev}.png", info.name)
    except Exception as e:  # noqa: BLE001 - no matplotlib, or a plotting problem: the tables stand
        print(f"ckgen bench: no plot ({e.__class__.__name__}: {e})", file=sys.stderr)
    return md


def plot(rows: list[dict[str, Any]], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.35 * len(rows)), 8), sharex=True)
    xs = range(len(rows))
    for ax, kind, title in ((axes[0], "gpu", "GPU-only"), (axes[1], "host", "host-inclusive")):
        for i, other in enumerate(("eager", "compile")):
            vals = [_ratio(r, other, kind) or float("nan") for r in rows]  # nan: not measured
            ax.bar([x + (i - 0.5) * 0.4 for x in xs], vals, 0.4, label=f"ckgen vs {other}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(f"speedup ({title})")
        ax.legend(fontsize=8)
    axes[1].set_xticks(list(xs))
    axes[1].set_xticklabels([f"{r['op']} {r['problem'][:40]}" for r in rows], rotation=90, fontsize=6)
    fig.suptitle(f"ckgen bench, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
