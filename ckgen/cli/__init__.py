"""`ckgen tune | retune | explain | generate | bench | list | db show | db export | db where |
db pull | db merge`.

Every option is checked before anything runs (and before the GPU check): a bad one ends the
command with one line naming it, exit code 2, never a traceback. Tables print as `--format
table|tsv|json` (ckgen.cli.output): a terminal gets a table whose identifiers are never cut, a pipe
gets tab-separated text. Progress is bars on a terminal and one line per finished step elsewhere
(`_Steps`). `--db` names the user DB everywhere: it is layered over the shipped DB by every
command, as the dispatcher layers them."""
from __future__ import annotations

import argparse
import errno
import math
import os
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console

from .._version import __version__
from .output import FORMATS, Col, Sheet, emit, resolve

console = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)
SAMPLERS = ("gp", "tpe", "random")  # ckgen.tuner.sampler.STRATEGIES less optuna-gp (needs torch)


class UsageError(Exception):
    """A user error: printed as one line `<command>: <message>`, exit code 2."""


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


def printable(value: Any) -> str:
    """`ckgen.types.printable`: DB strings come from other machines (`db pull`, `db merge`), and
    a table of them must not move the cursor, recolour or clear the screen, or fake rows. Table
    and tsv cells only: json escapes them itself, and keeps them exact."""
    from ..types import printable as escaped

    return escaped(value)


# ------------------------------------------------------------------ option types (argparse)


def _int_at_least(lo: int, what: str, hi: int | None = None) -> Any:
    def parse(text: str) -> int:
        try:
            v = int(text[:40])  # a longer text is no count (and int() of a huge one costs seconds)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}") from None
        if v < lo or (hi is not None and v > hi) or len(text) > 40:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text[:40]}")
        return v

    parse.__name__ = what
    return parse


_positive_int = _int_at_least(1, "a positive integer")


def _trial_count(text: str) -> int:
    from ..settings import MAX_TUNE_TRIALS

    return _int_at_least(1, f"a positive integer, at most {MAX_TUNE_TRIALS:,}", MAX_TUNE_TRIALS)(text)
_count = _int_at_least(0, "0 or more")


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v > 0 or math.isnan(v):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return v


def _workers(text: str) -> int | str:
    from ..tuner.workers import parse_workers

    try:
        return parse_workers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# ------------------------------------------------------------------ shared checks


def _user_db(args: argparse.Namespace, *, write: bool = False) -> Path:
    """The user DB path (--db, else $CKGEN_DB, else the cache dir's), checked: a folder, or a
    path under a file, is a usage error naming where the path came from; with `write` (the
    command saves to it), so is a path that is not a regular file or whose folder takes no file."""
    from .. import settings

    if getattr(args, "db", None):
        path, origin = Path(args.db), "--db"
    elif os.environ.get(settings.ENV_DB):
        path, origin = Path(os.environ[settings.ENV_DB]), f"${settings.ENV_DB}"
    else:
        path, origin = settings.user_db_path(), "the user DB"
    if path.is_dir():
        raise UsageError(f"{origin}: {path} is a directory; name the DB file, e.g. {path / 'instances.yaml'}")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UsageError(f"{origin}: {path} lies under {parent}, which is a file, not a directory")
    if write:
        from ..runtime.db import destination_problem

        why = destination_problem(path)
        if why:
            raise UsageError(f"{origin}: {path} {why}")
    return path


def _layers(args: argparse.Namespace) -> tuple[Path, Any, Any, Any]:
    """(user DB path, user DB, shipped DB, the layered view) for the CLI: strict (a corrupt file
    is a DBError, reported as one line)."""
    from ..runtime import db as dbmod

    path = _user_db(args)
    user = dbmod.InstanceDB.load(path)
    shipped = dbmod.InstanceDB.load(dbmod.shipped_db_path())
    return path, user, shipped, dbmod.InstanceDB.layered(user, shipped)


def _ops_option(text: str | None) -> list[str] | None:
    from ..ops import all_ops

    if not text:
        return None
    ops = [o.strip() for o in text.split(",") if o.strip()]
    known = [o.name for o in all_ops()]
    bad = [o for o in ops if o not in known]
    if bad or not ops:
        raise UsageError(f"--ops: unknown {', '.join(bad) or repr(text)}; choose from {', '.join(known)}")
    return ops


def _info(fmt: str) -> Console:
    """Where progress and notes go: stdout beside a table, stderr when stdout carries data."""
    return console if fmt == "table" else err


def _no_gpu(why: str) -> UsageError:
    return UsageError(f"no usable GPU ({why})")


TICK_S = 5.0  # without bars, the longest silence within a step (`_Steps.tick`)


class _Steps:
    """Progress over a run's steps on `out`: rich bars on a terminal; anywhere else (a log file,
    a pipe) no bars, but one line per finished step (`done`), whole and never wrapped, so that a
    log holds each step once, in order, greppable."""

    def __init__(self, out: Console, *columns: Any) -> None:
        from rich.progress import Progress

        self.out = out
        self.live = out.is_terminal
        self.bar = Progress(*columns, console=out) if self.live else None
        self._last = time.monotonic()

    def __enter__(self) -> "_Steps":
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def add_task(self, description: str, **kw: Any) -> Any:
        return self.bar.add_task(description, **kw) if self.bar is not None else None

    def update(self, task: Any, **kw: Any) -> None:
        if self.bar is not None:
            self.bar.update(task, **kw)

    def done(self, line: str) -> None:
        """A finished step: its line when there are no bars (the bars show it otherwise)."""
        if self.bar is None:
            self.out.print(line, markup=False, highlight=False, soft_wrap=True)
            self._last = time.monotonic()

    def tick(self, line: Callable[[], str]) -> None:
        """Progress within a step: without bars, `line()` when TICK_S seconds have passed since
        the last line, so a log or a pipe is never silent for long."""
        if self.bar is None and time.monotonic() - self._last >= TICK_S:
            self.done(line())


def _counted(k: int, n: int) -> str:
    return f"[{k:>{len(str(n))}}/{n}]"


# ------------------------------------------------------------------ tune


def _option_groups() -> list[Any]:
    """The registered op families' problem option groups (`OpSpec.problem_options`), each once,
    in the order their first op was registered."""
    from ..ops import registered_ops

    groups: dict[str, Any] = {}
    for op in registered_ops():
        g = op.problem_options
        if g is not None:
            groups.setdefault(g.title, g)
    return list(groups.values())


def problem_flags() -> dict[str, Any]:
    """The problem options of `ckgen tune` beyond --shape/--grid/--dtype/--layout: argparse dest ->
    its `ProblemOption` (the first family to declare a dest owns it; another family's op takes it
    by naming it in its tune_options); an op takes those in its tune_options."""
    out: dict[str, Any] = {}
    for g in _option_groups():
        for o in g.options:
            out.setdefault(o.dest, o)
    return out


def _field_flags() -> dict[str, str]:
    """Problem fields named by the ops' ValueErrors -> the option that set them."""
    out = {"N": "--shape", "C": "--shape", "H": "--shape", "W": "--shape", "H*W": "--shape",
           "dtype": "--dtype", "layout": "--layout"}
    for o in problem_flags().values():
        out.update(dict.fromkeys(o.fields, o.flag))
    return out


def _check_problem_options(op: Any, args: argparse.Namespace) -> None:
    from ..ops import all_ops

    for dest, opt in problem_flags().items():
        if getattr(args, dest, None) is None:
            continue
        flag = opt.flag
        if dest not in op.tune_options:
            takers = [o.name for o in all_ops() if dest in o.tune_options]
            raise UsageError(f"{flag}: {op.name} takes no {flag} (it is an option of {', '.join(takers)})")
        if not args.shape and not opt.without_shape:
            raise UsageError(f"{flag}: needs --shape (without --shape, {args.cmd} takes the default problems of "
                             f"{op.name})")
    if getattr(args, "grid", None) is not None:
        if args.shape:
            raise UsageError("--grid: give either --grid or --shape, not both")
        names = op.grid_names()
        if args.grid not in names:
            raise UsageError(f"--grid: {op.name} has no grid {args.grid!r}; its grids: {', '.join(names)} "
                             f"({op.space_file()})")


def _problems(op: Any, args: argparse.Namespace) -> list[Any]:
    try:
        if args.shape:
            return op.problems_from_cli(args)
        acts = [args.activation] if getattr(args, "activation", None) else None
        if getattr(args, "grid", None):
            return op.grid_problems(args.grid, args.dtype, args.layout, acts)
        return op.default_problems(args.dtype, args.layout, acts)
    except ValueError as e:
        text = str(e)
        name, sep, rest = text.partition(": ")
        if sep and not name.startswith("--"):
            flag = _field_flags().get(name)
            if flag:
                text = f"{flag}: {rest}" if flag[2:].replace("-", "_") == name else f"{flag} ({name}): {rest}"
        raise UsageError(text) from None


