"""Opt-in online tuning, as PyTorch's TunableOp does it: with `CKGEN_TUNE=1`, or inside a
`with ckgen.tuning():` block, the first call of a problem that no DB entry has tunes it on the
spot with a small budget, writes the winner to the user DB and goes on with it. Never without
being asked.

- **Where:** at plan building only. `dispatch.Plan` builds a problem's plan once (per device,
  alignment class, framework, dtype) and asks `Dispatcher.choose` for the choice; when that choice
  is not a tuned DB entry, `choose` calls `maybe_tune` here. A call of a known signature never
  gets here: the fast path (signature -> plan -> launcher) has no check added.
- **Budget:** `CKGEN_TUNE_TRIALS` measured configs (default 12) and `CKGEN_TUNE_MAX_S` seconds
  of wall time per problem (default: no cap); a block's own values win over them.
- **Once:** each (op, problem, arch) is tried at most once per process, whether it succeeded or
  failed; a failure (no GPU, a compile error, the study storage, the DB) warns once
  (`OnlineTuningWarning`) and the call goes on with the normal choice (model, nearest, default).
  Failures that would repeat for every problem (no usable GPU, CuPy missing, the study storage)
  stop online tuning for the rest of the process.
- **Writes** go through `db.save_entries` (file lock, re-read, merge: concurrent processes lose
  no entry); its `on_change` hook makes the dispatcher drop its choices and plans, and the call
  selects again: the new entry, `[tuned]`.
- **CUDA graphs:** never while the caller's current stream is capturing (said once).
- **The hook:** the dispatcher never imports this module. Importing it (`ckgen` does) registers
  `maybe_tune` and `attempted` with the dispatcher (`dispatch.set_untuned_hook`).
- **The tuner** is `tune_on_device`: the `tune.Tuner` of `ckgen tune` (seeded with the incumbent,
  the default and the cost model's picks; then the final round) with a GPU `tune.Objective` that
  compiles ahead in threads of this process (NVRTC releases the GIL), not in spawned worker
  processes, which would re-import the user's script. `tuner` can be replaced (tests inject a
  replayed one, see `tune_with`).
- **Progress:** one line per problem on the `ckgen` logger (`CKGEN_QUIET=1` silences it).

Blocks: `tuning()` is process-wide while open (the autograd engine runs backward ops on its own
threads, which must see it too): a thread inside a block of its own uses its innermost one,
other threads the most recently opened block still open; with none open, `CKGEN_TUNE` decides.
Nested blocks inherit the values they leave as None from the block around them, then the env.
Opening an enabled block also drops the launch plans of untuned problems not tried yet, so a
problem first called before the block is tuned by its next call inside it."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import contextvars
import dataclasses
import datetime as _dt
import logging
import math
import numbers
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .. import settings
from ..runtime.dispatch import Site, set_untuned_hook  # noqa: F401 - Site: re-exported

log = logging.getLogger("ckgen")


class OnlineTuningWarning(UserWarning):
    """Online tuning of a problem failed or was skipped; the call goes on with the normal choice."""


@dataclass(frozen=True)
class Budget:
    trials: int  # configs measured per problem
    max_seconds: float | None  # wall-time cap per problem (None: none)


class _Block:
    """One open `tuning()` block (compared by identity)."""

    __slots__ = ("trials", "max_seconds", "enabled", "parent")

    def __init__(self, trials: int | None, max_seconds: float | None, enabled: bool, parent: "_Block | None"):
        self.trials, self.max_seconds, self.enabled, self.parent = trials, max_seconds, enabled, parent


_current: contextvars.ContextVar[_Block | None] = contextvars.ContextVar("ckgen_tuning", default=None)
_open: list[_Block] = []  # every thread's open blocks, in the order they were opened
_open_lock = threading.Lock()

_lock = threading.RLock()  # one online tuning at a time in this process (one GPU's timings)
_outcome: dict[tuple[str, str, str], bool] = {}  # (op, problem key, arch) tried -> a winner is in the DB
_halted: str | None = None  # why online tuning stopped for this process
_warned: set[str] = set()


# ------------------------------------------------------------------------------- the switch


@contextlib.contextmanager
def tuning(trials: int | None = None, max_seconds: float | None = None, *, enabled: bool = True) -> Iterator[Budget | None]:
    """Online tuning inside the block: the first call of a problem no DB entry has tunes it
    (`trials` measured configs, at most `max_seconds` of wall time per problem; None: the
    enclosing block's value, else `CKGEN_TUNE_TRIALS` / `CKGEN_TUNE_MAX_S`, else 12 / no cap;
    `math.inf`: no cap). `enabled=False` turns it off inside the block, `CKGEN_TUNE=1` or not.
    Thread-safe, nestable; yields the budget in effect (None when off)."""
    if trials is not None:
        if isinstance(trials, bool) or not isinstance(trials, numbers.Integral) or \
                not 1 <= trials <= settings.MAX_TUNE_TRIALS:
            raise ValueError(f"trials: expected a positive int, at most {settings.MAX_TUNE_TRIALS:,}, or None, "
                             f"got {trials!r}")
        trials = int(trials)
    if max_seconds is not None:
        if isinstance(max_seconds, bool) or not isinstance(max_seconds, numbers.Real) or not max_seconds > 0:
            raise ValueError(f"max_seconds: expected a number of seconds > 0 (math.inf: no cap) or None, "
                             f"got {max_seconds!r}")
        max_seconds = float(max_seconds)
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {enabled!r}")
    block = _Block(trials, max_seconds, enabled, _current.get())
    token = _current.set(block)
    with _open_lock:
        _open.append(block)
    try:
        want = budget()
        if want is not None:
            from ..runtime.dispatch import dispatcher

            dispatcher().drop_untuned()  # plans built before the block: their next call tunes
        yield want
    finally:
        with _open_lock:
            for i in range(len(_open) - 1, -1, -1):
                if _open[i] is block:
                    del _open[i]
                    break
        _current.reset(token)


def budget() -> Budget | None:
    """The online-tuning budget in effect for this thread, or None when online tuning is off."""
    block = _current.get()
    if block is None:
        with _open_lock:
            block = _open[-1] if _open else None
    if block is None:
        if not settings.tune_enabled():
            return None
    elif not block.enabled:
        return None
    trials = max_s = None
    b = block
    while b is not None:
        trials = b.trials if trials is None else trials
        max_s = b.max_seconds if max_s is None else max_s
        b = b.parent
    if trials is None:
        trials = _setting(settings.tune_trials, settings.TUNE_TRIALS, "12")
    if max_s is None:
        max_s = _setting(settings.tune_max_seconds, None, "no cap")
    return Budget(trials, None if max_s is None or math.isinf(max_s) else max_s)


def _setting(read: Callable[[], Any], default: Any, said: str) -> Any:
    try:
        return read()
    except ValueError as e:
        _warn_once(str(e), f"ckgen: {e}; online tuning uses {said}")
        return default


def _warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, OnlineTuningWarning, stacklevel=3)


def _say(message: str) -> None:
    if not settings.quiet():
        log.warning(message)


def attempted(op: str, problem: str, arch: str) -> bool:
    """Was this problem tried (tuned, or failed) by online tuning in this process, or has online
    tuning stopped for the process (so it never will be)?"""
    return _halted is not None or (op, problem, arch) in _outcome


def reset() -> None:
    """Forget which problems were tried and which warnings were given (tests)."""
    global _halted
    with _lock:
        _outcome.clear()
        _warned.clear()
        _halted = None


# ------------------------------------------------------------------------------- the hook


def maybe_tune(op: Any, problem: Any, target: Any, site: Site) -> bool:
    """Called by `Dispatcher.choose` while it builds a plan whose choice is not a tuned DB
    entry. Tunes the problem on `site.device` if online tuning is on and it was not tried yet in
    this process. True when the DB now has a winner for it (the caller selects again)."""
    want = budget()
    if want is None:
        return False
    key = (op.name, problem.key(), target.arch)
    what = f"{op.name} {problem.key()}"
    with _lock:  # a second thread building a plan of the same problem waits, then uses the winner
        done = _outcome.get(key)
        if done is not None:
            return done
        if _halted is not None:
            return False
        if _capturing(site):
            _warn_once("capture", f"ckgen: not tuning {what} online: the current stream is capturing a CUDA "
                       "graph; using the normal choice (said once: other problems met under capture are "
                       "not tuned either; each is tuned when a plan for it is next built outside capture)")
            return False
        has = _has_entry(op, problem, target)
        if has is not None:
            _outcome[key] = has
            return has
        _outcome[key] = False  # tried: whatever happens below, not again in this process
        return _tune(op, problem, target, site, want, key, what)


def _capturing(site: Site) -> bool:
    try:
        return bool(site.capturing())
    except Exception:  # noqa: BLE001 - cannot tell: do not risk a capture
        return True


def _usable(op: Any, problem: Any, target: Any, entry: Any) -> bool:
    from ..instance import render_instance
    from ..types import Config

    config = Config.of(entry.config_dict())
    try:
        return bool(op.validate(problem, config, target)) and \
            render_instance(op, problem, config, target).sha256 == entry.source_sha256
    except Exception:  # noqa: BLE001 - a config the space no longer knows
        return False


def _has_entry(op: Any, problem: Any, target: Any) -> bool | None:
    """None: no usable DB entry, tune. True: another process saved one since this process read
    the DB (the dispatcher reloads). False: the dispatcher's DB has one and passed it over (the
    pointers' alignment): not tuned again."""
    from ..runtime import db as dbmod
    from ..runtime.dispatch import dispatcher

    ident = (op.name, target.arch, problem.key())
    seen = dispatcher().database().lookup(*ident)
    if seen is not None and _usable(op, problem, target, seen):
        return False
    try:
        fresh = dbmod.InstanceDB.load(settings.user_db_path()).lookup(*ident)
    except Exception:  # noqa: BLE001 - an unreadable or corrupt user DB: the save says so
        return None
    if fresh is None or fresh == seen or not _usable(op, problem, target, fresh):
        return None
    dispatcher().reload()
    _say(f"ckgen: {op.name} {problem.key()}: tuned by another process meanwhile; using its DB entry")
    return True


