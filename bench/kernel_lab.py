"""Kernel lab: in ONE GPU run, check and time several kernel variants on several shapes against a
same-size copy (and, for real problems, PyTorch eager and torch.compile), and print a short
table last. Two kinds of rows:

- probes: small raw-CUDA kernels that move the bytes of a problem in a given *structure* (a
  plain streaming copy; a block that holds its share in registers, with or without a block
  reduction or a cluster exchange between its loads and its stores). They bound what a design
  of that structure can reach, with no GroupNorm arithmetic in the way.
- configs: real ckgen instances (any op, any config, new knob values included), compiled,
  verified against the float64 reference on fresh inputs (the tuner's harness) and timed as the
  tuner times (L2 flushed, median).

    python bench/kernel_lab.py --plan bench/lab/plan.yaml [--out DIR] [--compile-torch]
    python bench/kernel_lab.py --plan PLAN --only NAME --once   # one launch of one row (for ncu)

A plan is YAML: `probes: [{bytes: N, kind: stream|hold, threads, items, min_blocks, reduce,
cluster}]` and `configs: [{name, op, problem: KEY, config: {...}}]`, plus `torch: [{op, problem}]`
for the eager / torch.compile columns. Results go to DIR/lab.json; the table to stdout."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

PROBE_SRC = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
constexpr int T = LAB_T, I = LAB_I, MB = LAB_MB, CLUSTER = LAB_CLUSTER;
constexpr bool REDUCE = LAB_REDUCE;
// One block holds T*I 16-byte vectors of the data (its share), loads them all, optionally sums
// them over the block (REDUCE) and exchanges the sum with the other blocks of its cluster
// (CLUSTER > 1), then stores them. The stores depend on the sum, as GroupNorm's do.
extern "C" __global__ void __launch_bounds__(T, MB) {CLUSTER_ATTR}
hold(const uint4* __restrict__ x, uint4* __restrict__ y, long long nvec)
{
  const long long base = (long long)blockIdx.x * T * I;
  uint4 v[I];
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < I; ++k) {
    long long o = base + k * T + threadIdx.x;
    if (o < nvec) v[k] = __ldg(x + o); else v[k] = make_uint4(0, 0, 0, 0);
  }
  float total = 0.f;
  if (REDUCE) {
#pragma unroll
    for (int k = 0; k < I; ++k) s += __uint_as_float(v[k].x & 0x3fffffffu);
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
    __shared__ float red[T / 32];
    __shared__ float tot;
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
      float t = threadIdx.x < T / 32 ? red[threadIdx.x] : 0.f;
#pragma unroll
      for (int m = 16; m > 0; m >>= 1) t += __shfl_xor_sync(0xffffffffu, t, m);
      if (threadIdx.x == 0) tot = t;
    }
#if LAB_CLUSTER > 1
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();
    float all = 0.f;
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) all += *cl.map_shared_rank(&tot, r);
    cl.sync();
    total = all;
#else
    __syncthreads();
    total = tot;
#endif
  }
#pragma unroll
  for (int k = 0; k < I; ++k) {
    long long o = base + k * T + threadIdx.x;
    uint4 w = v[k];
    if (total == 1234.5f) w.x ^= 1u;  // a dependency on the sum the compiler cannot drop
    if (o < nvec) y[o] = w;
  }
}

// A plain grid-stride copy with I vectors in flight per thread.
extern "C" __global__ void __launch_bounds__(T, MB)
stream(const uint4* __restrict__ x, uint4* __restrict__ y, long long nvec)
{
  const long long step = (long long)gridDim.x * T * I;
  for (long long b = (long long)blockIdx.x * T * I + threadIdx.x; b < nvec; b += step) {
    uint4 v[I];
#pragma unroll
    for (int k = 0; k < I; ++k) if (b + k * T < nvec) v[k] = __ldg(x + b + k * T);
#pragma unroll
    for (int k = 0; k < I; ++k) if (b + k * T < nvec) y[b + k * T] = v[k];
  }
}
"""


