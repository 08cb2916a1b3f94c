"""A/B in one process: each DB entry's config rendered with today's templates (old) and with the
templates in NEWDIR (new); both verified on the same fresh inputs, then timed interleaved (rounds x
median of 25, L2 flushed)."""
import json, math, shutil, statistics, sys, time
from pathlib import Path
import yaml
import ckgen.codegen as cg
from ckgen.bench import Timer
from ckgen.compile import compile_many
from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.target import device_info
from ckgen.types import Config
from ckgen.verify import Harness



def main():
    global OLD, NEW
    sub, out, rounds = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 3
    OLD = cg.TEMPLATE_DIR
    NEW = Path("/tmp/tnew")
    shutil.rmtree(NEW, ignore_errors=True)
    shutil.copytree(OLD, NEW)
    shutil.copy("scratch/ab/prelude.cvt.j2", NEW / "common/prelude.cuh.j2")
    shutil.copy("scratch/ab/vec_io.x2.j2", NEW / "common/vec_io.cuh.j2")


    def use(d):
        cg.TEMPLATE_DIR = d
        cg.environment.cache_clear()


    info = device_info(None)
    T = info.target
    ents = yaml.safe_load(open(sub))["entries"]
    jobs = []
    for e in ents:
        op = get_op(e["op"]); p = op.problem_from_key(e["problem"]); c = Config.of(e["config"])
        use(OLD); a = render_instance(op, p, c, T)
        use(NEW); b = render_instance(op, p, c, T)
        jobs.append((e, op, p, c, a, b))
    use(OLD)
    t0 = time.monotonic()
    compile_many([j[4] for j in jobs] + [j[5] for j in jobs], T)
    print(f"compiled {2 * len(jobs)} in {time.monotonic() - t0:.0f}s", flush=True)
    timer = Timer(info.l2_bytes)
    rows = []
    for i, (e, op, p, c, a, b) in enumerate(jobs):
        h = Harness(op, p, seed=i)
        row = {"op": e["op"], "problem": e["problem"], "config": e["config"], "copy_us": timer.copy_time(op.min_bytes(p)).median_us}
        try:
            ra, rb = h.runner(a, c, T), h.runner(b, c, T)
            ca, cb = h.check(ra), h.check(rb)
            row["ok_old"], row["ok_new"] = ca.ok, cb.ok
            if not cb.ok:
                row["detail_new"] = cb.detail
            ta, tb = [], []
            for r in range(rounds):
                for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                    (ta if which == 0 else tb).append(timer.time(ra if which == 0 else rb).median_us)
            row.update(old_us=statistics.median(ta), new_us=statistics.median(tb), old_all=ta, new_all=tb)
        except Exception as ex:  # noqa: BLE001
            row["error"] = f"{ex.__class__.__name__}: {str(ex)[:300]}"
        rows.append(row)
        q = row["new_us"] / row["old_us"] if "new_us" in row else float("nan")
        print(f"[{i + 1}/{len(jobs)} {time.monotonic() - t0:.0f}s] {e['op']} {e['problem']}: old {row.get('old_us', 0):.1f} new {row.get('new_us', 0):.1f} "
              f"new/old {q:.3f} ok {row.get('ok_old')}/{row.get('ok_new')} {row.get('error', '')}", flush=True)
        out.write_text(json.dumps({"device": info.name, "arch": T.arch, "rows": rows}, indent=0))
    g = {}
    for r in rows:
        if "new_us" in r:
            k = r["op"] + (" nhwc" if "layout=nhwc" in r["problem"] else " nchw")
            g.setdefault(k, []).append(r["new_us"] / r["old_us"])
    for k, v in sorted(g.items()):
        print(f"{k}: {len(v)} configs, geomean new/old {math.exp(sum(map(math.log, v)) / len(v)):.3f}, best {min(v):.2f}, worst {max(v):.2f}")


if __name__ == '__main__':
    main()
