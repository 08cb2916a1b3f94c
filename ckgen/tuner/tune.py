"""One optuna study per problem. The sampler proposes only valid configs no trial holds yet
(ckgen/tuner/sampler.py: a Gaussian process by default), seeded with the default config, the cost
model's picks (ckgen/model/) and the op's own heuristic picks. Every measurement is
appended to the records file beside the user DB (ckgen/model/records.py): the cost model's training
data. Proposals are compiled in parallel worker processes a few ahead of the GPU, and each
result is told as it arrives, so the next proposal comes from the latest model. Wrong or failing
candidates are failed trials with their reason. Budgets in trials and seconds; resumable from
optuna storage (SQLite under the cache dir). The winner is picked among the best few by fresh
timings, interleaved over several rounds, by median.

The pipeline is written once: a `TuneRequest` (what to tune, the budget, the search's settings)
and a `Tuner` (model picks -> valid set -> incumbent -> search -> final round -> result) with the
evaluator as its one seam (`Objective` on this GPU, `replay.ReplayEvaluator` on recorded times).
`ckgen tune` and `ckgen retune` (`tune_problem`, then `save_result`), online tuning
(ckgen/tuner/online.py) and the workers (ckgen/tuner/workers.py: claiming and reporting around it) use it."""
from __future__ import annotations

import collections
import concurrent.futures as cf
import datetime as _dt
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from .. import settings
from ..instance import render_instance
from ..ops.spec import OpSpec, Problem
from ..runtime.bench import Timer, Timing, gbps
from ..runtime.compile import CompileError, compile_many, ensure_cubin
from ..runtime.compile import pool as compile_pool
from ..runtime.target import DeviceInfo
from ..runtime.verify import Harness
from ..types import Config, Target
from .storage_url import quiet_heartbeat_notices

quiet_heartbeat_notices()  # before any tuner thread saves the warning filters

# Configs proposed ahead of the one being measured: they compile in parallel while the GPU
# measures, and the next proposal is made from every result but theirs. Chosen on the recorded
# sweeps (bench/replay_search.py): more ahead compiles more in parallel but proposes blinder.
AHEAD = 4
FINALISTS = 3  # best configs of the study re-timed in the final round, with the default
ROUNDS = 5  # interleaved rounds of the final re-timing


class TrialFailed(Exception):
    """A candidate that failed to compile, launch, or verify: recorded, never a winner."""


@dataclass
class Measured:
    """A measured config. For a winner or default of `tune_problem`, `timing` summarizes the final
    rounds: median, min and max of the per-round medians (so `spread` is the run-to-run spread)."""

    config: Config
    instance: str
    sha256: str
    timing: Timing
    rounds: tuple[float, ...] = ()


@dataclass
class TuneResult:
    op: str
    problem: Problem
    best: Measured
    default: Measured | None
    copy: Timing | None  # the copy kernel's timing (None: not timed: `efficiency` is nan)
    min_bytes: int
    trials: int
    pruned: int  # proposals dropped before any compile (invalid or taken under a race); 0 normally
    failures: list[tuple[str, str]] = field(default_factory=list)  # (config key, reason)
    seconds: float = 0.0
    warm: list[Measured] = field(default_factory=list)  # the warm-start configs, measured here
    finalists: list[Measured] = field(default_factory=list)  # the final round, best first

    @property
    def gbps(self) -> float:
        return gbps(self.min_bytes, self.best.timing.median_us)

    @property
    def efficiency(self) -> float:
        return self.copy.median_us / self.best.timing.median_us if self.copy is not None else float("nan")

    @property
    def speedup_vs_default(self) -> float:
        return self.default.timing.median_us / self.best.timing.median_us if self.default else float("nan")


def study_name(op: OpSpec, problem: Problem, target: Target, device: str = "") -> str:
    """Resuming a study is only sound while the templates are unchanged: their digest is part
    of the name, so an edited template starts a fresh study instead of trusting old timings.
    The device name is part of it too: two GPUs of one arch do not share timings."""
    from ..codegen import templates_digest

    return f"{op.name}|{target.arch}|{device}|{problem.key()}|{templates_digest()[:12]}"


# Study storage shared by concurrent tuners: a trial's process beats every HEARTBEAT_S seconds
# while the trial runs; a RUNNING trial silent for GRACE_S (its tuner died) is failed by the next
# search on the study, and its config is enqueued again (retried first).
HEARTBEAT_S = 15
GRACE_S = 120
SQLITE_BUSY_S = 120  # how long a SQLite write waits for another tuner's lock
STALE_RETRIES = 2  # how often a trial lost with its tuner is enqueued again (optuna's RetryFailedTrialCallback)


class StudyStorageError(RuntimeError):
    """The optuna study storage failed (unreachable, locked too long, corrupt)."""


def _storage_errors() -> tuple[type[BaseException], ...]:
    import optuna

    errors: list[type[BaseException]] = [optuna.exceptions.StorageInternalError]
    try:
        import sqlalchemy.exc

        errors.append(sqlalchemy.exc.SQLAlchemyError)
    except ImportError:  # pragma: no cover - optuna's RDB storage needs it
        pass
    return tuple(errors)


