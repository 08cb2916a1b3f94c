"""`ckgen tune | retune | generate | bench | list | db show | db export`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

console = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)
SAMPLERS = ("gp", "tpe", "random")  # ckgen.sampler.STRATEGIES less optuna-gp (needs torch)


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _problems(op: Any, args: argparse.Namespace) -> list[Any]:
    if args.shape:
        return op.problems_from_cli(args)
    acts = [args.activation] if getattr(args, "activation", None) else None
    return op.default_problems(args.dtype, args.layout, acts)


def cmd_tune(args: argparse.Namespace) -> int:
    from .ops import get_op
    from .target import gpu_status

    try:
        op = get_op(args.op)
        problems = _problems(op, args)
    except ValueError as e:
        err.print(f"ckgen tune: {e}", markup=False)
        return 2
    why = gpu_status()
    if why:
        err.print(f"ckgen tune: no usable GPU: {why}", markup=False)
        return 2
    import time

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from . import db as dbmod
    from . import settings
    from .target import device_info
    from .tune import db_entry, tune_problem

    info = device_info(None)
    db_path = Path(args.db) if args.db else settings.user_db_path()
    storage = args.storage or settings.study_storage_url()
    console.print(f"tuning {len(problems)} problem(s) of {op.name} on {info.name} ({info.target.arch}); "
                  f"DB {db_path}; study storage {storage}")
    table = Table(title=f"{op.name} on {info.name}")
    for col in ("problem", "best instance", "us", "spread", "GB/s", "copy-eq eff", "vs default", "failed"):
        table.add_column(col)
    start, results = time.monotonic(), []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("best {task.fields[best]}"), TimeElapsedColumn(), console=console) as bar:
        for p in problems:
            left = None if args.total_timeout is None else args.total_timeout - (time.monotonic() - start)
            if left is not None and left <= 0:
                console.print("[yellow]total time budget spent; remaining problems not tuned[/]")
                break
            timeout = min(x for x in (args.timeout, left) if x is not None) if (args.timeout or left) else None
            task = bar.add_task(p.key(), total=args.trials, best="-")

            def progress(done: int, total: int, best: float, task: Any = task) -> None:
                bar.update(task, completed=done, best=f"{best:.1f} us" if best < float("inf") else "-")

            try:
                r = tune_problem(op, p, info, trials=args.trials, timeout=timeout, storage=storage,
                                 seed=args.seed, sampler=args.sampler, on_trial=progress)
            except RuntimeError as e:
                err.print(f"{p.key()}: {e}", markup=False)
                continue
            try:
                dbmod.save_entries(db_path, [db_entry(r, info)])
            except dbmod.DBError as e:  # a corrupt DB: the entry is kept in a side file (e.kept)
                err.print(f"{p.key()}: {e}", markup=False)
                continue
            results.append(r)
            table.add_row(p.key(), r.best.instance, f"{r.best.timing.median_us:.1f}",
                          f"{100 * r.best.timing.spread:.0f}%", f"{r.gbps:.0f}", f"{r.efficiency:.2f}",
                          f"{r.speedup_vs_default:.2f}x", str(len(r.failures)))
    console.print(table)
    for r in results:
        for cfg, why in r.failures[:5]:
            console.print(f"[yellow]failed[/] {r.problem.key()} {cfg}: {why}")
    console.print(f"wrote {len(results)} entr{'y' if len(results) == 1 else 'ies'} to {db_path}")
    return 0 if len(results) == len(problems) else 1


def _load_db(args: argparse.Namespace) -> Any:
    from . import db as dbmod
    from . import settings

    return dbmod.load_layered(Path(args.db) if args.db else settings.user_db_path(), strict=True)


def cmd_list(args: argparse.Namespace) -> int:
    from .ops import all_ops

    t = Table(title="ops")
    for col in ("op", "template", "tunables", "default problems"):
        t.add_column(col)
    for op in all_ops():
        sp = op.space
        n = len(sp.default_problems.get("shapes", []))
        t.add_row(op.name, op.template, ", ".join(sp.params), str(n))
    console.print(t)
    return cmd_db_show(args)


def cmd_db_show(args: argparse.Namespace) -> int:
    from . import db as dbmod

    try:
        db = _load_db(args)
    except dbmod.DBError as e:
        err.print(f"ckgen: {e}", markup=False)
        return 2
    t = Table(title=f"instance DB ({len(db.entries)} entries)")
    for col in ("op", "arch", "device", "problem", "instance", "us", "GB/s"):
        t.add_column(col)
    for e in db.select(getattr(args, "op", None)):
        t.add_row(e.op, e.arch, e.device, e.problem, e.instance, f"{e.time_us:.1f}", f"{e.gbps:.0f}")
    console.print(t)
    return 0


def cmd_db_export(args: argparse.Namespace) -> int:
    from . import db as dbmod

    try:
        dbmod.export_csv(_load_db(args), sys.stdout)
    except dbmod.DBError as e:
        err.print(f"ckgen: {e}", markup=False)
        return 2
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import tempfile

    from . import db as dbmod
    from . import library

    targets = [t for t in args.target.split(",") if t]
    try:
        for t in targets:
            library.Target.named(t)
        shipped = dbmod.InstanceDB.load(Path(args.db) if args.db else dbmod.shipped_db_path())
        instances = library.plan(targets, args.ops.split(",") if args.ops else None,
                                 from_db=not args.defaults, db=shipped)
    except (ValueError, dbmod.DBError) as e:
        err.print(f"ckgen generate: {e}", markup=False)
        return 2
    out = Path(args.out)
    if args.check:  # regenerate into a temp folder and compare with `out`
        with tempfile.TemporaryDirectory() as d:
            library.write(instances, Path(d))
            diff = library.drift(out, Path(d))
        if diff:
            err.print(f"ckgen generate --check: {out} is out of date ({len(diff)} files differ, e.g. "
                      f"{', '.join(diff[:3])}); run `ckgen generate` with the same options and commit", markup=False)
            return 1
        console.print(f"{out}: up to date ({len(instances)} instances)")
        return 0
    try:
        for t in targets:  # a target's generated folders are rewritten whole: no stale instances stay behind
            library.clear_target(out, t)
    except ValueError as e:
        err.print(f"ckgen generate: {e}", markup=False)
        return 2
    library.write(instances, out)
    console.print(f"wrote {len(instances)} instances for {', '.join(targets)} under {out}")
    if args.no_compile:
        return 0
    built = library.build(instances, args.jobs)
    library.write_reports(built, out)
    failed = [b for b in built if not b.ok]
    for b in failed:
        err.print(f"FAILED {b.instance.target.arch} {b.instance.source.name}:\n{b.message}", markup=False)
    console.print(f"built {len(built) - len(failed)} of {len(built)} instances"
                  + (f"; {len(failed)} failed" if failed else ""))
    return 1 if failed else 0


def cmd_retune(args: argparse.Namespace) -> int:
    from .target import gpu_status

    why = gpu_status()
    if why:
        err.print(f"ckgen retune: no usable GPU: {why}", markup=False)
        return 2
    from . import db as dbmod
    from . import settings
    from .ops import get_op
    from .target import device_info
    from .tune import db_entry, retune_plan, tune_problem

    info = device_info(None)
    db_path = Path(args.db) if args.db else settings.user_db_path()
    try:
        db = _load_db(args)
    except dbmod.DBError as e:
        err.print(f"ckgen retune: {e}", markup=False)
        return 2
    plan = retune_plan(db, info.target.arch, args.from_arch, args.ops.split(",") if args.ops else None)
    if not plan:
        console.print(f"nothing to retune: every DB problem is tuned for {info.target.arch} already")
        return 0
    console.print(f"retuning {len(plan)} problem(s) on {info.name} ({info.target.arch}), warm-started "
                  f"from other archs' winners; DB {db_path}")
    table = Table(title=f"retune on {info.name}")
    for col in ("problem", "from", "old config here (us)", "new winner", "us", "speedup"):
        table.add_column(col)
    import time

    start, done = time.monotonic(), 0
    for item in plan:
        if args.total_timeout is not None and time.monotonic() - start > args.total_timeout:
            console.print("[yellow]total time budget spent; remaining problems not retuned[/]")
            break
        op = get_op(item.op)
        problem = op.problem_from_key(item.problem)
        ok = op.validate(problem, item.config, info.target)
        try:
            r = tune_problem(op, problem, info, trials=args.trials, timeout=args.timeout,
                             storage=args.storage or settings.study_storage_url(), seed=args.seed,
                             sampler=args.sampler, warm=(item.config,) if ok else ())
        except RuntimeError as e:
            err.print(f"{item.problem}: {e}", markup=False)
            continue
        try:
            dbmod.save_entries(db_path, [db_entry(r, info)])
        except dbmod.DBError as e:  # a corrupt DB: the entry is kept in a side file (e.kept)
            err.print(f"{item.problem}: {e}", markup=False)
            continue
        done += 1
        old = r.warm[0].timing.median_us if r.warm else None
        table.add_row(item.problem, item.from_arch,
                      f"{old:.1f}" if old else f"invalid here ({ok.reason})" if not ok else "failed",
                      r.best.instance, f"{r.best.timing.median_us:.1f}",
                      f"{old / r.best.timing.median_us:.2f}x" if old else "-")
    console.print(table)
    console.print(f"wrote {done} entr{'y' if done == 1 else 'ies'} for {info.target.arch} to {db_path}")
    return 0 if done == len(plan) else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from .opbench import OPS

    ops = [o.strip() for o in args.ops.split(",")] if args.ops else list(OPS)
    bad = [o for o in ops if o not in OPS]
    if bad:
        err.print(f"ckgen bench: --ops: unknown {bad}; choose from {', '.join(OPS)}", markup=False)
        return 2
    try:
        import torch  # noqa: F401 - the comparison runs PyTorch's ops
    except ImportError:
        err.print("ckgen bench: needs PyTorch (pip install 'ckgen[torch]')", markup=False)
        return 2
    from .target import gpu_status

    why = gpu_status()
    if why:
        err.print(f"ckgen bench: no usable GPU: {why}", markup=False)
        return 2
    import os

    from .opbench import run

    if getattr(args, "db", None):  # the user DB the dispatcher reads
        os.environ["CKGEN_DB"] = str(args.db)

    out = Path(args.out or os.environ.get("OUT") or "bench-results")
    md = run(ops, out, quick=args.quick, compile=not args.no_compile,
             log=lambda line: console.print(line, markup=False))
    console.print(f"wrote {md} (and .json, .png)")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckgen", description="Generate, tune and dispatch GPU kernels.")
    p.add_argument("--db", help="user instance DB (default: $CKGEN_DB or the user cache dir)")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tune", help="tune an op's problems on this GPU and record winners in the DB")
    t.add_argument("op")
    t.add_argument("--shape", type=_csv_ints, help="N,C,H,W (default: the space's default problems)")
    t.add_argument("--groups", type=int)
    t.add_argument("--dtype", action="append", choices=["fp32", "fp16", "bf16"])
    t.add_argument("--layout", action="append", choices=["nchw", "nhwc"])
    t.add_argument("--activation", choices=["none", "swish"])
    pool = t.add_argument_group("pooling problem", "with --shape, for maxpool2d_* / avgpool2d_*")
    pool.add_argument("--kernel", type=_csv_ints, help="kernel size: K or KH,KW")
    pool.add_argument("--stride", type=_csv_ints, help="stride: S or SH,SW (default: the kernel)")
    pool.add_argument("--padding", type=_csv_ints, help="padding: P or PH,PW (default 0)")
    pool.add_argument("--dilation", type=_csv_ints, help="dilation (max pooling): D or DH,DW (default 1)")
    pool.add_argument("--ceil-mode", action="store_true", help="ceil instead of floor for the output size")
    pool.add_argument("--count-include-pad", action=argparse.BooleanOptionalAction, default=None,
                      help="avg pooling: count the padding in the divisor (default: yes)")
    pool.add_argument("--divisor-override", type=int, help="avg pooling: divide by this instead")
    pool.add_argument("--return-indices", action="store_true", help="maxpool2d_fwd: also write int64 indices")
    pool.add_argument("--indices", choices=["stored", "recompute"],
                      help="maxpool2d_bwd: read stored int64 indices (default) or recompute the argmax from x")
    t.add_argument("--trials", type=int, default=40, help="measured candidates per problem (default 40)")
    t.add_argument("--timeout", type=float, help="seconds per problem")
    t.add_argument("--total-timeout", type=float, help="seconds for the whole run")
    t.add_argument("--storage", help="optuna storage URL (default: SQLite file in the cache dir)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--sampler", choices=SAMPLERS, default="gp",
                   help="search strategy over the valid configs (default gp; see docs/architecture.md)")
    t.add_argument("--db", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    t.set_defaults(fn=cmd_tune)

    g = sub.add_parser("generate", help="write and build the instance library for targets (no GPU needed)")
    g.add_argument("--target", default="sm_80,sm_90,gfx90a,gfx942,gfx1100", help="comma-separated archs")
    g.add_argument("--ops", help="comma-separated ops (default: all)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--from-db", action="store_true", help="the DB's winners (default)")
    src.add_argument("--defaults", action="store_true", help="the default config for each default problem")
    g.add_argument("--out", default="generated", help="library folder (default: generated)")
    g.add_argument("--no-compile", action="store_true", help="write sources and manifests only")
    g.add_argument("--check", action="store_true", help="fail if --out differs from a fresh generation")
    g.add_argument("--jobs", type=int, help="parallel compiles (default: CPU count)")
    g.add_argument("--db", default=argparse.SUPPRESS, help="DB to take winners from (default: the shipped DB)")
    g.set_defaults(fn=cmd_generate)

    rt = sub.add_parser("retune", help="re-tune every DB problem tuned on another arch, on this GPU")
    rt.add_argument("--from-arch", help="only problems tuned on this arch (default: any other)")
    rt.add_argument("--ops", help="comma-separated ops (default: all)")
    rt.add_argument("--trials", type=int, default=40)
    rt.add_argument("--timeout", type=float, help="seconds per problem")
    rt.add_argument("--total-timeout", type=float, help="seconds for the whole run")
    rt.add_argument("--storage", help="optuna storage URL")
    rt.add_argument("--seed", type=int, default=0)
    rt.add_argument("--sampler", choices=SAMPLERS, default="gp", help="search strategy (default gp)")
    rt.add_argument("--db", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    rt.set_defaults(fn=cmd_retune)

    b = sub.add_parser("bench", help="time every op's suite on this GPU against PyTorch eager and torch.compile")
    b.add_argument("--ops", help="comma-separated ops (default: all six)")
    b.add_argument("--out", help="folder for bench-<device>.md/.json/.png (default: $OUT or ./bench-results)")
    b.add_argument("--quick", action="store_true", help="every third problem of each suite")
    b.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    b.add_argument("--db", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    b.set_defaults(fn=cmd_bench)

    ls = sub.add_parser("list", help="list ops and DB entries")
    ls.add_argument("--db", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    ls.set_defaults(fn=cmd_list)

    d = sub.add_parser("db", help="inspect the instance DB")
    dsub = d.add_subparsers(dest="dbcmd", required=True)
    show = dsub.add_parser("show")
    show.add_argument("--op")
    show.add_argument("--db", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    show.set_defaults(fn=cmd_db_show)
    exp = dsub.add_parser("export", help="CSV to stdout")
    exp.add_argument("--db", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    exp.set_defaults(fn=cmd_db_export)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