def _check_storage(url: str | None, *, existing: bool = False) -> None:
    """--storage, checked before anything runs: a URL that cannot be a storage; a SQLite file in
    a folder that takes no new file (the file and its lock files go there; the lock would
    otherwise be waited for in vain); a SQLite storage in memory; with `existing` (`db pull`
    reads studies), a SQLite file that is not there (optuna would create an empty one) or that
    is not an optuna storage (optuna would add its tables to it). Messages are masked
    (`_storage_error`)."""
    if url is None:
        return
    from ..tuner import storage_url
    from ..runtime.db import folder_problem
    from ..tuner.tune import sqlite_storage_problem, storage_problem

    try:
        why = storage_problem(url)
    except Exception as e:  # noqa: BLE001 - a URL that trips SQLAlchemy's own parsing: still one line
        why = f"{url!r} is not a database URL ({type(e).__name__}: {e})"
    path = None if why else storage_url.sqlite_path(url)
    if path is not None and existing and not path.is_file():
        why = (f"no study storage at {path}: the file does not exist" if not os.path.lexists(path)
               else f"{path} is not a regular file")
    elif path is not None and existing:  # read, not written: optuna would add its tables to it
        why = sqlite_storage_problem(path)
    elif path is not None:
        trouble = folder_problem(path.parent)
        why = f"{path} cannot be used: {trouble}" if trouble else None
    if why:
        raise _storage_error(why, url)


def _storage_error(why: Any, url: str | None) -> UsageError:
    """A --storage error: one line, every password of `url` (and any other) masked."""
    from ..tuner.storage_url import message

    return UsageError(f"--storage: {message(str(why), url)}")


def _write_error(e: OSError, path: Path) -> UsageError:
    """A DB write that failed (a full disk, a quota): one line naming the file."""
    what = "no space left on device" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e)).lower()
    return UsageError(f"{what} writing {e.filename or path}")


def _result_sheet(title: str, extra_cols: Sequence[Col] = ()) -> Sheet:
    cols = (*extra_cols,
            Col("problem", ident=True, wide=True), Col("instance", "best instance", ident=True, wide=True),
            Col("time_us", "us", lambda v: f"{v:.1f}", number=True),
            Col("spread", "spread", lambda v: f"{100 * v:.0f}%", number=True),
            Col("gbps", "GB/s", lambda v: f"{v:.0f}", number=True),
            Col("efficiency", "copy-eq eff", lambda v: f"{v:.2f}", number=True),
            Col("speedup_vs_default", "vs default", lambda v: "-" if math.isnan(v) else f"{v:.2f}x", number=True),
            Col("failed_trials", "failed", number=True))
    return Sheet("results", title, cols)


def cmd_tune(args: argparse.Namespace) -> int:
    from ..ops import get_op
    from ..runtime.target import gpu_status

    op = get_op(args.op)  # argparse checked the name
    _check_problem_options(op, args)
    problems = _problems(op, args)
    if args.list:
        return _tune_list(op, args, problems)
    db_path = _user_db(args, write=True)
    _check_storage(args.storage)
    why = gpu_status()
    if why:
        raise _no_gpu(why)
    import time

    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    from .. import settings
    from ..runtime.target import device_info
    from ..tuner.storage_url import shown as shown_url
    from ..tuner.tune import TuneRequest

    if args.skip_tuned:
        problems = _untuned(op, args, problems, device_info(None).target.arch)
        if not problems:
            return 0
    if args.workers is not None:
        return _tune_workers(args, op, problems, db_path)
    fmt = resolve(args.format, console)
    info_out = _info(fmt)
    info = device_info(None)
    storage = args.storage or settings.study_storage_url()
    info_out.print(f"tuning {plural(len(problems), 'problem')} of {op.name} on {info.name} ({info.target.arch}); "
                   f"DB {db_path}; study storage {shown_url(storage)}", markup=False)
    sheet = _result_sheet(f"{op.name} on {info.name}")
    start, results = time.monotonic(), []
    from rich.table import Column

    key_col = TextColumn("{task.description}", table_column=Column(overflow="fold"))  # a problem key, whole
    with _Steps(info_out, key_col, BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TextColumn("best {task.fields[best]}"), TimeElapsedColumn()) as bar:
        for k, p in enumerate(problems, 1):
            left = None if args.total_timeout is None else args.total_timeout - (time.monotonic() - start)
            if left is not None and left <= 0:
                info_out.print("[yellow]total time budget spent; remaining problems not tuned[/]")
                break
            timeout = min(x for x in (args.timeout, left) if x is not None) if (args.timeout or left) else None
            task = bar.add_task(p.key(), total=args.trials, best="-")
            step = f"{_counted(k, len(problems))} {p.key()}"

            def progress(done: int, total: int, best: float, task: Any = task) -> None:
                bar.update(task, completed=done, best=f"{best:.1f} us" if best < float("inf") else "-")

            request = TuneRequest.on(op, p, info, trials=args.trials, timeout=timeout, storage=storage,
                                     seed=args.seed, sampler=args.sampler)
            r = _tune_and_save(request, info, db_path, bar, step, progress)
            if r is None:
                continue
            results.append(r)
            sheet.add(p.key(), r.best.instance, r.best.timing.median_us, r.best.timing.spread, r.gbps,
                      r.efficiency, r.speedup_vs_default, len(r.failures))
    emit(console, fmt, [sheet], {"op": op.name, "device": info.name, "arch": info.target.arch, "db": str(db_path)})
    for r in results:
        for cfg, why in r.failures[:5]:
            info_out.print(f"[yellow]failed[/] {r.problem.key()} {cfg}: {why}", highlight=False)
    info_out.print(f"wrote {plural(len(results), 'entry', 'entries')} to {db_path}", markup=False)
    return 0 if len(results) == len(problems) else 1


def _tune_and_save(request: Any, info: Any, db_path: Path, bar: Any, step: str,
                   progress: Callable[[int, int, float], None]) -> Any:
    """One problem of `ckgen tune` and `ckgen retune`: `tune.tune_problem`, then its DB entry
    saved (`tune.save_result`); the step's line on `bar`. The result, or None when it failed or
    was not saved (said on stderr). A study storage failure stops the command (UsageError)."""
    import time

    from ..runtime import db as dbmod
    from ..tuner.tune import StudyStorageError, save_result, tune_problem

    key = request.problem.key()
    t0 = time.monotonic()
    try:
        r = tune_problem(request, info, on_trial=progress)
    except StudyStorageError as e:  # the same for every problem: stop here
        raise _storage_error(e, request.storage) from None
    except RuntimeError as e:
        err.print(f"{key}: {e}", markup=False)
        bar.done(f"{step}: failed ({time.monotonic() - t0:.0f} s)")
        return None
    try:
        save_result(r, info, db_path)
    except dbmod.DBError as e:  # a corrupt DB: the entry is kept in a side file (e.kept)
        err.print(f"{key}: {e}", markup=False)
        bar.done(f"{step}: not saved ({time.monotonic() - t0:.0f} s)")
        return None
    bar.done(f"{step}: {r.best.instance} {r.best.timing.median_us:.1f} us "
             f"({plural(r.trials, 'trial')}, {time.monotonic() - t0:.0f} s)")
    return r


def _untuned(op: Any, args: argparse.Namespace, problems: list[Any], arch: str) -> list[Any]:
    """`--skip-tuned`: the problems without a usable entry for this arch in the DB in effect (the
    user DB over the shipped one), so that a grid tuned over several runs (each cut by
    --total-timeout) goes on where the last one stopped. A stale entry (its template changed since
    it was tuned: `db.entry_verified`) does not count: the dispatcher would not use it either."""
    from ..runtime.db import entry_verified

    layered = _layers(args)[3]
    todo, stale = [], 0
    for p in problems:
        e = layered.lookup(op.name, arch, p.key())
        if e is None or not entry_verified(e):
            todo.append(p)
            stale += e is not None
    _info(resolve(args.format, console)).print(
        f"--skip-tuned: {len(problems) - len(todo)} of {plural(len(problems), 'problem')} already tuned for {arch}; "
        + (f"tuning {len(todo)}" if todo else "nothing to tune")
        + (f" ({stale} with a stale entry: its template changed since it was tuned)" if stale else ""), markup=False)
    return todo