def storage_problem(url: str) -> str | None:
    """Why `url` cannot be an optuna RDB storage, found without connecting (None: it may be
    one): not a database URL, an unknown database kind, a driver that is not installed, or a
    SQLite file whose folder is a file. What only a connection shows is StudyStorageError later."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        u = make_url(url)
    except (ArgumentError, ValueError):
        return f"{url!r} is not a database URL (e.g. sqlite:///studies.db)"
    try:
        dialect = u.get_dialect()
    except NoSuchModuleError:
        return f"unknown database kind {u.drivername!r} in {url!r}; use an optuna RDB URL such as sqlite:///studies.db"
    try:
        (getattr(dialect, "import_dbapi", None) or dialect.dbapi)()
    except ImportError as e:
        hint = ""
        if u.get_backend_name() == "postgresql":
            hint = ("; pip install 'ckgen[postgres]' (psycopg 3) and name its driver: "
                    "postgresql+psycopg://user@host:5432/db")
        return f"the {u.get_backend_name()} driver for {url!r} is not installed ({e}){hint}"
    if u.get_backend_name() == "sqlite" and (not u.database or u.database == ":memory:"
                                             or "mode=memory" in u.database):
        # gone when the command ends, shared with no worker, and `db pull` would read no study
        # in it (and leave `:memory:.lock` behind)
        return (f"{url!r} is a SQLite storage in memory, which holds no studies once the command ends; "
                "name a file, e.g. sqlite:///studies.sqlite3")
    if u.get_backend_name() == "sqlite":
        path = Path(u.database)
        if path.is_dir():
            return f"{path} is a directory; name a file, e.g. sqlite:///{path / 'studies.sqlite3'}"
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            return f"{parent} is not a directory"
    return None


def sqlite_storage_problem(path: Path) -> str | None:
    """Why the existing SQLite file at `path` is not an optuna study storage (None: it is one),
    found by reading it only: optuna opening it would add its tables to any SQLite database."""
    import sqlite3

    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.Error as e:
        return f"{path} is not an optuna study storage (not a SQLite database: {e})"
    if not {"studies", "trials", "version_info"} <= tables:
        return f"{path} is not an optuna study storage (it has no optuna tables)"
    return None


def shown_url(url: Any) -> str:
    """A storage URL to print: its password masked (postgresql+psycopg://user:***@host/db)."""
    if not isinstance(url, str) or "@" not in url:
        return str(url)
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy parses: shown as given
        return url


def open_storage(storage: Any, *, existing: bool = False) -> Any:
    """An optuna storage for a URL: heartbeats on; for SQLite, a generous busy timeout, and the
    schema created under a file lock (concurrent first runs on a fresh file raced on it); for
    PostgreSQL, under an advisory lock. `existing`: a SQLite file known to hold optuna's schema
    (`sqlite_storage_problem`, as `db pull` checks it), opened without that lock, so a reader
    leaves no lock file beside it. Other values (None: in memory, a storage object) are
    returned as they are."""
    quiet_heartbeat_notices()
    if not isinstance(storage, str):
        return storage
    import contextlib

    import filelock
    import optuna

    kw: dict[str, Any] = dict(heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # heartbeat options are experimental in some versions
            kw.update(_retry_callback(optuna))
            if storage.startswith("sqlite:///"):
                path = Path(storage[len("sqlite:///"):])
                path.parent.mkdir(parents=True, exist_ok=True)
                kw["engine_kwargs"] = {"connect_args": {"timeout": SQLITE_BUSY_S}}
                with contextlib.nullcontext() if existing else filelock.FileLock(f"{path}.lock", timeout=SQLITE_BUSY_S):
                    return optuna.storages.RDBStorage(storage, **kw)
            lock = claim_lock(storage, "ckgen schema")  # PostgreSQL: first runs race on the schema too
            with lock if isinstance(lock, _PgAdvisoryLock) else contextlib.nullcontext():
                return optuna.storages.RDBStorage(storage, **kw)
    except (*_storage_errors(), filelock.Timeout, OSError) as e:
        raise StudyStorageError(f"optuna study storage {shown_url(storage)}: {e.__class__.__name__}: {e}") from None


def _retry_callback(optuna: Any) -> dict[str, Any]:
    """The RDB storage's option that retries a trial failed for a silent heartbeat (its tuner
    died): `RetryFailedTrialCallback` enqueues its config again (WAITING, proposed first), at
    most STALE_RETRIES times per config, so a config that kills its tuner is not retried forever.
    optuna 4.9 renamed both (failed_trial_callback -> heartbeat_stale_trial_callback,
    RetryFailedTrialCallback -> RetryHeartbeatStaleTrialCallback)."""
    import inspect

    retry = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or \
        optuna.storages.RetryFailedTrialCallback
    cb = retry(max_retry=STALE_RETRIES)
    params = inspect.signature(optuna.storages.RDBStorage.__init__).parameters
    name = "heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params else "failed_trial_callback"
    return {name: cb}


def _beats(storage: Any) -> bool:
    """Does this storage keep heartbeats (an RDB storage opened with heartbeat_interval)?"""
    interval = getattr(storage, "get_heartbeat_interval", None)
    return bool(interval and interval() is not None and hasattr(storage, "record_heartbeat"))


def claim_lock(storage: Any, name: str = "") -> Any:
    """Tuners sharing a study take this lock to propose, so that two never pick one config:
    on a SQLite file, a file lock beside it (`<file>.propose.lock`, one for every study of the
    file); on PostgreSQL, an advisory lock keyed by the study `name` (`_PgAdvisoryLock`),
    which the server drops with the connection of a tuner that died. Other storages have no
    such lock: there, two tuners racing may measure one config twice (a later trial that sees
    an earlier holder of its config is dropped, but a check after the fact does not catch
    every race)."""
    import contextlib

    import filelock

    url = storage if isinstance(storage, str) else getattr(storage, "url", None)  # a URL or an RDBStorage
    if isinstance(url, str) and url.startswith("sqlite:///"):
        return filelock.FileLock(f"{url[len('sqlite:///'):]}.propose.lock", timeout=SQLITE_BUSY_S)
    if isinstance(url, str) and url.startswith(("postgresql:", "postgresql+", "postgres:")):
        return _PgAdvisoryLock(url, name)
    return contextlib.nullcontext()


_pg_engines: dict[str, Any] = {}


class _PgAdvisoryLock:
    """`pg_advisory_lock` on a 64-bit key hashed from `name`, held on a connection of its own
    for the duration of a `with` block. Waits at most SQLITE_BUSY_S (`lock_timeout`); a tuner
    killed while holding it loses its connection, and the server releases the lock with it."""

    def __init__(self, url: str, name: str):
        import hashlib

        self.url = url
        self.key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)
        self.conn: Any = None

    def __enter__(self) -> "_PgAdvisoryLock":
        import sqlalchemy

        engine = _pg_engines.get(self.url)
        if engine is None:
            engine = _pg_engines[self.url] = sqlalchemy.create_engine(self.url, pool_size=1, max_overflow=4,
                                                                      pool_pre_ping=True)
        conn = engine.connect()
        try:
            conn.exec_driver_sql(f"SET lock_timeout = '{int(SQLITE_BUSY_S * 1000)}ms'")
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": self.key})
            conn.commit()
        except BaseException:
            conn.invalidate()
            conn.close()
            raise
        self.conn = conn
        return self

    def __exit__(self, *exc: Any) -> None:
        import sqlalchemy

        conn, self.conn = self.conn, None
        try:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
            conn.commit()
        except BaseException:
            conn.invalidate()  # a connection that may still hold the lock is closed, never pooled
            raise
        finally:
            conn.close()


class Heartbeat:
    """Beats from a thread every HEARTBEAT_S seconds (read at each beat: the workers' tests shorten
    it) for each item it holds: `beat(item)`, until the item is removed or the heartbeat closed. A
    failed beat is retried at the next; the work around it reports storage errors. Used for the
    trials a search holds (`trial_heartbeat`) and for a worker's claim on a final round
    (ckgen/tuner/workers.py). `beat` None: it does nothing (a storage without heartbeats)."""

    def __init__(self, beat: Callable[[Any], None] | None):
        import threading

        self.beat = beat
        self.items: set[Any] = set()
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True) if beat is not None else None
        if self.thread is not None:
            self.thread.start()

    def add(self, item: Any, now: bool = True) -> None:
        """Beat for `item` from now on (`now`: a first beat at once, in this thread)."""
        if self.beat is not None:
            with self.lock:
                self.items.add(item)
            if now:
                self.beat(item)

    def remove(self, item: Any) -> None:
        with self.lock:
            self.items.discard(item)

    def _run(self) -> None:
        assert self.beat is not None
        while not self.stop.wait(HEARTBEAT_S):
            with self.lock:
                items = list(self.items)
            for i in items:
                try:
                    self.beat(i)
                except Exception:  # noqa: BLE001 - a missed beat is retried; the work reports storage errors
                    pass

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def __enter__(self) -> "Heartbeat":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def trial_heartbeat(study: Any) -> Heartbeat:
    """The heartbeat of the trials (their ids) this process holds in `study`, for a storage that
    keeps heartbeats (a RUNNING trial silent for GRACE_S is failed and its config proposed again)."""
    storage = study._storage
    return Heartbeat(storage.record_heartbeat if _beats(storage) else None)


