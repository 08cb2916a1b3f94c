"""Re-time the DB entries whose source today's templates re-hash (the CUDA bf16 rounding change):
each entry's config rendered with the templates of the last commit (old: must give the stored
hash) and today's (new), both run on the same inputs: outputs compared bit for bit (NaN = NaN),
then timed interleaved (rounds x median of 25, L2 flushed, as the tuner times). Writes rows in
bench/template_ab.py's format (us = new) for tools/retime-entries.py.

    python scratch/ab/retime.py OUT.json [ROUNDS]"""
import json, statistics, sys, time
from pathlib import Path
import numpy as np
import yaml

import ckgen.codegen as cg
from ckgen.bench import Timer
from ckgen.compile import compile_many
from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.ops.numeric import max_violation
from ckgen.target import device_info
from ckgen.types import Config
from ckgen.verify import Harness

OLD = Path("scratch/ab/old/templates").resolve()


def use(d):
    cg.TEMPLATE_DIR = d
    cg.environment.cache_clear()


def fast_gn_inputs(op, p, rng):
    """GroupNorm inputs without the float64 reference (timing and old/new comparison only)."""
    shape = (p.N, p.C, p.H, p.W)
    x = (rng.standard_normal(shape, dtype=np.float32) * 1.5 + 0.3).astype(np.float32)
    d = {"x": x, "gamma": (1 + 0.25 * rng.standard_normal(p.C, dtype=np.float32)),
         "beta": 0.25 * rng.standard_normal(p.C, dtype=np.float32)}
    if "dy" in op.arg_names:
        xs = x.reshape(p.N, p.G, -1)
        m = xs.mean(-1, dtype=np.float64)
        v = xs.var(-1, dtype=np.float64)
        d["mean"] = m.astype(np.float32)
        d["rstd"] = (1 / np.sqrt(v + 1e-5)).astype(np.float32)
        d["dy"] = rng.standard_normal(shape, dtype=np.float32)
    return d


def fast_maxpool_dev(op, p):
    """Device buffers of a large bf16 max pool problem, made by PyTorch on the GPU: x random; the
    backward's stored indices are PyTorch's argmax of x (the same convention: h * W + w per
    plane, checked against ckgen's reference), dy random; all in the problem's memory order."""
    import cupy
    import torch
    import torch.nn.functional as F
    x = torch.randn(p.N, p.C, p.H, p.W, device="cuda").to(torch.bfloat16)
    order = (lambda t: t.contiguous()) if p.layout == "nchw" else (lambda t: t.permute(0, 2, 3, 1).contiguous())
    bits = lambda t: cupy.asarray(order(t).view(torch.int16).reshape(-1)).view(cupy.uint16)  # noqa: E731
    if op.name == "maxpool2d_fwd":
        return {"x": bits(x)}
    assert p.indices == "stored"
    _, idx = F.max_pool2d(x, p.kernel, p.stride, p.padding, p.dilation, p.ceil_mode, return_indices=True)
    dy = torch.randn(idx.shape, device="cuda").to(torch.bfloat16)
    return {"dy": bits(dy), "indices": cupy.asarray(order(idx).reshape(-1))}