def _tune_list(op: Any, args: argparse.Namespace, problems: list[Any]) -> int:
    """`ckgen tune OP --list`: the problems the same command without --list would tune (the
    default problems, a grid's, or --shape's), then, without --grid/--shape, the op's other
    problem lists (its grids). Nothing is tuned; no GPU is needed."""
    fmt = resolve(args.format, console)
    what = (f"grid {args.grid}" if args.grid else "--shape" if args.shape
            else f"the default problems (`ckgen tune {op.name}` tunes these)")
    sheet = Sheet("problems", f"{op.name}, {what}: {plural(len(problems), 'problem')}",
                  (Col("problem", ident=True, wide=True),))
    for p in problems:
        sheet.add(p.key())
    sheets = [sheet]
    if args.grid is None and not args.shape:
        grids = Sheet("grids", f"problem grids of {op.name} ({op.space_file()}; ckgen tune {op.name} "
                               "--grid NAME --list shows one)",
                      (Col("grid", ident=True), Col("problems", number=True), Col("about")))
        acts = [args.activation] if getattr(args, "activation", None) else None
        for name in op.grid_names():
            grids.add(name, len(op.grid_problems(name, args.dtype, args.layout, acts)), op.grid_about(name))
        sheets.append(grids)
    emit(console, fmt, sheets, {"op": op.name, "grid": args.grid})
    return 0


def _tune_workers(args: argparse.Namespace, op: Any, problems: list[Any], db_path: Path) -> int:
    """`ckgen tune ... --workers N|auto`: worker processes (ckgen/tuner/workers.py), one bar per worker
    and a total, then the table of every problem's result (from the storage: those another
    machine's workers finished too)."""
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
    from rich.table import Column

    from .. import settings
    from ..tuner import workers as wk
    from ..tuner.storage_url import mask, shown

    fmt = resolve(args.format, console)
    info_out = _info(fmt)
    devices = wk.visible_devices()
    n = len(devices) if args.workers == "auto" else args.workers
    if n < 1:
        raise _no_gpu("--workers auto found no GPU")
    storage = args.storage or settings.study_storage_url()
    spec = wk.RunSpec(op.name, tuple(p.key() for p in problems), args.trials, storage, timeout=args.timeout,
                      total_timeout=args.total_timeout, seed=args.seed, sampler=args.sampler, db=str(db_path),
                      backend=wk.backend_factory())
    pins = [devices[i % len(devices)] for i in range(n)] if devices else []
    info_out.print(f"tuning {plural(len(problems), 'problem')} of {op.name} with {plural(n, 'worker')}"
                   + (f" (CUDA_VISIBLE_DEVICES {', '.join(pins)})" if pins else "")
                   + f"; DB {db_path}; study storage {shown(storage)}", markup=False)
    if devices and n > len(devices):
        info_out.print(f"[yellow]{n} workers share {plural(len(devices), 'GPU')}: their timings disturb each other[/]")
    key_col = TextColumn("{task.description}", table_column=Column(overflow="fold"))
    done: dict[str, int] = {}
    stuck: set[int] = set()  # workers stopped because they finished but did not exit
    finished: set[str] = set()  # the problems whose result came
    with _Steps(info_out, key_col, BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[best]}"), TimeElapsedColumn()) as bar:
        total = bar.add_task(f"total ({plural(len(problems), 'problem')})", total=len(problems) * args.trials, best="")
        tasks = [bar.add_task(f"worker {i}: starting", total=args.trials, best="") for i in range(n)]

        def on_event(ev: tuple[Any, ...], procs: Any) -> None:
            kind, i = ev[0], ev[1]
            if kind == "problem":
                bar.update(tasks[i], description=f"worker {i}: {ev[2]}", completed=0, total=ev[3], best="")
            elif kind == "trial":
                key, run_done, budget, best = ev[2:6]
                bar.update(tasks[i], completed=run_done, total=budget,
                           best=f"best {best:.1f} us" if best < float("inf") else "")
                done[key] = max(done.get(key, 0), run_done)
                bar.update(total, completed=sum(done.values()))
            elif kind == "result":
                r = ev[3]
                done[ev[2]] = max(done.get(ev[2], 0), r.get("trials", 0))
                bar.update(total, completed=sum(done.values()))
                finished.add(ev[2])
                what = (f"failed: {r['error']}" if "error" in r else
                        f"{r.get('instance')} {r.get('time_us', 0.0):.1f} us ({plural(r.get('trials', 0), 'trial')})")
                bar.done(f"{_counted(len(finished), len(problems))} {ev[2]}: worker {i}: {what}")
            elif kind == "exit" and ev[2] != 0 and i not in stuck:
                why = wk.exit_reason(ev[2])
                info_out.print(f"[yellow]worker {i} died ({why}); its running trials are failed after "
                               f"{wk.tune.GRACE_S} s and measured again by the others[/]", highlight=False)
                bar.update(tasks[i], description=f"worker {i}: died ({why})")
            elif kind == "stuck":
                stuck.add(i)
                info_out.print(f"[yellow]worker {i} finished but had not exited {ev[2]:.0f} s later: "
                               "stopped[/]", highlight=False)
                bar.update(tasks[i], description=f"worker {i}: stopped (did not exit)")
            elif kind == "quiet":
                info_out.print(f"[yellow]worker {i} has reported nothing for {ev[2]:.0f} s[/]", highlight=False)
            elif kind == "error":
                err.print(mask(f"worker {i}: {ev[2] + ': ' if ev[2] else ''}{ev[3]}", storage), markup=False)
            elif kind == "skip":
                err.print(f"{ev[2]}: {ev[3]}", markup=False)

        report = wk.run_workers(spec, n, pins or None, on_event=on_event)
    devices_seen = sorted({name for name, _ in report.results} | {w.name for w in report.workers if w.name})
    several = len(devices_seen) > 1
    sheet = _result_sheet(f"{op.name} on {', '.join(devices_seen) or 'no device'}",
                          (Col("device", ident=True),) if several else ())
    ok = 0
    for (device, key), r in sorted(report.results.items()):
        if "error" in r:
            err.print(f"{key}: {r['error']}", markup=False)
            continue
        ok += 1
        speedup = r.get("speedup_vs_default")
        row = [key, r["instance"], r["time_us"], r["spread"], r["gbps"], r["efficiency"],
               float("nan") if speedup is None else speedup, r["failed"]]
        sheet.add(*(([device] if several else []) + row))
    fatal = [w for w in report.workers if w.error]
    for w in fatal:
        err.print(mask(f"worker {w.index}: {w.error.splitlines()[0]}", storage), markup=False)
    emit(console, fmt, [sheet], {"op": op.name, "devices": devices_seen, "db": str(db_path), "storage": shown(storage),
                                 "workers": n, "seconds": round(report.seconds, 1),
                                 "died": [w.index for w in report.died]})
    wrote = sum(1 for r in report.results.values() if r.get("db"))
    info_out.print(f"{plural(ok, 'problem')} tuned in {report.seconds:.0f} s; this machine's workers wrote "
                   f"{plural(wrote, 'entry', 'entries')} to {db_path}", markup=False)
    if fatal and all(w.exitcode == wk.STORAGE_EXIT for w in report.workers):  # the storage failed them all
        raise _storage_error(fatal[0].error.splitlines()[0], storage)
    want = len(problems) * max(1, len(devices_seen))
    return 0 if ok == want else 1


# ------------------------------------------------------------------ explain


def cmd_explain(args: argparse.Namespace) -> int:
    """`ckgen explain OP [problem options] [--arch ARCH]`: ckgen.explain for each problem, as a
    table (problem, instance, where the choice came from, why). Needs a GPU only without --arch."""
    from .. import settings
    from ..runtime.dispatch import dispatcher
    from ..ops import get_op
    from ..runtime.target import gpu_status
    from ..types import served

    op = get_op(args.op)  # argparse checked the name
    _check_problem_options(op, args)
    target = None
    if args.arch is not None:
        try:
            target = served(args.arch)
        except ValueError as e:
            raise UsageError(f"--arch: {str(e).removeprefix('target: ')}") from None
    problems = _problems(op, args)
    db_path = _user_db(args)
    _layers(args)  # a corrupt DB file: one line, exit 2 (the dispatcher would only warn)
    if target is None:
        why = gpu_status()
        if why:
            raise UsageError(f"no usable GPU ({why}); to explain a problem without a GPU, pass --arch "
                             "(e.g. --arch sm_90)")
        from ..runtime.target import current_target

        target = current_target()
    if getattr(args, "db", None):  # the user DB the dispatcher reads
        os.environ[settings.ENV_DB] = str(db_path)
        dispatcher().reload()
    fmt = resolve(args.format, console)
    sheet = Sheet("choices", f"{op.name} on {target.arch}: the instance each problem's call would use", (
        Col("problem", ident=True, wide=True), Col("instance", ident=True, wide=True), Col("source"),
        Col("reason", fmt=printable)))
    failed = 0
    with dispatcher().asked():  # the dispatcher's once-per-problem notice: the table says it
        for p in problems:
            try:
                c = dispatcher().choose(op, p, target)[0]
            except ValueError as e:  # no config of the space can run it: said, and the others go on
                err.print(f"{p.key()}: {e}", markup=False)
                failed += 1
                continue
            sheet.add(c.problem, c.instance, c.source, c.reason)
    emit(console, fmt, [sheet], {"op": op.name, "arch": target.arch})
    return 1 if failed else 0