def _fatal(e: BaseException) -> bool:
    """A failure that would repeat for every problem: stop online tuning in this process."""
    from ..runtime.target import NoGPUError
    from .tune import StudyStorageError

    return isinstance(e, (NoGPUError, ImportError, StudyStorageError))


def _tune(op: Any, problem: Any, target: Any, site: Site, want: Budget, key: tuple[str, str, str], what: str) -> bool:
    global _halted
    from ..runtime import db as dbmod

    t0 = time.monotonic()
    try:
        entry = tuner(op, problem, device=site.device, trials=want.trials, max_seconds=want.max_seconds)
        if getattr(entry, "ident", None) != (op.name, target.arch, problem.key()):
            raise RuntimeError(f"the tuner returned {getattr(entry, 'ident', entry)!r}, not an entry for this problem")
    except Exception as e:  # noqa: BLE001 - any failure: warn, and the call goes on untuned
        stop = _fatal(e)
        if stop:
            _halted = str(e)
        _warn_once(f"fail {key}", f"ckgen: online tuning of {what} failed ({e.__class__.__name__}: "
                   f"{str(e).strip()[:300]}); using the normal choice"
                   + ("; online tuning is off for the rest of this process" if stop else ""))
        return False
    path = settings.user_db_path()
    try:
        dbmod.save_entries(path, [entry])
    except dbmod.DBError as e:  # a corrupt DB: the entry is in a side file, which every load merges
        kept = getattr(e, "kept", None) is not None
        _warn_once(f"save {key}", f"ckgen: online tuning of {what}: the winner was not written to the user DB "
                   f"({str(e)[:300]})" + ("; it is kept in a side file and used" if kept else ""))
        _outcome[key] = kept
        return kept
    except OSError as e:
        _warn_once(f"save {key}", f"ckgen: online tuning of {what}: the winner was not written to {path} "
                   f"({e.__class__.__name__}: {e}); using the normal choice")
        return False
    _outcome[key] = True
    trials = dict(entry.provenance).get("trials", "?")
    vs = f" (default config {entry.default_time_us:.1f} us)" if entry.default_time_us > 0 else ""
    _say(f"ckgen: tuned {what} online: {entry.instance} {entry.time_us:.1f} us{vs}, {trials} trials in "
         f"{time.monotonic() - t0:.1f} s; saved to {path}")
    return True