def main():
    out, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2
    skip = set()
    if len(sys.argv) > 3:  # rows already timed (an earlier run's JSON): skip them
        skip = {(r["op"], r["problem"], json.dumps(r["config"], sort_keys=True))
                for r in json.loads(Path(sys.argv[3]).read_text())["rows"] if "us" in r}
    info = device_info(None)
    T = info.target
    NEW = cg.TEMPLATE_DIR
    ents = yaml.safe_load(open("ckgen/data/instances.yaml"))["entries"]
    jobs = []
    for e in ents:
        if e["target"]["arch"] != T.arch:
            continue
        op = get_op(e["op"]); p = op.problem_from_key(e["problem"]); c = Config.of(e["config"])
        use(NEW); b = render_instance(op, p, c, T)
        if b.sha256 == e["source_sha256"] or (e["op"], e["problem"], json.dumps(e["config"], sort_keys=True)) in skip:
            continue
        use(OLD); a = render_instance(op, p, c, T)
        jobs.append((p.numel, e, op, p, c, a, b, a.sha256 == e["source_sha256"]))
    use(NEW)
    jobs.sort(key=lambda j: j[0])
    t0 = time.monotonic()
    compile_many([j[5] for j in jobs] + [j[6] for j in jobs], T)
    print(f"{len(jobs)} stale entries; compiled in {time.monotonic() - t0:.0f}s", flush=True)
    timer = Timer(info.l2_bytes)
    rows = []
    cache = {}
    for i, (_, e, op, p, c, a, b, old_matches) in enumerate(jobs):
        row = {"db": "instances.yaml", "op": e["op"], "problem": e["problem"], "config": e["config"],
               "old_hash_matches_entry": old_matches, "entry_us": e["time_us"]}
        try:
            gn = e["op"].startswith("groupnorm")
            ck = (type(op).__mro__[1].__name__ if gn else e["op"], e["problem"])
            big_pool = e["op"].startswith("maxpool") and p.numel > 50_000_000
            if big_pool:
                cache[ck] = {}
            if ck not in cache:
                cache.clear()
                rng = np.random.default_rng(i)
                cache[ck] = fast_gn_inputs(op, p, rng) if gn else op.make_inputs(p, rng)
            h = Harness.__new__(Harness)
            h.op, h.problem, h.eps, h.inputs, h.ref = op, p, 1e-5, cache[ck], {}
            import cupy
            if big_pool:
                h.dev_in = fast_maxpool_dev(op, p)
            else:
                h.dev_in = {k: cupy.asarray(v) for k, v in op.pack_inputs(p, h.inputs).items()}
            h.dev_out = {k: cupy.empty(n, dt) for k, (n, dt) in op.output_buffers(p).items()}
            ra, rb = h.runner(a, c, T), h.runner(b, c, T)

            def outs(run):
                h.poison(); run(); cupy.cuda.get_current_stream().synchronize()
                return {k: v.copy() for k, v in h.dev_out.items()}
            oa, ob = outs(ra), outs(rb)
            ident = True
            worst = 0.0
            for k in oa:
                x1, x2 = oa[k], ob[k]
                if x1.view(cupy.uint8).tobytes() == x2.view(cupy.uint8).tobytes():
                    continue
                f1 = op.unpack_outputs(p, {**oa})[k] if k in op.outputs else None
                u1 = op.unpack_outputs(p, oa); u2 = op.unpack_outputs(p, ob)
                if k in u1:
                    n1, n2 = cupy.isnan(u1[k]), cupy.isnan(u2[k])
                    same = (u1[k] == u2[k]) | (n1 & n2)
                    if bool(same.all()):
                        continue
                    tol = op.problem_tolerance(p, k)
                    worst = max(worst, float(max_violation(u2[k], u1[k], tol.atol, tol.rtol)))
                ident = False
            row["bitwise_identical"] = ident
            if not ident:
                oa2 = outs(ra)
                row["old_deterministic"] = all(oa[k].view(cupy.uint8).tobytes() == oa2[k].view(cupy.uint8).tobytes() for k in oa)
                row["worst_vs_old_in_tolerances"] = worst
            ta, tb = [], []
            for r in range(rounds):
                for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                    (ta if which == 0 else tb).append(timer.time(ra if which == 0 else rb).median_us)
            row.update(us=statistics.median(tb), old_us=statistics.median(ta), new_all=tb, old_all=ta, instance=b.name)
        except Exception as ex:  # noqa: BLE001
            row["error"] = f"{ex.__class__.__name__}: {str(ex)[:300]}"
        rows.append(row)
        q = row["us"] / row["old_us"] if "us" in row else float("nan")
        if i % 10 == 0 or "error" in row or not row.get("bitwise_identical", True):
            print(f"[{i + 1}/{len(jobs)} {time.monotonic() - t0:.0f}s] {e['op']} {e['problem']}: old {row.get('old_us', 0):.1f} "
                  f"new {row.get('us', 0):.1f} ({q:.3f}) ident {row.get('bitwise_identical')} {row.get('error', '')}", flush=True)
        if i % 10 == 0 or i == len(jobs) - 1:
            out.write_text(json.dumps({"device": info.name, "arch": T.arch, "rows": rows}, indent=0))
    out.write_text(json.dumps({"device": info.name, "arch": T.arch, "rows": rows}, indent=0))
    print(f"done {len(rows)} in {time.monotonic() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