# ------------------------------------------------------------------ list, db show / export / where


def _entries_sheet(user: Any, layered: Any, op: str | None = None) -> Sheet:
    entries = layered.select(op)
    sheet = Sheet("entries", f"instance DB ({plural(len(entries), 'entry', 'entries')})", (
        Col("op", ident=True), Col("arch", ident=True, fmt=printable), Col("device", fmt=printable),
        Col("problem", ident=True, wide=True), Col("instance", ident=True, wide=True, fmt=printable),
        Col("time_us", "us", lambda v: f"{v:.1f}", number=True),
        Col("gbps", "GB/s", lambda v: f"{v:.0f}", number=True), Col("from", ident=True)))
    for e in entries:
        sheet.add(e.op, e.arch, e.device, e.problem, e.instance, e.time_us, e.gbps,
                  "user" if user.lookup(*e.ident) is e else "shipped")
    return sheet


def _op_option(name: str | None, flag: str = "--op") -> Any:
    """The op named by `flag` (None: none given); an unknown name is a usage error listing them."""
    from ..ops import all_ops, get_op

    if name is None:
        return None
    known = [o.name for o in all_ops()]
    if name not in known:
        raise UsageError(f"{flag}: unknown {name!r}; choose from {', '.join(known)}")
    return get_op(name)


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def cmd_list(args: argparse.Namespace) -> int:
    """The ops: their tunables and problem grids (`--op NAME`: one op, every tunable's values and
    every grid's size). The DB's entries are `ckgen db show`'s."""
    from ..ops import all_ops

    op = _op_option(args.op)
    _user_db(args)  # read by no list, but checked as every command checks it
    fmt = resolve(args.format, console)
    if op is None:
        sheet = Sheet("ops", "ops (one in full: ckgen list --op NAME; DB entries: ckgen db show)", (
            Col("op", ident=True), Col("tunables", fmt=", ".join),
            Col("default_problems", "default problems", number=True),
            Col("grids", "grids (tune --grid)", fmt=", ".join)))
        for o in all_ops():
            sheet.add(o.name, list(o.space.params), len(o.default_problems()), o.grid_names())
        emit(console, fmt, [sheet])
        return 0
    space = op.space
    tunables = Sheet("tunables", f"tunables of {op.name} (template {op.template}; {op.space_file()}: "
                                 f"{plural(len(space.constraints), 'constraint')})", (
        Col("tunable", ident=True), Col("kind"), Col("values", fmt=lambda vs: ", ".join(map(_value, vs))),
        Col("default", ident=True, fmt=_value)))
    for kind, params in (("tile", space.tile), ("algorithm", space.algo)):
        for name, values in params:
            tunables.add(name, kind, list(values), space.default.as_dict().get(name))
    grids = Sheet("grids", f"problem grids of {op.name} (ckgen tune {op.name} --grid NAME --list: a grid's problems)",
                  (Col("grid", ident=True), Col("problems", number=True), Col("about")))
    for name in op.grid_names():
        grids.add(name, len(op.grid_problems(name)), op.grid_about(name))
    emit(console, fmt, [tunables, grids], {"op": op.name, "template": op.template})
    return 0


def _summary_sheet(user: Any, layered: Any) -> Sheet:
    """The entries in use per (op, arch), by origin: `db show`'s first screen."""
    counts: dict[tuple[str, str], list[int]] = {}
    for e in layered.entries:
        counts.setdefault((e.op, e.arch), [0, 0])[0 if user.lookup(*e.ident) is e else 1] += 1
    sheet = Sheet("ops", f"instance DB: {plural(len(layered.entries), 'entry', 'entries')} in use (the entries: "
                         "ckgen db show --op NAME, or --all)", (
        Col("op", ident=True), Col("arch", ident=True, fmt=printable), Col("entries", number=True),
        Col("user", number=True), Col("shipped", number=True)))
    for (op, arch), (u, s) in sorted(counts.items()):
        sheet.add(op, arch, u + s, u, s)
    return sheet


def cmd_db_show(args: argparse.Namespace) -> int:
    """The DB in use: per op and arch, how many entries (user, shipped); the entries themselves
    with --op NAME (one op's) or --all (the shipped DB alone holds over a thousand)."""
    op = args.op
    _op_option(op)
    _, user, _, layered = _layers(args)
    sheet = _entries_sheet(user, layered, op) if op or args.all else _summary_sheet(user, layered)
    emit(console, resolve(args.format, console), [sheet])
    return 0


def cmd_db_export(args: argparse.Namespace) -> int:
    from ..runtime import db as dbmod

    # to a terminal, DB text is shown, not obeyed (a pipe or file gets the exact CSV)
    dbmod.export_csv(_layers(args)[3], sys.stdout, cell=printable if sys.stdout.isatty() else None)
    return 0


def cmd_db_pull(args: argparse.Namespace) -> int:
    """DB entries from the finished studies of a storage (another machine's workers' winners)."""
    from ..runtime import db as dbmod
    from ..tuner.storage_url import mask, shown
    from ..tuner.tune import StudyStorageError
    from ..tuner.workers import pull_entries

    path = _user_db(args, write=True)
    _check_storage(args.storage, existing=True)
    fmt = resolve(args.format, console)
    try:
        pulled = pull_entries(args.storage)
    except StudyStorageError as e:
        raise _storage_error(e, args.storage) from None
    except Exception as e:  # noqa: BLE001 - a driver's or optuna's own error, past the storage's opening
        raise _storage_error(f"{type(e).__name__}: {e}", args.storage) from None
    if pulled.entries:
        try:
            dbmod.save_entries(path, pulled.entries)
        except OSError as e:  # a full disk: the DB is as it was; the studies still hold the winners
            raise _write_error(e, path) from None
    sheet = Sheet("entries", f"pulled from {shown(args.storage)} ({plural(len(pulled.entries), 'entry', 'entries')})", (
        Col("op", ident=True), Col("arch", ident=True, fmt=printable), Col("device", fmt=printable),
        Col("problem", ident=True, wide=True), Col("instance", ident=True, wide=True, fmt=printable),
        Col("time_us", "us", lambda v: f"{v:.1f}", number=True),
        Col("host", ident=True, fmt=printable), Col("trials", number=True)))
    for e in sorted(pulled.entries, key=lambda e: e.ident):
        prov = e.provenance_dict()
        sheet.add(e.op, e.arch, e.device, e.problem, e.instance, e.time_us, str(prov.get("host", "")),
                  prov.get("trials", 0))
    skipped = [mask(why, args.storage) for why in pulled.skipped]
    emit(console, fmt, [sheet], {"db": str(path), "storage": shown(args.storage), "skipped": skipped})
    for why in skipped:
        _info(fmt).print(f"skipped {printable(why)}", markup=False)
    if pulled.entries:
        _info(fmt).print(f"wrote {plural(len(pulled.entries), 'entry', 'entries')} to {path}", markup=False)
    else:
        _info(fmt).print(f"no entries to pull; {path} was not written", markup=False)
    return 0


def cmd_db_merge(args: argparse.Namespace) -> int:
    """Merge DB files: per (op, arch, problem), the verified then faster entry; ties by date."""
    from ..runtime import db as dbmod

    if args.output is None:  # into the user DB: --db, $CKGEN_DB or the cache dir's, checked as a destination
        out = _user_db(args, write=True)
    else:
        out = Path(args.output)
        why = dbmod.destination_problem(out)  # up front: not after minutes of verifying, nor a 60 s lock wait
        if why:
            raise UsageError(f"-o: {out} {why}")
        _user_db(args)  # not written, but checked as every command checks it
    dbs = []
    for name in args.dbs:
        path = Path(name)
        if not os.path.lexists(path):
            raise UsageError(f"{name}: no such DB file")
        dbs.append(dbmod.InstanceDB.load(path))  # strict: a corrupt file is a DBError (exit 2)
    # Into what -o holds under its lock (as a save merges): entries saved meanwhile stay.
    try:
        merged, held, side = dbmod.merge_into(out, *dbs)
    except OSError as e:  # a full disk: the output is as it was
        raise _write_error(e, out) from None
    if side is not None:  # no lock: said in the warning, which names the side file
        return 0
    console.print(f"wrote {plural(len(merged.entries), 'entry', 'entries')} to {out} (from "
                  f"{plural(sum(len(d.entries) for d in dbs), 'entry', 'entries')} in {plural(len(dbs), 'file')}"
                  + (f" and the {plural(held, 'entry', 'entries')} it held" if held else "") + ")", markup=False)
    return 0