def _compile_job(src: Any, target: Target, cache: str) -> str | None:
    """In a worker process: the cubin into the disk cache (the caller's), or the compiler's message."""
    from .. import settings

    os.environ[settings.ENV_CACHE] = cache
    try:
        ensure_cubin(src, target)
        return None
    except CompileError as e:
        return e.log.strip()[-400:]


def compile_in_pool(src: Any, target: Target) -> cf.Future[str | None]:
    """`Objective`'s default compile-ahead: in the compile pool of this process (`compile.pool`:
    worker processes, shut down by `compile.close_pool`), into the disk cache of this process."""
    return compile_pool().submit(_compile_job, src, target, str(settings.cache_dir()))


class Objective:
    """The GPU evaluator of a `Tuner`: compiles (in the background), verifies and times configs of
    one problem on this GPU. `compile_ahead(src, target)` starts a config's compile and returns
    its future (the compiler's message, or None), or None to compile when measured; default:
    `compile_in_pool` (worker processes). Online tuning compiles in threads instead."""

    def __init__(self, op: OpSpec, problem: Problem, target: Target, harness: Harness, timer: Timer,
                 compile_ahead: Callable[[Any, Target], cf.Future[str | None] | None] | None = None):
        self.op, self.problem, self.target, self.h, self.timer = op, problem, target, harness, timer
        self.compile_ahead = compile_ahead or compile_in_pool
        self.space = op.space
        self.failures: list[tuple[str, str]] = []
        self.measured: dict[Config, Measured] = {}
        self.compile_errors: dict[str, str] = {}
        self.pending: dict[Config, cf.Future[str | None]] = {}
        self.runners: dict[Config, Callable[[], None]] = {}
        self.pruned = 0

    def start(self, configs: list[Config]) -> None:
        """Start compiling (`compile_ahead`), without waiting: `measure` waits for its own config."""
        for c in configs:
            if c in self.measured or c in self.pending:
                continue
            job = self.compile_ahead(render_instance(self.op, self.problem, c, self.target), self.target)
            if job is not None:
                self.pending[c] = job

    def prepare(self, configs: list[Config]) -> None:
        """Compile many in parallel and wait (bench/sweep.py)."""
        srcs = [render_instance(self.op, self.problem, c, self.target) for c in configs if c not in self.measured]
        self.compile_errors.update(compile_many(srcs, self.target))

    def _runner(self, config: Config) -> tuple[Any, Callable[[], None]]:
        """Compiled, loaded and verified on fresh inputs in this run; TrialFailed otherwise."""
        src = render_instance(self.op, self.problem, config, self.target)
        if config in self.runners:
            return src, self.runners[config]
        job = self.pending.pop(config, None)
        if job is not None:
            try:
                msg = job.result()
            except Exception:  # a worker died: the runner compiles it here instead
                msg = None
            if msg:
                self.compile_errors[src.name] = f"{src.name}: {msg}"
        if src.name in self.compile_errors:
            raise TrialFailed(f"compile error: {self.compile_errors[src.name]}")
        try:
            run = self.h.runner(src, config, self.target)
        except CompileError as e:
            raise TrialFailed(f"compile error: {e.log.strip()[-300:]}") from None
        try:
            check = self.h.check(run)
        except Exception as e:  # launch failures (out of resources, illegal address) fail the trial
            raise TrialFailed(f"launch error: {e.__class__.__name__}: {e}") from None
        if not check.ok:
            raise TrialFailed(f"wrong result: {check.detail}")
        self.runners[config] = run
        return src, run

    def measure(self, config: Config) -> Measured:
        if config in self.measured:
            return self.measured[config]
        src, run = self._runner(config)
        m = Measured(config, src.name, src.sha256, self.timer.time(run))
        self.measured[config] = m
        return m

    def retime(self, configs: list[Config], rounds: int) -> tuple[dict[Config, Measured], dict[Config, str]]:
        """Fresh timings of `configs`, interleaved: every round times each once (25 runs, median),
        in an order rotated by one per round. Returns their Measured (timing over the rounds)
        and the configs that failed with why."""
        runs: dict[Config, tuple[Any, Callable[[], None]]] = {}
        failed: dict[Config, str] = {}
        for c in configs:
            try:
                runs[c] = self._runner(c)
            except TrialFailed as e:
                failed[c] = str(e)
        order = list(runs)
        times: dict[Config, list[float]] = {c: [] for c in order}
        for r in range(rounds if order else 0):
            k = r % len(order)
            for c in order[k:] + order[:k]:
                times[c].append(self.timer.time(runs[c][1]).median_us)
        return {c: final_measured(c, runs[c][0].name, runs[c][0].sha256, times[c]) for c in order}, failed