# ------------------------------------------------------------------------------- the tuner


def tune_with(request: Any, ev: Any, *, record: Callable[..., None] | None = None, started: float | None = None,
              provenance: dict[str, Any] | None = None) -> Any:
    """Tune `request` (a `tune.TuneRequest`; its `timeout`: the wall-time cap of the problem,
    counted from `started`, default now) with evaluator `ev` (a GPU `tune.Objective`, or a
    `replay.ReplayEvaluator`) through the `tune.Tuner` of `ckgen tune` (the incumbent, the default
    and the cost model's picks first; the study's best, the default and the incumbent re-timed)
    and return the winner's DB entry (provenance `tuned_by: online`, plus `provenance`)."""
    import optuna

    from .._version import __version__
    from ..instance import render_instance
    from ..runtime.target import DeviceInfo
    from .tune import Tuner, db_entry

    t0 = time.monotonic() if started is None else started
    max_seconds = request.timeout
    if max_seconds is not None:
        request = dataclasses.replace(request, timeout=max(0.0, max_seconds - (time.monotonic() - t0)))
    tuner = Tuner(request, ev, record=record, started=t0)
    study = tuner.search()
    if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        why = (f"every measured config failed (first: {ev.failures[0][1][:200]})" if ev.failures else
               f"the time budget ({max_seconds:g} s) ran out before the first config was measured")
        raise RuntimeError(f"no config measured: {why}")
    ranked = tuner.final(study)
    if not ranked:
        raise RuntimeError(f"no candidate passed verification in the final round; failures: {ev.failures[:3]}")
    result = tuner.result(ranked)
    op, problem, target = request.op, request.problem, request.target
    src = render_instance(op, problem, result.best.config, target)  # the instance and source today's templates render
    result.best = dataclasses.replace(result.best, instance=src.name, sha256=src.sha256)
    prov = {"ckgen": __version__, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "trials": result.trials, "tuning_seconds": round(time.monotonic() - t0, 1), "tuned_by": "online",
            **(provenance or {})}
    info = DeviceInfo(target, request.device or "unknown device", request.num_sms, 0)
    return db_entry(result, info, prov)