def cmd_db_where(args: argparse.Namespace) -> int:
    """Where everything is: the resolved cache dir, user DB, shipped DB (and which entries come
    from which), studies, kernels, templates, tuning spaces, ROCm. A place that cannot be used
    (a corrupt DB, a path that is a folder, a setting that does not parse) is reported in its
    row, and the others still are; the exit code is then 1."""
    from ..runtime import db as dbmod
    from .. import resources, settings

    env = os.environ.get
    places = Sheet("places", "where ckgen reads and writes", (
        Col("what", ident=True), Col("path", ident=True, wide=True, fmt=printable), Col("set_by", "set by"),
        Col("state", fmt=printable)))
    broken = []

    def place(what: str, row: Any) -> None:
        """One row: `row()` gives (path, set by, state); an error is that place's state."""
        try:
            places.add(what, *row())
        except Exception as e:  # noqa: BLE001 - one place that cannot be read: said in its row, the rest go on
            broken.append(what)
            places.add(what, getattr(e, "path", ""), "", f"unusable: {e}")

    def load(path: Path) -> Any:
        try:
            return dbmod.InstanceDB.load(path), None
        except dbmod.DBError as e:
            return dbmod.InstanceDB(), e

    try:
        path: Path | None = _user_db(args)
        user, user_error = load(path)
    except UsageError as e:
        path, user, user_error = None, dbmod.InstanceDB(), e
    shipped_path = dbmod.shipped_db_path()
    shipped, shipped_error = load(shipped_path)
    layered = dbmod.InstanceDB.layered(user, shipped)

    def db_row(p: Path | None, origin: str, db: Any, error: Exception | None, missing: str) -> Any:
        if error is not None:
            raise error
        side = dbmod._side_files(p)
        return (str(p), origin, (plural(len(db.entries), "entry", "entries") if p.is_file() else missing)
                + (f", {plural(len(side), 'pending side file')}" if side else ""))

    def folder_state(folder: Path) -> str:
        """A folder's row state; a file (or anything else) in its place makes the row unusable."""
        if folder.is_dir():
            return "exists"
        if not os.path.lexists(folder):
            return "not created yet"
        raise UsageError(f"{folder} is not a folder")

    place("cache dir", lambda: (str(settings.cache_dir()),
                                f"${settings.ENV_CACHE}" if env(settings.ENV_CACHE) else "the platform's user cache dir",
                                folder_state(settings.cache_dir())))
    user_origin = ("--db" if getattr(args, "db", None) else f"${settings.ENV_DB}" if env(settings.ENV_DB)
                   else "the cache dir")
    place("user DB", lambda: db_row(path, user_origin, user, user_error, "not created yet (no entries)"))
    place("shipped DB", lambda: db_row(shipped_path, f"${settings.ENV_SHIPPED}" if settings.shipped_db_override()
                                       else "the package", shipped, shipped_error, "missing (no entries)"))
    studies = settings.cache_dir() / "studies.sqlite3"
    place("optuna studies", lambda: (f"sqlite:///{studies}", "the cache dir (tune/retune --storage: another)",
                                     "exists" if studies.is_file() else "not created yet"))
    place("compiled kernels", lambda: (str(settings.kernel_cache_dir()), f"${settings.ENV_KERNEL_CACHE}"
                                       if os.environ.get(settings.ENV_KERNEL_CACHE) else "the cache dir",
                                       folder_state(settings.kernel_cache_dir())))
    from .. import model as cost_model
    from ..model import records

    def model_row() -> Any:
        model = cost_model.model_path()
        return (str(model) if model else "",
                f"${settings.ENV_MODEL}" if env(settings.ENV_MODEL) else
                "beside the user DB" if model == cost_model.user_model_path() else "the package",
                "off" if model is None else "exists" if model.is_file() else "missing (the dispatcher goes on without it)")

    place("cost model", model_row)
    place("tuning records (yours)", lambda: (str(records.user_records_path()), "beside the user DB",
                                             "exists" if records.user_records_path().is_file() else "not created yet"))
    place("tuning records (shipped)", lambda: (str(records.packaged_records_path()), "the package",
                                               "exists" if records.packaged_records_path().is_file() else "missing"))
    pkg = Path(__file__).resolve().parent.parent  # the ckgen package (this is ckgen/cli/)
    for what, folder in (("templates", resources.templates_dir), ("tuning spaces", resources.tuning_spaces_dir)):
        place(what, lambda folder=folder: (str(folder()), "the installed package" if pkg in folder().resolve().parents
                                           else "the checkout (beside the package)", ""))

    def rocm_row() -> Any:
        rocm = settings.rocm_path()
        return (str(rocm) if rocm else "",
                f"${settings.ENV_ROCM}" if env(settings.ENV_ROCM) else "tools/hip-toolchain (cache dir)",
                "found" if rocm else "none")

    place("ROCm (offline HIP builds)", rocm_row)
    counts: dict[tuple[str, str], list[int]] = {}
    for e in layered.entries:
        counts.setdefault((e.op, e.arch), [0, 0, 0])[0 if user.lookup(*e.ident) is e else 1] += 1
    for e in shipped.entries:
        if user.lookup(*e.ident) is not None:
            counts.setdefault((e.op, e.arch), [0, 0, 0])[2] += 1
    origin = Sheet("entries", f"entries in use ({plural(len(layered.entries), 'entry', 'entries')}), by origin", (
        Col("op", ident=True), Col("arch", ident=True, fmt=printable), Col("user", number=True),
        Col("shipped", number=True), Col("shipped_overridden", "shipped, overridden by user", number=True)))
    for (op, arch), (u, s, o) in sorted(counts.items()):
        origin.add(op, arch, u, s, o)
    emit(console, resolve(args.format, console), [places, origin])
    for what in broken:
        err.print(f"ckgen db where: the {what} cannot be used (see its row)", markup=False)
    return 1 if broken else 0


# ------------------------------------------------------------------ generate


def _check_out_folder(out: Path, check: bool) -> None:
    """generate --out: with --check, a folder that exists; else a folder, or a path where one
    can be created."""
    from ..runtime.db import folder_problem

    if check and not os.path.lexists(out):
        raise UsageError(f"--out: {out} does not exist, so there is nothing to check; run `ckgen generate` "
                         "with the same options to create it")
    if os.path.lexists(out) and not out.is_dir():
        raise UsageError(f"--out: {out} is not a folder")
    why = None if check else folder_problem(out)
    if why:
        raise UsageError(f"--out: {why}")