def final_measured(config: Config, instance: str, sha256: str, rounds: list[float]) -> Measured:
    """A config's final-round result: the median of its per-round medians, min and max as spread."""
    return Measured(config, instance, sha256,
                    Timing(statistics.median(rounds), min(rounds), max(rounds), len(rounds)), tuple(rounds))


def valid_space(op: OpSpec, problem: Problem, target: Target,
                restrict: Callable[[Config], bool] | None = None) -> list[Config]:
    """The configs of the space valid for `problem` that `restrict` accepts (all: None), in the
    space's order; RuntimeError when there is none."""
    # `restrict` first: a set lookup where it is given (a replay's recorded configs), before validate
    valid = [c for c in op.space.enumerate() if (restrict is None or restrict(c)) and op.validate(problem, c, target)]
    if not valid:
        raise RuntimeError(f"{op.name} {problem.key()}: no config of the space is valid for this problem")
    return valid


def geometry(op: OpSpec, problem: Problem, target: Target) -> Callable[[Config], dict[str, float]]:
    """What the sampler's model sees beyond the knobs, from the op's contract alone: the blocks of
    the main (last) launch, and the bytes each of their threads moves (these ops are memory-bound:
    parallelism and work per thread decide most of the time, and both combine several knobs)."""
    need = op.min_bytes(problem)

    def features(c: Config) -> dict[str, float]:
        launch = op.launches(problem, c, target)[-1]
        blocks = launch.grid[0] * launch.grid[1] * launch.grid[2]
        threads = launch.block[0] * launch.block[1] * launch.block[2]
        return {"blocks": float(blocks), "bytes_per_thread": max(need / (blocks * threads), 1e-3)}

    return features