def tune_on_device(op: Any, problem: Any, *, device: int, trials: int, max_seconds: float | None) -> Any:
    """The default `tuner`: tune `problem` on GPU `device` (the current one while a plan is
    built) in this process and return the winner's DB entry. The caller's queued GPU work is
    waited for first (it would skew the timings); CuPy's pool gives back what tuning allocated."""
    t0 = time.monotonic()
    from ..runtime.target import device_info, require_cupy

    info = device_info(device)
    cupy = require_cupy("tunes")
    rt = cupy.cuda.runtime
    rt.deviceSynchronize()
    try:
        from ..runtime.bench import Timer
        from ..model.records import Recorder
        from .tune import Objective, TuneRequest, dispatcher_pick
        from ..runtime.verify import Harness

        ev = Objective(op, problem, info.target, Harness(op, problem, seed=None), Timer(info.l2_bytes),
                       compile_ahead=_compile_ahead)
        prov = {"cupy": cupy.__version__, "cuda_runtime": int(rt.runtimeGetVersion()),
                "cuda_driver": int(rt.driverGetVersion())}
        request = TuneRequest.on(op, problem, info, trials=trials, timeout=max_seconds,
                                 storage=settings.study_storage_url(),
                                 incumbent=dispatcher_pick(op, problem, info.target))
        return tune_with(request, ev, record=Recorder(op, problem, info.target, info.name), started=t0,
                         provenance=prov)
    finally:
        ev = None
        cupy.get_default_memory_pool().free_all_blocks()


#: what online tuning calls: tuner(op, problem, device=int, trials=int, max_seconds=float | None) -> db.Entry
tuner: Callable[..., Any] = tune_on_device


_threads: cf.ThreadPoolExecutor | None = None


def _compile_threads() -> cf.ThreadPoolExecutor:
    global _threads
    with _lock:
        if _threads is None:
            _threads = cf.ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 2) - 1)),
                                             thread_name_prefix="ckgen-compile")
        return _threads


def _compile(src: Any, target: Any) -> str | None:
    """In a thread: the cubin into the disk cache, or the compiler's message."""
    from ..runtime.compile import CompileError, ensure_cubin

    try:
        ensure_cubin(src, target)
        return None
    except CompileError as e:
        return e.log.strip()[-400:]


def _compile_ahead(src: Any, target: Any) -> cf.Future[str | None] | None:
    """The objective's compile-ahead here: in this process's threads (NVRTC releases the GIL), not
    in spawned worker processes, which would re-import the user's script. HIP compiles when loaded
    (hiprtc): None."""
    if target.vendor != "cuda":
        return None
    return _compile_threads().submit(_compile, src, target)


# ------------------------------------------------------------------------------- registration


def _on_untuned(op: Any, problem: Any, target: Any, site: Site) -> bool:
    return maybe_tune(op, problem, target, site)  # looked up at each call (tests replace it)


def _attempted(op: str, problem: str, arch: str) -> bool:
    return attempted(op, problem, arch)


set_untuned_hook(_on_untuned, _attempted)  # the dispatcher never imports this module: it is told