def cmd_generate(args: argparse.Namespace) -> int:
    """`ckgen generate`: render the library's instances, write them under --out as a whole
    (staged, then swapped in under a lock: `library.publish`), build them offline (an unchanged
    instance reuses its kept report), and print a summary per target."""
    import time

    from ..offline import library
    from ..types import Target, served

    targets = [t.strip() for t in args.target.split(",") if t.strip()]
    if not targets:
        raise UsageError("--target: name at least one arch (e.g. sm_90)")
    for t in targets:
        try:
            served(t)
        except ValueError as e:
            raise UsageError(f"--target: {str(e).removeprefix('target: ')}") from None
    ops = _ops_option(args.ops)
    out = Path(args.out)
    _check_out_folder(out, args.check)  # before the plan, which takes a while
    if not args.check:
        for t in targets:  # a link where an arch folder goes: said now, not after the build (publish checks again)
            try:
                library.arch_folder(out, t)
            except ValueError as e:
                raise UsageError(f"--out: {e}") from None
    _, _, _, layered = _layers(args)  # the user DB over the shipped one, as every command reads them
    fmt = resolve(args.format, console)
    info = _info(fmt)
    start = time.monotonic()
    instances = _render(library, targets, ops, layered, info, from_db=not args.defaults)
    rendered_s = time.monotonic() - start
    n = plural(len(instances), "instance")
    if args.check:  # regenerate into a temp folder and compare with `out`
        try:
            return _generate_check(library, out, instances, targets, ops)
        except library.WriteError as e:  # the temp folder's disk is full
            raise UsageError(str(e)) from None
    summary = Sheet("targets", "", (Col("target", ident=True), Col("instances", number=True),
                                    Col("built", number=True), Col("failed", number=True),
                                    Col("not_built", "not built", number=True)))
    per = {t: [0, 0, 0, 0] for t in targets}  # instances, built, failed, not built
    for i in instances:
        per[i.target.arch][0] += 1
    built: list[Any] = []
    skipped = 0
    stage = out
    try:
        with library.staging(out) as stage:
            library.write(instances, stage)
            if not args.no_compile:
                build_start = time.monotonic()
                built, skipped = _build_where_we_can(library, instances, targets, args.jobs, info)
                build_s = time.monotonic() - build_start
                library.write_reports(built, stage)
            library.publish(stage, out, targets, ops)
        info.print(f"wrote {n} for {', '.join(targets)} under {out}", markup=False)
    except library.WriteError as e:  # named where it was going, not in the staging folder (gone now)
        shown = out / e.path.relative_to(stage) if e.path.is_relative_to(stage) and e.path != stage else e.path
        raise UsageError(str(library.WriteError(shown, e.error))) from None
    except ValueError as e:  # publish's refusals: a link or a folder not ours where the library goes
        raise UsageError(f"--out: {e}") from None
    if args.no_compile:
        for t, row in per.items():
            summary.add(t, row[0], 0, 0, row[0])
        summary.title = f"{n} rendered in {rendered_s:.0f} s, not built (--no-compile), under {out}"
        emit(console, fmt, [summary], {"out": str(out)})
        return 0
    failed = [b for b in built if not b.ok]
    for b in failed:
        err.print(f"FAILED {b.instance.target.arch} {b.instance.source.name}:\n{b.message}", markup=False)
    for b in built:
        per[b.instance.target.arch][1 if b.ok else 2] += 1
    for t, row in per.items():
        summary.add(t, row[0], row[1], row[2], row[0] - row[1] - row[2])
    summary.title = (f"{n} under {out} in {time.monotonic() - start:.0f} s (rendering {rendered_s:.0f} s, "
                     f"building {build_s:.0f} s)")
    emit(console, fmt, [summary], {"out": str(out)})
    info.print(f"built {len(built) - len(failed)} of {n}" + (f"; {len(failed)} failed" if failed else "")
               + (f"; {skipped} not built (no toolchain)" if skipped else ""), markup=False)
    return 1 if failed or skipped else 0


def _build_where_we_can(library: Any, instances: list[Any], targets: list[str], jobs: int | None,
                        info: Console) -> tuple[list[Any], int]:
    """The instances built (`_build`) for the targets whose toolchain is here; one line per
    vendor whose toolchain is missing. Returns (the builds, how many instances were not built)."""
    from ..types import Target

    vendors = sorted({Target.named(t).vendor for t in targets})
    missing = {v: why for v in vendors if (why := library.toolchain_missing(v))}
    for vendor, why in missing.items():
        archs = [t for t in targets if Target.named(t).vendor == vendor]
        count = sum(1 for i in instances if i.target.vendor == vendor)
        what = f"no HIP toolchain ({why}); {library.HIP_TOOLCHAIN_HINT}" if vendor == "hip" else f"no NVRTC ({why})"
        err.print(f"ckgen generate: not built for {', '.join(archs)} ({plural(count, 'instance')}): {what}",
                  markup=False)
    todo = [i for i in instances if i.target.vendor not in missing]
    return _build(library, todo, jobs, info), len(instances) - len(todo)