def n_seeds(trials: int) -> int:
    return max(2, min(12, trials // 4))


def _heuristic_seeds(op: OpSpec, seeds: list[Config], count: int, trials: int) -> list[Config]:
    """`count` of the op's seeds, but at least the first of each family (`op.seed_family`) while
    they fit in half the budget: times jump between families, so a family no seed stands for is
    one the model rarely proposes (on the NCHW sweep the best config is the only good one of its
    family, 16% ahead of the next). In `seeds`' order."""
    families = len({op.seed_family(c) for c in seeds})
    return op.families_first(seeds, max(count, min(families, trials // 2)))


# Winners of the nearest recorded problems seeded beside the cost model's picks (`model_picks`),
# within the `n_seeds` slots (so at most 3 at 20 trials). 4 was chosen on the replayed sweeps
# (bench/replay_search.py): runs within 3% of the best over the 22 sweeps x 3 seeds at 40 / 20 trials: 1
# neighbour 57/66, 46/66; 2: 60, 45; 3: 57, 51; 4: 60, 51 (none, over 20 seeds: 82%, 68%).
NEIGHBOURS = 4


def model_picks(op: OpSpec, problem: Problem, target: Target, trials: int,
                allowed: Callable[[Config], bool] | None = None, model: Any = None,
                records: list[dict[str, Any]] | None = None, neighbours: int = NEIGHBOURS) -> tuple[Config, ...]:
    """The first seeds of a search of `trials` (`TuneRequest.picks`) that `allowed` accepts
    (default: every valid config): the cost model's best candidates, then the distinct winners of
    the `neighbours` nearest recorded problems (`model.nearest_recorded_winners`; as many as
    fit in `n_seeds(trials)`), which do not hang on the model (when it is wrong about a problem,
    all its picks tend to be wrong alike).
    `model`: a CostModel to ask instead of the one in use; `records`: the records to take the
    neighbours from instead of the shipped and user ones (`records.all_records`; a replay passes
    both without the replayed problem's records)."""
    from .. import model as cm

    ok = allowed or (lambda c: bool(op.validate(problem, c, target)))
    if records is None:
        from ..model import records as recmod

        records = recmod.all_records()
    # the recorded winners carried with their grid join the model's candidates, as the
    # dispatcher's DB winners do (`model.dispatch_pick`): a winner of batch 16 keeps its
    # blocks per SM at batch 1 (without them, a 40-trial tune of the held-out 1x4x1024x1024
    # GroupNorm forward found 27 us where the dispatcher's carried pick ran 19 us)
    carried = cm.carried_winners(op, problem, target, cm.recorded_winners(records, op, target.arch))
    picks = cm.top_configs(op, problem, target, max(1, n_seeds(trials) // 2), ok, model=model,
                                  extra_winners=carried)
    neighbours = min(neighbours, n_seeds(trials) - len(picks))  # `Tuner.search` seeds no more
    if neighbours > 0:
        fresh = lambda c: c not in picks and bool(ok(c))  # noqa: E731
        near = cm.nearest_recorded_winners(records, op, problem, target.arch, fresh, neighbours)
        picks += [c for c, _ in near]
    return tuple(picks)


# The cost model a request names by default: the one in use (`model.load()`).
IN_USE = "in use"


@dataclass(frozen=True)
class TuneRequest:
    """What to tune and how: one problem of one op on one device, its budget, the search's
    settings and what the search starts from. The one input of a `Tuner`, so of `ckgen tune`,
    `ckgen retune`, online tuning (ckgen/tuner/online.py) and the workers (ckgen/tuner/workers.py)."""

    op: OpSpec
    problem: Problem
    target: Target
    device: str = ""  # the GPU's name: in the study name (two GPUs of one arch share no timings)
    num_sms: int = 132
    trials: int = 40  # configs measured in this run, failed ones included
    timeout: float | None = None  # seconds for the search (None: no cap)
    storage: Any = None  # optuna storage: None (in memory), a URL (`open_storage`), or a storage
    seed: int = 0  # the sampler's
    sampler: str | None = None  # a sampler strategy (ckgen/tuner/sampler.py); None: its default
    ahead: int = AHEAD  # configs proposed and compiling while one is measured
    rounds: int = ROUNDS  # interleaved rounds of the final re-timing
    finalists: int = FINALISTS  # the study's best configs re-timed in the final round
    warm: tuple[Config, ...] = ()  # measured first (`ckgen retune`: another arch's winner)
    # what the call runs today (`dispatcher_pick`): measured right after `warm` and re-timed in the
    # final round, so a tune never ends on a config slower than it; ignored when not valid
    incumbent: Config | None = None
    restrict: Callable[[Config], bool] | None = None  # search only the valid configs it accepts
    # the cost model: its prediction is the sampler's prior mean; IN_USE (`model.load()`), a
    # CostModel, or None (a zero prior mean, and no model picks)
    model: Any = IN_USE
    # the first seeds after the default; None: the model's (`model_picks`; none without a model)
    picks: tuple[Config, ...] | None = None

    @classmethod
    def on(cls, op: OpSpec, problem: Problem, info: DeviceInfo, **fields: Any) -> "TuneRequest":
        """A request for the GPU `info` describes (its target, name and SM count)."""
        return cls(op, problem, info.target, device=info.name, num_sms=info.num_sms, **fields)

    def study_name(self) -> str:
        return study_name(self.op, self.problem, self.target, self.device)


class Tuner:
    """One problem's tuning pipeline: model picks -> valid set -> incumbent -> search -> final
    round -> result (`run`; the workers run `search` and `final` apart, around their claims).

    The evaluator is the one seam: `Objective` (this GPU), `replay.ReplayEvaluator` (recorded
    or synthetic times) or any object with their contract: `start(configs)` begins compiling
    without waiting; `measure(config)` returns a Measured or raises TrialFailed; `retime(configs,
    rounds)` returns (Measured by config, why by failed config); `measured` (config -> Measured),
    `failures` ([(config key, why)]) and `pruned` (int) are kept on it.

    Hooks: `record(config, time_us or None, reason, phase=...)` gets every measurement (the
    records: `records.Recorder`); `on_trial(done, total, best_us)` reports progress; `run`, a
    budget shared with other tuners (ckgen/tuner/workers.py): `run.allow(study)`, asked under the propose
    lock before each proposal, says whether the shared budget has room for one more trial, and
    `run.tag(trial)`, still under the lock, marks the trial as the run's. `valid`: the valid
    configs (`valid_space`), where the caller has them already (a second or more of CPU for a
    large space). `started`: `time.monotonic()` when the tuning began (the result's seconds)."""

    def __init__(self, request: TuneRequest, evaluator: Any, *, record: Callable[..., None] | None = None,
                 on_trial: Callable[[int, int, float], None] | None = None, run: Any = None,
                 valid: list[Config] | None = None, started: float | None = None):
        self.req, self.ev = request, evaluator
        self.record, self.on_trial, self.shared = record, on_trial, run
        self.started = time.monotonic() if started is None else started
        self._valid, self._index = valid, None if valid is None else frozenset(valid)
        self._model: Any = self  # not asked yet
        self._picks: tuple[Config, ...] | None = None

    # -- the steps
    def model(self) -> Any:
        """The cost model of the request (IN_USE: loaded once), or None."""
        if self._model is self:
            m = self.req.model
            if isinstance(m, str) and m == IN_USE:
                from .. import model as cm

                m = cm.load()
            self._model = m
        return self._model

    def picks(self) -> tuple[Config, ...]:
        """The model's picks to seed (`model_picks`), or the request's own."""
        if self._picks is None:
            r = self.req
            if r.picks is not None:
                self._picks = tuple(r.picks)
            elif r.model is None:
                self._picks = ()
            else:
                in_use = isinstance(r.model, str) and r.model == IN_USE
                self._picks = model_picks(r.op, r.problem, r.target, r.trials, model=None if in_use else r.model)
        return self._picks

    def valid(self) -> list[Config]:
        """The configs searched: the valid ones the request's `restrict` accepts (made once)."""
        if self._valid is None:
            self._valid = valid_space(self.req.op, self.req.problem, self.req.target, self.req.restrict)
            self._index = frozenset(self._valid)
        return self._valid

    def index(self) -> frozenset[Config]:
        self.valid()
        assert self._index is not None
        return self._index

    def incumbent(self) -> tuple[Config, ...]:
        """The request's incumbent, if it is valid here."""
        inc = self.req.incumbent
        return (inc,) if inc is not None and inc in self.index() else ()

    def default(self) -> Config:
        """"The default": the space's default, or the valid config nearest it (as the dispatcher's)."""
        index = self.index()
        cfg = self.req.op.space.nearest_default(lambda c: c in index)
        assert cfg is not None  # the valid set is not empty
        return cfg

    def search(self) -> Any:
        """The search loop: returns the optuna study (the default config measured first, after
        `warm` and the incumbent, then the model's picks and the op's heuristic seeds).

        - `trials` counts configs measured in this run (failed ones included), at most the number
          of valid configs no trial holds yet. Every trial holds a distinct config.
        - `ahead` configs are proposed and compiling while one is measured; each result is told
          as it arrives and the next proposal is made from it.
        - The model's picks take the first of the `n_seeds(trials)` seed slots, `op.seed_configs`
          the rest (at least one of each `op.seed_family`, within half the budget:
          `_heuristic_seeds`).
        - Several tuners may share one study (a storage URL): each proposes configs no other
          holds (`claim_lock`), and the trials of a tuner that died are failed after GRACE_S and
          their configs proposed again.
        Storage failures raise StudyStorageError."""
        import filelock
        import optuna

        storage = self.req.storage
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            with warnings.catch_warnings():  # we beat ourselves (ask/tell, not Study.optimize)
                warnings.filterwarnings("ignore", message="Heartbeat of storage")
                warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
                return self._search(open_storage(storage), claim_lock(storage, self.req.study_name()))
        except (*_storage_errors(), filelock.Timeout) as e:
            raise StudyStorageError(f"optuna study storage {shown_url(storage)}: {e.__class__.__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''}") from None

    def _search(self, storage: Any, claims: Any) -> Any:
        import optuna

        from .sampler import DEFAULT_STRATEGY, FAILURE_ATTR, ValidSetSampler, config_of, settled

        r, ev, run = self.req, self.ev, self.shared
        op, problem, target = r.op, r.problem, r.target
        t0 = time.monotonic()
        valid, valid_set = self.valid(), self.index()
        # Trials are suggested over the space's own values, so a study keeps its distributions.
        choices = {n: list(vals) for n, vals in op.space.params.items()}
        names = list(choices)
        model, prior = self.model(), None
        if model is not None:  # the cost model's prediction is the GP's prior mean
            prior = [math.log(max(p.gpu_us, 1e-3)) for p in model.predict_many(op, problem, valid, target)]
        smp = ValidSetSampler(valid, choices, strategy=r.sampler or DEFAULT_STRATEGY, seed=r.seed,
                              extra=geometry(op, problem, target), prior=prior)
        study = optuna.create_study(study_name=r.study_name(), storage=storage, load_if_exists=True,
                                    direction="minimize", sampler=smp)
        if _beats(study._storage):
            optuna.storages.fail_stale_trials(study)  # a dead tuner's RUNNING trials: FAIL, proposable again
        default_cfg = self.default()
        warm = tuple(dict.fromkeys(r.warm + self.incumbent()))
        seeds = [c for c in op.seed_configs(problem, target, r.num_sms, count=len(valid)) if c in valid_set]
        picks = list(dict.fromkeys(c for c in self.picks() if c in valid_set))[: n_seeds(r.trials)]
        enqueue = [c for c in warm if c in valid_set] + [default_cfg] + picks + \
            _heuristic_seeds(op, [c for c in seeds if c not in picks], n_seeds(r.trials) - len(picks), r.trials)
        for cfg in dict.fromkeys(enqueue):
            study.enqueue_trial(cfg.as_dict(), skip_if_exists=True)
        States = optuna.trial.TrialState
        trials = min(r.trials, smp.available(study))
        done, best = 0, math.inf
        in_flight: collections.deque[tuple[Any, Config]] = collections.deque()
        beat = trial_heartbeat(study)
        # Every trial this search asked for and has not told yet, proposed, in flight or being
        # measured: however the search ends (Ctrl-C, an error), none is left RUNNING, where
        # `db pull` would skip its study until the same tune ran again.
        held: dict[int, Any] = {}

        def hold(trial: Any) -> None:
            held[trial.number] = trial
            beat.add(trial._trial_id)

        def release(trial: Any) -> None:
            held.pop(trial.number, None)
            beat.remove(trial._trial_id)

        def drop(trial: Any, attr: str, value: Any) -> None:
            trial.set_user_attr(attr, value)
            study.tell(trial, state=States.FAIL, skip_if_finished=True)

        def propose() -> tuple[Any, Config] | None:
            """The next trial and its config, or None when every valid config is taken."""
            with claims:  # tuners sharing the study propose one at a time: no two claim one config
                return _propose()

        def _propose() -> tuple[Any, Config] | None:
            while smp.available(study) > 0:
                if run is not None and not run.allow(study):  # the shared budget is spent
                    return None
                trial = study.ask()
                hold(trial)
                cfg = Config.of({n: trial.suggest_categorical(n, choices[n]) for n in names})
                if cfg not in valid_set:  # only an enqueued config from elsewhere can be invalid here
                    ok = op.validate(problem, cfg, target)
                    reason = ok.reason if not ok else "outside the searched configs"
                else:  # under a race with another tuner, the lower trial number keeps the config
                    twin = next((t.number for t in study.get_trials(deepcopy=False)
                                 if t.number != trial.number and config_of(t, names) == cfg and settled(t)
                                 and (t.state != States.RUNNING or t.number < trial.number)), None)
                    if twin is None:
                        if run is not None:
                            run.tag(trial)
                        return trial, cfg
                    reason = None
                ev.pruned += 1
                drop(trial, "invalid" if reason else "duplicate_of", reason or twin)
                release(trial)
            return None

        def time_left() -> bool:
            return r.timeout is None or time.monotonic() - t0 < r.timeout

        exhausted = False
        try:
            while True:
                while not exhausted and time_left() and done + len(in_flight) < trials and \
                        len(in_flight) < max(1, r.ahead):
                    got = propose()
                    if got is None:
                        exhausted = True
                    else:
                        ev.start([got[1]])
                        in_flight.append(got)
                if not in_flight or not time_left():
                    break
                trial, config = in_flight.popleft()
                try:
                    m = ev.measure(config)
                except TrialFailed as e:
                    trial.set_user_attr(FAILURE_ATTR, str(e))
                    ev.failures.append((config.key(), str(e)))
                    study.tell(trial, state=States.FAIL, skip_if_finished=True)
                    if self.record:
                        self.record(config, None, str(e))
                else:
                    trial.set_user_attr("instance", m.instance)
                    trial.set_user_attr("spread", round(m.timing.spread, 4))
                    study.tell(trial, m.timing.median_us, skip_if_finished=True)
                    best = min(best, m.timing.median_us)
                    if self.record:
                        self.record(config, m.timing.median_us)
                release(trial)
                done += 1
                if self.on_trial:
                    self.on_trial(done, trials, best)
        finally:
            try:
                # proposed and never measured (the time budget), or cut short (Ctrl-C, an error):
                # failed as cancelled, not for a reason, so their configs are proposed again
                for trial in list(held.values()):
                    try:
                        drop(trial, "cancelled", True)
                    except Exception:  # noqa: BLE001 - already told, or the storage is failing: its heartbeat stops
                        pass
            finally:
                beat.close()
        return study

    def final(self, study: Any) -> list[Measured]:
        """The final round (`final_round`: the study's best `finalists`, the default and the
        incumbent re-timed over `rounds` rounds), best median first; each is recorded (phase
        "final"). Failures go to the evaluator's."""
        ranked = final_round(self.ev, study, self.default(), set(self.index()), self.req.rounds,
                             self.req.finalists, also=self.incumbent())
        if self.record:
            for m in ranked:
                self.record(m.config, m.timing.median_us, phase="final")
        return ranked

    def result(self, ranked: list[Measured], copy: Timing | None = None) -> TuneResult:
        """The result of a final round (`ranked`, not empty): the winner, the default's timing,
        the evaluator's counts and failures, the warm configs as measured; `copy`: the copy
        kernel's timing (`efficiency`)."""
        r, ev = self.req, self.ev
        final = {m.config: m for m in ranked}
        return TuneResult(r.op.name, r.problem, ranked[0], final.get(self.default()), copy, r.op.min_bytes(r.problem),
                          trials=len(ev.measured), pruned=ev.pruned, failures=ev.failures,
                          seconds=time.monotonic() - self.started,
                          warm=[ev.measured[c] for c in r.warm if c in ev.measured], finalists=ranked)

    def run(self) -> TuneResult:
        """search -> final round -> result; RuntimeError when no candidate passed verification."""
        ranked = self.final(self.search())
        if not ranked:
            raise RuntimeError(f"{self.req.op.name} {self.req.problem.key()}: no candidate passed verification; "
                               f"failures: {self.ev.failures[:3]}")
        return self.result(ranked)


def finalists(study: Any, default_cfg: Config, valid: set[Config], count: int = FINALISTS,
              also: tuple[Config, ...] = ()) -> list[Config]:
    """The `count` best distinct configs the study measured (earlier sessions included), then the
    default, then the valid configs of `also` (the dispatcher's pick: `tune_problem`): the final
    round's candidates."""
    import optuna

    best: dict[Config, float] = {}
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        cfg = Config.of(t.params)
        if cfg in valid and t.value is not None and math.isfinite(t.value):
            best[cfg] = min(t.value, best.get(cfg, math.inf))
    top = sorted(best, key=best.__getitem__)[:count]
    out = top + ([default_cfg] if default_cfg not in top else [])
    return out + [c for c in dict.fromkeys(also) if c in valid and c not in out]


def final_round(ev: Any, study: Any, default_cfg: Config, valid: set[Config], rounds: int = ROUNDS,
                count: int = FINALISTS, also: tuple[Config, ...] = ()) -> list[Measured]:
    """The winner is not one lucky timing: the study's best `count` configs, the default and
    `also` are re-timed fresh in this run (`ev.retime`: interleaved rounds), best median first.
    Failures go to `ev.failures`."""
    final, failed = ev.retime(finalists(study, default_cfg, valid, count, also), rounds)
    for cfg, why in failed.items():
        ev.failures.append((cfg.key(), why))
    return sorted(final.values(), key=lambda m: m.timing.median_us)


def dispatcher_pick(op: OpSpec, problem: Problem, target: Target) -> Config | None:
    """The config the process's dispatcher (`dispatch.dispatcher()`, its DB view reloaded when a
    DB changes) runs for `problem`: the tuned entry of the DB in use, else its untuned pick
    (`Dispatcher.select`: no cached choice, no untuned-choice message, no online tuning); None
    when it cannot say (the reason is logged). `tune_problem` and online tuning measure it first
    and re-time it in the final round, so a tune never ends on a config slower, in that run, than
    what the call ran before."""
    from ..runtime.dispatch import dispatcher

    try:
        return dispatcher().select(op, problem, target, 16)[0].config
    except Exception as e:  # noqa: BLE001 - optional: tuning goes on without it
        import logging

        logging.getLogger("ckgen.tuner.tune").warning("%s %s: no dispatcher pick to measure (%s: %s)",
                                                op.name, problem.key(), e.__class__.__name__, e)
        return None


def tune_problem(request: TuneRequest, info: DeviceInfo,
                 on_trial: Callable[[int, int, float], None] | None = None) -> TuneResult:
    """Tune one problem on the current GPU (`info`) and pick the winner: a `Tuner` run with the
    GPU objective (fresh random inputs), every measurement recorded (ckgen/model/records.py), the
    dispatcher's pick for the problem as the incumbent (`dispatcher_pick`) unless the request
    names one, and the copy kernel timed for the efficiency. `on_trial(done, total, best_us)`
    reports progress."""
    from ..model.records import Recorder

    t0 = time.monotonic()
    op, problem, target = request.op, request.problem, request.target
    timer = Timer(info.l2_bytes)
    obj = Objective(op, problem, target, Harness(op, problem, seed=None), timer)  # fresh random inputs every run
    if request.incumbent is None:
        request = replace(request, incumbent=dispatcher_pick(op, problem, target))
    record = Recorder(op, problem, target, info.name)  # every measurement is data (ckgen/model/records.py)
    result = Tuner(request, obj, record=record, on_trial=on_trial, started=t0).run()
    result.copy = timer.copy_time(op.min_bytes(problem))
    return result


def save_result(result: TuneResult, info: DeviceInfo, db_path: Any, prov: dict[str, Any] | None = None) -> Any:
    """A tuning result's DB entry (`db_entry`) saved to the DB at `db_path` (`db.save_entries`: a
    locked merge); returns the entry. db.DBError: a corrupt DB (the entry is kept in a side file)."""
    from ..runtime import db as dbmod

    entry = db_entry(result, info, prov)
    dbmod.save_entries(db_path, [entry])
    return entry


def provenance(result: TuneResult) -> dict[str, Any]:
    import cupy

    from .._version import __version__

    rt = cupy.cuda.runtime
    return {
        "ckgen": __version__,
        "cupy": cupy.__version__,
        "cuda_runtime": int(rt.runtimeGetVersion()),
        "cuda_driver": int(rt.driverGetVersion()),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "trials": result.trials,
        "tuning_seconds": round(result.seconds, 1),
    }


def db_entry(result: TuneResult, info: DeviceInfo, prov: dict[str, Any] | None = None) -> Any:
    """The instance-DB entry recording a tuning result (winner, timings, provenance: `prov`, else
    `provenance(result)`)."""
    from ..runtime.db import Entry

    return Entry(op=result.op, vendor=info.target.vendor, arch=info.target.arch, device=info.name,
                 problem=result.problem.key(), config=result.best.config.items,
                 instance=result.best.instance, source_sha256=result.best.sha256,
                 time_us=round(result.best.timing.median_us, 3), gbps=round(result.gbps, 1),
                 default_time_us=round(result.default.timing.median_us, 3) if result.default else -1.0,
                 spread=round(result.best.timing.spread, 4),
                 provenance=tuple(sorted((provenance(result) if prov is None else prov).items())))


@dataclass(frozen=True)
class RetuneItem:
    op: str
    problem: str
    from_arch: str
    config: Config  # the other arch's winner: the warm start, and the "before" on this GPU


def retune_plan(db: Any, arch: str, from_arch: str | None = None, ops: list[str] | None = None) -> list[RetuneItem]:
    """Every (op, problem) of the DB tuned on another arch and not yet on `arch`, with the winner
    of the nearest arch (same vendor first, then the closest arch number) as its warm start."""
    from ..types import Target

    here = Target.named(arch)

    def nearness(e: Any) -> tuple[int, int]:
        digits = "".join(ch for ch in e.arch if ch.isdigit()) or "0"
        mine = "".join(ch for ch in arch if ch.isdigit()) or "0"
        return (e.vendor != here.vendor, abs(int(digits) - int(mine)))

    items: dict[tuple[str, str], RetuneItem] = {}
    by_key: dict[tuple[str, str], list[Any]] = {}
    for e in db.entries:
        if e.arch == arch or (from_arch and e.arch != from_arch) or (ops and e.op not in ops):
            continue
        by_key.setdefault((e.op, e.problem), []).append(e)
    for (op, problem), entries in sorted(by_key.items()):
        if db.lookup(op, arch, problem) is not None:
            continue  # already tuned here
        best = min(entries, key=nearness)
        items[(op, problem)] = RetuneItem(op, problem, best.arch, Config.of(best.config_dict()))
    return list(items.values())