def probe_name(p: dict) -> str:
    cl = f"_c{p.get('cluster', 1)}" if p.get("cluster", 1) > 1 else ""
    red = "_red" if p.get("reduce") else ""
    return f"{p['kind']}_t{p['threads']}_i{p['items']}_m{p.get('min_blocks', 1)}{red}{cl}_{p['bytes'] >> 20}MB"


def run_probe(p: dict, timer: Any, sms: int) -> dict:
    import cupy as cp

    T, I, MB = p["threads"], p["items"], p.get("min_blocks", 1)
    cluster = p.get("cluster", 1)
    src = (f"#define LAB_T {T}\n#define LAB_I {I}\n#define LAB_MB {MB}\n#define LAB_REDUCE {int(bool(p.get('reduce')))}\n"
           f"#define LAB_CLUSTER {cluster}\n" + PROBE_SRC.replace(
               "{CLUSTER_ATTR}", f"__cluster_dims__({cluster}, 1, 1)" if cluster > 1 else ""))
    mod = cp.RawModule(code=src, options=("--std=c++17", "-arch=sm_90"), name_expressions=None)
    k = mod.get_function(p["kind"])
    half = p["bytes"] // 2
    nvec = half // 16
    x = cp.random.randint(0, 2**31, size=nvec * 4, dtype=cp.uint32).view(cp.uint32)
    y = cp.empty_like(x)
    if p["kind"] == "hold":
        grid = -(-nvec // (T * I))
        grid = -(-grid // cluster) * cluster
    else:
        grid = sms * p.get("blocks_per_sm", 2)
    fn = lambda: k((grid,), (T,), (x, y, cp.int64(nvec)))  # noqa: E731
    fn()
    cp.cuda.Device().synchronize()
    ok = bool((y == x).all()) if p["kind"] == "stream" or not p.get("reduce") else bool((y[:4096] == x[:4096]).all())
    t = timer.time(fn).median_us
    return {"name": probe_name(p), "us": t, "ok": ok, "grid": grid}


def expand_configs(c: dict, target: Any) -> list[dict]:
    """A plan's config row -> rows of one config each: `config: {...}` as it is; `sweep: {knob:
    value, ...}` every valid config of the op's space with those knob values; `db: true` the
    shipped DB's config for the problem (the reference to beat)."""
    from ckgen.ops import get_op
    from ckgen.runtime.db import InstanceDB
    from ckgen.types import Config

    op = get_op(c["op"])
    p = op.problem_from_key(c["problem"])
    if "config" in c:
        return [c]
    if c.get("db"):
        e = InstanceDB.load(Path(__file__).resolve().parents[1] / "ckgen/data/instances.yaml").lookup(
            op.name, target.arch, p.key())
        if e is None:
            return []
        cfg = Config.of(e.config_dict())
        return [dict(op=c["op"], problem=c["problem"], config=cfg.as_dict(), name="db " + op.instance_name(p, cfg))]
    want = c["sweep"]
    out = []
    for cfg in op.space.enumerate():
        if all(cfg[k] == v for k, v in want.items()) and op.validate(p, cfg, target):
            out.append(dict(op=c["op"], problem=c["problem"], config=cfg.as_dict()))
    return out


_HARNESS: dict[tuple[str, str], Any] = {}


def run_config(c: dict, timer: Any, info: Any) -> dict:
    from ckgen.ops import get_op
    from ckgen.runtime.verify import Harness
    from ckgen.tuner.tune import Objective, TrialFailed
    from ckgen.types import Config

    op = get_op(c["op"])
    p = op.problem_from_key(c["problem"])
    cfg = Config.of(c["config"])
    v = op.validate(p, cfg, info.target)
    row = {"name": c.get("name") or op.instance_name(p, cfg), "op": c["op"], "problem": c["problem"],
           "config": c["config"], "copy_us": timer.copy_time(op.min_bytes(p)).median_us}
    if not v:
        return dict(row, error=f"invalid: {v.reason}")
    key = (c["op"], c["problem"])
    if key not in _HARNESS:
        _HARNESS.clear()  # one problem's buffers at a time
        _HARNESS[key] = Harness(op, p)
    obj = Objective(op, p, info.target, _HARNESS[key], timer)
    try:
        m = obj.measure(cfg)
        row.update(us=m.timing.median_us, instance=m.instance)
    except TrialFailed as e:
        row.update(error=str(e)[:400])
    return row


def torch_pattern(key: str, device: str = "cuda") -> tuple[Any, str]:
    """The PyTorch code a fused GroupNorm problem replaces, on fresh inputs: act(GN(x + b[n, c])
    * gamma + beta + r), as a model writes it (F.group_norm, then the add and the activation)."""
    import torch
    import torch.nn.functional as F

    from ckgen.ops import get_op

    p = get_op("groupnorm_fwd").problem_from_key(key)
    dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[p.dtype]
    fmt = torch.channels_last if p.layout == "nhwc" else torch.contiguous_format
    x = torch.randn(p.N, p.C, p.H, p.W, device=device).to(dt).contiguous(memory_format=fmt)
    r = torch.randn_like(x) if p.residual else None
    b = torch.randn(p.N, p.C, device=device).to(dt) if p.bias_nc else None
    gamma = (1 + 0.1 * torch.randn(p.C, device=device)).to(dt)
    beta = (0.1 * torch.randn(p.C, device=device)).to(dt)
    act = {"none": lambda t: t, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
           "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[p.activation]

    def f():
        h = x + b[:, :, None, None] if b is not None else x
        y = F.group_norm(h, p.G, gamma, beta, 1e-5)
        return act(y + r if r is not None else y)

    what = ("x + b[n,c] -> " if b is not None else "") + "F.group_norm" + (" + r" if r is not None else "") + \
        (f" -> {p.activation}" if p.activation != "none" else "")
    return f, what


def run_pattern(key: str, timer: Any) -> dict:
    import torch

    from ckgen.ops import get_op

    f, what = torch_pattern(key)
    p = get_op("groupnorm_fwd").problem_from_key(key)
    row = {"name": f"torch {key}", "problem": key, "what": what, "eager_us": timer.time(f).median_us,
           "copy_us": timer.copy_time(get_op("groupnorm_fwd").min_bytes(p)).median_us}
    try:
        comp = torch.compile(f)
        comp()
        row["compile_us"] = timer.time(comp).median_us
    except Exception as e:  # noqa: BLE001 - a lab row, reported
        row["compile_error"] = str(e)[:200]
    return row


def summary(rows: list[dict]) -> None:
    """Per problem: the shipped DB's config, the best config measured (and the best of each
    slice_in), the same-size copy, PyTorch eager and torch.compile of the pattern."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        if "problem" in r:
            by.setdefault(r["problem"], []).append(r)
    print(f"\n{'problem':<64} {'what':<30} {'us':>7} {'eff':>5} {'vs eager':>8} {'vs comp':>8}")
    for key, rs in by.items():
        pat = next((r for r in rs if "eager_us" in r), None)
        cfgs = [r for r in rs if r.get("us")]
        bad = [r for r in rs if "error" in r and not r["error"].startswith("invalid")]
        lines = []
        db = [r for r in cfgs if r["name"].startswith("db ")]
        if db:
            lines.append(("shipped DB", db[0]))
        for si in sorted({r["config"]["slice_in"] for r in cfgs if "slice_in" in r["config"]}):
            best = min((r for r in cfgs if r["config"].get("slice_in") == si and not r["name"].startswith("db ")),
                       key=lambda r: r["us"], default=None)
            if best:
                lines.append((f"best {si} of {sum(r['config'].get('slice_in') == si for r in cfgs)}", best))
        for what, r in lines:
            ve = f"{pat['eager_us'] / r['us']:7.2f}x" if pat else "       -"
            vc = f"{pat['compile_us'] / r['us']:7.2f}x" if pat and pat.get("compile_us") else "       -"
            print(f"{key[:64]:<64} {what:<30} {r['us']:7.1f} {r['copy_us'] / r['us']:5.2f} {ve} {vc}  "
                  f"{r['name'].replace('ckgen_groupnorm_fwd_', '')[-48:]}")
        if pat:
            print(f"{key[:64]:<64} {'torch eager / compile':<30} {pat['eager_us']:7.1f} / "
                  f"{pat.get('compile_us', float('nan')):.1f}  ({pat['what']})")
        for r in bad[:3]:
            print(f"{key[:64]:<64} FAILED {r['name'][-50:]}: {r['error'][:150]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="run only rows whose name contains this")
    ap.add_argument("--once", action="store_true", help="one launch per row, no timing (for ncu)")
    ap.add_argument("--all-rows", action="store_true", help="print every config row, not only each problem's best")
    a = ap.parse_args()

    import yaml

    from ckgen.runtime.bench import Timer
    from ckgen.runtime.target import device_info

    plan = yaml.safe_load(Path(a.plan).read_text())
    info = device_info(None)
    timer = Timer(info.l2_bytes, runs=5 if a.once else 40)
    if a.once:
        timer.warmup = 1
    rows: list[dict] = []
    out = Path(a.out) if a.out else None
    t0 = time.monotonic()

    def keep(name: str) -> bool:
        return a.only is None or a.only in name

    def save() -> None:
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "lab.json").write_text(json.dumps({"device": info.name, "rows": rows}, indent=1))

    for p in plan.get("probes", []):
        if keep(probe_name(p)):
            try:
                rows.append(run_probe(p, timer, info.num_sms))
            except Exception as e:  # noqa: BLE001 - a lab row, reported
                rows.append({"name": probe_name(p), "error": str(e)[:300]})
            print(f"[{time.monotonic() - t0:5.0f}s] {rows[-1]}", flush=True)
            save()
    configs = [x for c in plan.get("configs", []) if keep(c.get("name", "") + c["problem"])
               for x in expand_configs(c, info.target)]
    if configs:
        from ckgen.instance import render_instance
        from ckgen.ops import get_op
        from ckgen.runtime.compile import compile_many
        from ckgen.types import Config

        srcs = []
        for c in configs:
            op = get_op(c["op"])
            try:
                srcs.append(render_instance(op, op.problem_from_key(c["problem"]), Config.of(c["config"]), info.target))
            except ValueError:
                pass
        compile_many(srcs, info.target)
        print(f"[{time.monotonic() - t0:5.0f}s] {len(configs)} configs, {len(srcs)} compiled", flush=True)
    for c in configs:
        if True:
            rows.append(run_config(c, timer, info))
            print(f"[{time.monotonic() - t0:5.0f}s] {rows[-1].get('name')} {rows[-1].get('us')} {rows[-1].get('error', '')}", flush=True)
            save()
    for key in plan.get("torch", []):
        if keep("torch " + key):
            rows.append(run_pattern(key, timer))
            print(f"[{time.monotonic() - t0:5.0f}s] {rows[-1]}", flush=True)
            save()
    if a.once:
        return 0
    # the copy of each probe's bytes, then the table
    copies: dict[int, float] = {}
    print(f"\n{info.name}: us, eff = same-size copy / us (L2 flushed, median)")
    print(f"{'row':<78} {'us':>8} {'eff':>5}  note")
    for p, r in zip([p for p in plan.get("probes", []) if keep(probe_name(p))], rows):
        if p["bytes"] not in copies:
            copies[p["bytes"]] = timer.copy_time(p["bytes"]).median_us
        r["copy_us"] = copies[p["bytes"]]
    summary(rows)
    for r in rows:
        if "eager_us" in r or "problem" in r and not a.all_rows:
            continue
        us = r.get("us") or r.get("ckgen_db_us")
        eff = f"{r['copy_us'] / us:5.2f}" if us and r.get("copy_us") else "    -"
        note = r.get("error", "") or ("" if r.get("ok", True) else "WRONG") or ""
        print(f"{r['name'][:78]:<78} {us if us else float('nan'):8.1f} {eff}  {note[:120]}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