def _generate_check(library: Any, out: Path, instances: list[Any], targets: list[str], ops: list[str] | None) -> int:
    """generate --check: the manifests under `out` against a fresh render's, and the sources
    where `out` holds them (git keeps only the manifests)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        library.write(instances, Path(d) / "lib")
        diff = library.drift(out, Path(d) / "lib", targets, ops)
    diff += library.source_drift(out, instances)
    if diff:
        err.print(f"ckgen generate --check: {out} is out of date ({plural(len(diff), 'file')} differ"
                  f"{'s' if len(diff) == 1 else ''}, e.g. {', '.join(diff[:3])}); run `ckgen generate` with "
                  "the same options (and commit the manifests)", markup=False)
        return 1
    sources = any(p.suffix in (".cu", ".hip") for i in instances for p in [out / i.target.arch / i.op / i.file]
                  if p.is_file())
    console.print(f"{out}: up to date ({plural(len(instances), 'instance')}; manifests"
                  + (" and sources" if sources else ", no sources there to compare") + ")", markup=False)
    return 0


def _step_columns() -> tuple[Any, ...]:
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    return (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


def _render(library: Any, targets: list[str], ops: list[str] | None, db: Any, out: Console, *,
            from_db: bool) -> list[Any]:
    """library.plan with progress on `out`: a bar over every (target, problem) on a terminal,
    else a line per rendered (target, op) and, in between, one every few seconds."""
    import time

    from ..ops import all_ops, get_op

    specs = [get_op(o) for o in ops] if ops else all_ops()
    sizes = {o.name: len(library.problems(o, db)) for o in specs}
    steps = len(targets) * len(specs)
    state = {"step": 0, "t0": time.monotonic()}
    with _Steps(out, *_step_columns()) as bar:
        task = bar.add_task("rendering", total=len(targets) * sum(sizes.values()))

        def progress(arch: str, op: str, done: int, total: int) -> None:
            if done == 0:
                state["t0"] = time.monotonic()
                bar.update(task, description=f"rendering {arch} {op}")
                return
            bar.update(task, advance=1)
            if done == total:
                state["step"] += 1
                bar.done(f"{_counted(state['step'], steps)} rendered {arch} {op}: {plural(total, 'problem')} "
                         f"({time.monotonic() - state['t0']:.1f} s)")
            else:
                bar.tick(lambda: f"{_counted(state['step'] + 1, steps)} rendering {arch} {op}: {done} of "
                                 f"{plural(total, 'problem')} ({time.monotonic() - state['t0']:.0f} s)")

        instances = library.plan(targets, ops, from_db=from_db, db=db, progress=progress)
        bar.update(task, description="rendered")
    return instances


def _build(library: Any, todo: list[Any], jobs: int | None, out: Console) -> list[Any]:
    """library.build (reusing kept reports) with progress on `out`: a bar over the instances on a
    terminal, else a line per built (target, op) and, in between, one every few seconds."""
    import threading
    import time

    groups: dict[tuple[str, str], int] = {}
    for i in todo:
        groups[(i.target.arch, i.op)] = groups.get((i.target.arch, i.op), 0) + 1
    seen: dict[tuple[str, str], list[int]] = {}
    lock, t0, finished, count = threading.Lock(), time.monotonic(), [0], [0]
    with _Steps(out, *_step_columns()) as bar:
        task = bar.add_task("building", total=len(todo))

        def progress(b: Any) -> None:
            key = (b.instance.target.arch, b.instance.op)
            with lock:
                count[0] += 1
                bar.update(task, advance=1, description=f"building ({key[0]} {key[1]})")
                got = seen.setdefault(key, [0, 0])
                got[0 if b.ok else 1] += 1
                if sum(got) == groups[key]:
                    finished[0] += 1
                    bar.done(f"{_counted(finished[0], len(groups))} built {key[0]} {key[1]}: {got[0]} of "
                             f"{plural(groups[key], 'instance')}" + (f", {got[1]} failed" if got[1] else "")
                             + f" (after {time.monotonic() - t0:.0f} s)")
                else:
                    bar.tick(lambda: f"building: {count[0]} of {plural(len(todo), 'instance')} "
                                     f"(after {time.monotonic() - t0:.0f} s)")

        built = library.build(todo, jobs, progress=progress, reuse=True)
        bar.update(task, description="built")
    return built


# ------------------------------------------------------------------ retune, bench


def cmd_retune(args: argparse.Namespace) -> int:
    from ..runtime.target import gpu_status
    from ..types import Target

    ops = _ops_option(args.ops)
    if args.from_arch is not None:
        try:
            Target.named(args.from_arch)
        except ValueError as e:
            raise UsageError(f"--from-arch: {str(e).removeprefix('target: ')}") from None
    _user_db(args, write=True)
    db_path, _, _, db = _layers(args)
    _check_storage(args.storage)
    why = gpu_status()
    if why:
        raise _no_gpu(why)
    import time

    from .. import settings
    from ..ops import get_op
    from ..runtime.target import device_info
    from ..tuner.tune import TuneRequest, retune_plan

    fmt = resolve(args.format, console)
    info_out = _info(fmt)
    info = device_info(None)
    plan = retune_plan(db, info.target.arch, args.from_arch, ops)
    if not plan:
        info_out.print(f"nothing to retune: every DB problem is tuned for {info.target.arch} already", markup=False)
        emit(console, fmt, [] if fmt == "table" else [_retune_sheet(info)])
        return 0
    info_out.print(f"retuning {plural(len(plan), 'problem')} on {info.name} ({info.target.arch}), warm-started "
                   f"from other archs' winners; DB {db_path}", markup=False)
    sheet = _retune_sheet(info)
    start, done = time.monotonic(), 0
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
    from rich.table import Column

    key_col = TextColumn("{task.description}", table_column=Column(overflow="fold"))  # op and problem key, whole
    with _Steps(info_out, key_col, BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TextColumn("best {task.fields[best]}"), TimeElapsedColumn()) as bar:
        for k, item in enumerate(plan, 1):
            if args.total_timeout is not None and time.monotonic() - start > args.total_timeout:
                info_out.print("[yellow]total time budget spent; remaining problems not retuned[/]")
                break
            op = get_op(item.op)
            problem = op.problem_from_key(item.problem)
            ok = op.validate(problem, item.config, info.target)
            task = bar.add_task(f"{item.op} {item.problem}", total=args.trials, best="-")
            step = f"{_counted(k, len(plan))} {item.op} {item.problem}"

            def progress(n: int, total: int, best: float, task: Any = task) -> None:
                bar.update(task, completed=n, best=f"{best:.1f} us" if best < float("inf") else "-")

            request = TuneRequest.on(op, problem, info, trials=args.trials, timeout=args.timeout,
                                     storage=args.storage or settings.study_storage_url(), seed=args.seed,
                                     sampler=args.sampler, warm=(item.config,) if ok else ())
            r = _tune_and_save(request, info, db_path, bar, step, progress)
            if r is None:
                continue
            done += 1
            old = r.warm[0].timing.median_us if r.warm else None
            sheet.add(item.op, item.problem, item.from_arch,
                      old if old else (f"invalid here ({ok.reason})" if not ok else "failed"),
                      r.best.instance, r.best.timing.median_us, old / r.best.timing.median_us if old else None)
    emit(console, fmt, [sheet], {"device": info.name, "arch": info.target.arch, "db": str(db_path)})
    info_out.print(f"wrote {plural(done, 'entry', 'entries')} for {info.target.arch} to {db_path}", markup=False)
    return 0 if done == len(plan) else 1


def _retune_sheet(info: Any) -> Sheet:
    return Sheet("results", f"retune on {info.name}", (
        Col("op", ident=True), Col("problem", ident=True, wide=True), Col("from_arch", "from", ident=True),
        Col("old_us", "old config here (us)", lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)),
        Col("instance", "new winner", ident=True, wide=True), Col("time_us", "us", lambda v: f"{v:.1f}", number=True),
        Col("speedup", "speedup", lambda v: f"{v:.2f}x", number=True)))


def cmd_bench(args: argparse.Namespace) -> int:
    from ..offline.opbench import OPS

    ops = _ops_option(args.ops) or list(OPS)
    missing = [o for o in ops if o not in OPS]
    if missing:
        raise UsageError(f"--ops: ckgen bench has no suite for {', '.join(missing)}")
    db_path = _user_db(args) if getattr(args, "db", None) else None
    from ..runtime.target import gpu_status

    why = gpu_status()  # first: it answers at once, where importing PyTorch takes seconds
    if why:
        raise _no_gpu(why)
    try:
        __import__("torch")  # the comparison runs PyTorch's ops
    except ImportError:
        raise UsageError("needs PyTorch (pip install 'ckgen[torch]')") from None
    from ..offline.opbench import run

    if db_path is not None:  # the user DB the dispatcher reads
        os.environ["CKGEN_DB"] = str(db_path)

    out = Path(args.out or os.environ.get("OUT") or "bench-results")
    md = run(ops, out, quick=args.quick, compile=not args.no_compile,
             log=lambda line: console.print(line, markup=False))
    console.print(f"wrote {md} (and .json, .png)", markup=False)
    return 0


# ------------------------------------------------------------------ the parser


class _Formatter(argparse.HelpFormatter):
    """argparse's help, with a description's paragraphs (separated by an empty line) kept apart
    and each wrapped to the terminal's width ($COLUMNS), as the options are."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(textwrap.fill(" ".join(par.split()), width, initial_indent=indent,
                                          subsequent_indent=indent) for par in text.split("\n\n"))


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (not the usage block) and exit code 2; every
    subcommand's help is formatted by `_Formatter`."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kw)

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help` for usage)\n")


_HELP_DB = "user instance DB, layered over the shipped one (default: $CKGEN_DB, else instances.yaml in the cache dir)"
_HELP_FORMAT = "output format: table, tsv or json (default: table on a terminal, tsv otherwise)"


def _common(p: argparse.ArgumentParser, prog: str, fn: Any, *, fmt: bool = False) -> None:
    p.add_argument("--db", default=argparse.SUPPRESS, help=_HELP_DB)
    if fmt:
        p.add_argument("--format", choices=FORMATS, help=_HELP_FORMAT)
    p.set_defaults(fn=fn, prog=prog)


def _search_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=_trial_count, default=40, help="measured candidates per problem (default: 40)")
    p.add_argument("--timeout", type=_seconds, help="seconds per problem (default: no limit)")
    p.add_argument("--total-timeout", type=_seconds, help="seconds for the whole run (default: no limit)")
    p.add_argument("--storage", help="optuna storage URL (default: sqlite:///<cache dir>/studies.sqlite3; "
                                     "several machines: postgresql+psycopg://user@host:5432/db)")
    p.add_argument("--seed", type=_count, default=0, help="sampler seed (default: 0)")
    p.add_argument("--sampler", choices=SAMPLERS, default="gp",
                   help="search strategy over the valid configs: gp, tpe or random (default: gp; "
                        "see docs/architecture.md)")


def _problem_options(p: argparse.ArgumentParser) -> None:
    """The problem options of `ckgen tune` (and `ckgen explain`, which takes the same problems):
    --shape, --grid, --dtype, --layout and each op family's own (`OpSpec.problem_options`)."""
    p.add_argument("--shape", type=_csv_ints, help="N,C,H,W (default: the op's default problems)")
    p.add_argument("--grid", metavar="NAME",
                   help="a named problem list of the op's tuning space (tuning_spaces/OP.yaml; e.g. sd15-unet, "
                        "sdxl-unet, sd-vae for GroupNorm, resnet, vgg for pooling; `ckgen list --op OP` shows them; "
                        "default: the default problems)")
    p.add_argument("--dtype", action="append", choices=["fp32", "fp16", "bf16"],
                   help="repeatable (default: bf16 with --shape, else the default problems' dtypes)")
    p.add_argument("--layout", action="append", choices=["nchw", "nhwc"],
                   help="repeatable (default: nchw with --shape, else the default problems' layouts)")
    owners = problem_flags()
    for g in _option_groups():
        group = p.add_argument_group(g.title, g.description)
        for o in g.options:
            if owners[o.dest] is o:  # a dest declared again by a later family: the first one's
                group.add_argument(o.flag, dest=o.dest, help=o.help, **_option_kwargs(o))


_OPTION_TYPES = {"ints": _csv_ints, "positive_int": _positive_int}


def _option_kwargs(o: Any) -> dict[str, Any]:
    """argparse's keywords for a `ProblemOption` besides flag, dest and help."""
    kw: dict[str, Any] = {}
    if o.action == "store_true":
        kw.update(action="store_true", default=None)
    elif o.action == "bool":
        kw.update(action=argparse.BooleanOptionalAction, default=None)
    elif o.action is not None:
        raise ValueError(f"{o.flag}: unknown action {o.action!r} (store_true or bool)")
    if o.type is not None:
        kw["type"] = _OPTION_TYPES[o.type] if isinstance(o.type, str) else o.type
    if o.choices is not None:
        kw["choices"] = list(o.choices)
    return kw


def parser() -> argparse.ArgumentParser:
    from ..ops import all_ops

    op_names = [o.name for o in all_ops()]
    p = _Parser(prog="ckgen", description="Generate, tune and dispatch GPU kernels for GroupNorm and pooling.")
    p.add_argument("--version", action="version", version=f"ckgen {__version__}")
    p.add_argument("--db", help=_HELP_DB)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    t = sub.add_parser(
        "tune", help="tune an op's problems on this GPU and record winners in the DB",
        description="Tune OP's problems on this GPU; each winner goes into the user DB.\n\n"
                    f"ops: {', '.join(op_names)}\n\n"
                    "Without --shape, the op's default problems (its tuning space's list, for every dtype and "
                    "layout unless --dtype/--layout narrow it; --list shows them). With --shape, one problem per "
                    "dtype x layout.")
    t.add_argument("op", metavar="OP", choices=op_names, help=f"the op to tune: one of {', '.join(op_names)}")
    _problem_options(t)
    t.add_argument("--list", action="store_true",
                   help="tune nothing: list the op's grids, or with --grid/--shape the problems this command "
                        "would tune (no GPU needed; default: off)")
    t.add_argument("--skip-tuned", action="store_true",
                   help="leave out the problems that already have a DB entry for this GPU's arch (user or "
                        "shipped DB): a grid tuned over several runs, each cut by --total-timeout, goes on "
                        "where the last one stopped (default: off: every problem is tuned)")
    t.add_argument("--workers", type=_workers, metavar="N|auto",
                   help="N worker processes sharing the problems and the study storage; auto: one per visible "
                        "GPU, each pinned with CUDA_VISIBLE_DEVICES (default: one process, no workers); "
                        "--trials/--timeout/--total-timeout then hold for the whole run")
    _search_options(t)
    _common(t, "ckgen tune", cmd_tune, fmt=True)

    ex = sub.add_parser(
        "explain", help="which instance each call of a problem would use, and why (no GPU needed with --arch)",
        description="Which instance the dispatcher would use for OP's problems, and why (what ckgen.explain "
                    "says): a tuned DB entry, the cost model's pick, the nearest tuned problem's winner or the "
                    "default. The problems are given as to `ckgen tune`: --shape (one problem per dtype x "
                    "layout), --grid, or none (the op's default problems). Nothing is compiled or launched.")
    ex.add_argument("op", metavar="OP", choices=op_names, help=f"the op: one of {', '.join(op_names)}")
    _problem_options(ex)
    ex.add_argument("--arch", help="the arch to explain for, e.g. sm_90 (default: this machine's GPU's; "
                                   "without a GPU, --arch is needed)")
    _common(ex, "ckgen explain", cmd_explain, fmt=True)

    g = sub.add_parser("generate", help="write and build the instance library for targets (no GPU needed)",
                       description="Write the instance library under --out: per target arch and op, the sources "
                                   "of the instances the DB's problems use (their tuned winners, else defaults), a "
                                   "manifest.yaml with each render's sha256, and report.yaml with what the offline "
                                   "build said (NVRTC for CUDA, clang for HIP; registers, spills). Instances whose "
                                   "source did not change since the last run reuse their build. No GPU needed.")
    g.add_argument("--target", default="sm_80,sm_90,gfx90a,gfx942,gfx1100",
                   help="comma-separated archs (default: sm_80,sm_90,gfx90a,gfx942,gfx1100)")
    g.add_argument("--ops", help="comma-separated ops (default: all)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--from-db", action="store_true", help="the DB's winners (the default)")
    src.add_argument("--defaults", action="store_true", help="the default config for each default problem")
    g.add_argument("--out", default="generated", help="library folder (default: generated)")
    g.add_argument("--no-compile", action="store_true", help="write sources and manifests only")
    g.add_argument("--check", action="store_true",
                   help="write nothing; fail if --out differs from a fresh generation: its manifests, and its "
                        "sources where it holds them (default: off)")
    g.add_argument("--jobs", type=_positive_int, help="parallel compiles (default: the CPU count)")
    _common(g, "ckgen generate", cmd_generate, fmt=True)

    rt = sub.add_parser("retune", help="re-tune every DB problem tuned on another arch, on this GPU",
                        description="Re-tune, on this GPU, every DB problem that has an entry for another arch "
                                    "but none for this one (--from-arch: only those tuned on that arch), starting "
                                    "from the other arch's winner; the new winners go into the user DB.")
    rt.add_argument("--from-arch", help="only problems tuned on this arch (default: any other)")
    rt.add_argument("--ops", help="comma-separated ops (default: all)")
    _search_options(rt)
    _common(rt, "ckgen retune", cmd_retune, fmt=True)

    b = sub.add_parser("bench", help="time every op's suite on this GPU against PyTorch eager and torch.compile",
                       description="Time every op's benchmark suite on this GPU (the dispatcher's choice per "
                                   "problem) against PyTorch eager and torch.compile; writes "
                                   "bench-<device>.md/.json/.png under --out. Needs a GPU and PyTorch.")
    b.add_argument("--ops", help="comma-separated ops (default: all eight)")
    b.add_argument("--out", help="folder for bench-<device>.md/.json/.png (default: $OUT or ./bench-results)")
    b.add_argument("--quick", action="store_true", help="every third problem of each suite")
    b.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    _common(b, "ckgen bench", cmd_bench)

    ls = sub.add_parser("list", help="the ops, their tunables and problem grids (no GPU needed)",
                        description="The ops, their tunables and problem grids; with --op, one op's tunables "
                                    "(values, default) and grids (problems, what they cover). The DB's entries: "
                                    "`ckgen db show [--op NAME]`.")
    ls.add_argument("--op", help="one op: every tunable's values and every grid (default: all ops, in brief)")
    _common(ls, "ckgen list", cmd_list, fmt=True)

    d = sub.add_parser("db", help="inspect the instance DB",
                       description="Inspect, export, pull and merge instance DBs (the user DB over the shipped "
                                   "one).")
    dsub = d.add_subparsers(dest="dbcmd", required=True, metavar="DBCOMMAND")
    show = dsub.add_parser("show", help="the DB entries in use (user DB over shipped DB), per op and arch",
                           description="The instance DB in use (the user DB over the shipped one): how many "
                                       "entries each op has per arch, from which DB; the entries themselves "
                                       "with --op NAME or --all.")
    which = show.add_mutually_exclusive_group()
    which.add_argument("--op", help="this op's entries (default: a count per op and arch)")
    which.add_argument("--all", action="store_true", help="every entry (default: a count per op and arch)")
    _common(show, "ckgen db show", cmd_db_show, fmt=True)
    exp = dsub.add_parser("export", help="CSV to stdout",
                          description="Every DB entry in use (user DB over shipped DB) as CSV on stdout, one row "
                                      "per entry.")
    _common(exp, "ckgen db export", cmd_db_export)
    where = dsub.add_parser("where", help="the resolved cache dir, user DB, shipped DB, and which entries come "
                                          "from which",
                            description="Every place ckgen reads or writes (cache dir, user and shipped DB, "
                                        "studies, kernels, cost model, records, templates, tuning spaces, ROCm), "
                                        "what set it and its state; then the entries in use per op and arch by "
                                        "origin.")
    _common(where, "ckgen db where", cmd_db_where, fmt=True)
    pull = dsub.add_parser("pull", help="DB entries from the finished studies of an optuna storage (the winners "
                                        "of `tune --workers` runs on other machines)",
                           description="Read the finished studies of an optuna storage (the `tune --workers` runs "
                                       "of other machines) and save each problem's winner into the user DB.")
    pull.add_argument("--storage", required=True, help="optuna storage URL, e.g. postgresql+psycopg://user@host:5432/ckgen")
    _common(pull, "ckgen db pull", cmd_db_pull, fmt=True)
    merge = dsub.add_parser("merge", help="merge DB files: per problem and arch the faster verified entry wins, "
                                          "ties by date",
                            description="Merge DB files into one: per (op, arch, problem), a verified entry (it "
                                        "validates and renders to its tuned source) wins, then the faster one, "
                                        "then the later one. Into -o, or without it into the user DB (--db).")
    merge.add_argument("dbs", nargs="+", metavar="DB", help="DB files (YAML)")
    merge.add_argument("-o", "--output",
                       help="the DB file to merge into (created if missing; entries saved to it meanwhile are kept; "
                            "default: the user DB)")
    _common(merge, "ckgen db merge", cmd_db_merge)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from ..runtime import db as dbmod

    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error (printed on one line): its code
        return e.code if isinstance(e.code, int) else 2
    prog = args.prog
    show = warnings.showwarning
    from ..tuner.storage_url import mask

    url = getattr(args, "storage", None)  # masked in every message, whatever raised it

    def one_line(message: Any, category: type, *rest: Any, **kw: Any) -> None:
        if issubclass(category, dbmod.DBWarning):
            err.print(f"{prog}: warning: {message}", markup=False)
        else:
            show(mask(str(message), url), category, *rest, **kw)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = one_line
            return int(args.fn(args) or 0)
    except UsageError as e:
        err.print(f"{prog}: {mask(str(e), url)}", markup=False)
        return 2
    except dbmod.DBError as e:  # a corrupt or unreadable DB file (strict reads)
        err.print(f"{prog}: {mask(str(e), url)}", markup=False)
        return 2
    except KeyboardInterrupt:
        err.print(f"{prog}: interrupted", markup=False)
        return 130
    except BrokenPipeError:  # the reader went away (`ckgen db show | head`): stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
