"""`ckgen tune --workers N|auto`: several worker processes, one per GPU, tuning one problem list
from one optuna storage; the same command on another machine with the same PostgreSQL URL joins.

- **A run** is what one command line starts (its op, problems, budgets, sampler and seed, per
  device kind): a record in the storage (a study named `ckgen-run|...`, user attr `current`) holds
  its id, its deadline (`--total-timeout`) and the launch that made it. A worker of the same
  command joins the open run of its device; a worker of the very launch that made the run joins
  it however late it starts (past the deadline, or after the others closed it: it then finds
  nothing left to do). A run is closed when every problem is done, and the same command after
  that starts a new one (another `--trials` per problem, as a second `ckgen tune` does). A run
  whose workers all died stays open: the same command finishes it.
- **A problem is a study** (`tune.study_name`), shared by every worker on that device kind. Trials
  of the run carry the user attrs `run` and `worker`. The budget is the run's, not a worker's:
  `--trials` trials per problem in all (running, complete, or failed for a reason; a trial lost
  with its worker does not count), `--timeout` seconds per problem from its first trial,
  `--total-timeout` for the run. `_RunBudget.allow` checks it under the study's propose lock
  (a file lock on SQLite, an advisory lock on PostgreSQL: `tune.claim_lock`) before each
  proposal, so workers never overshoot it and never propose one config twice.
- **A worker** scans the problems, works on the one with budget left and the fewest trials
  running (so workers spread out, and gather on the last big problems), and when a problem's budget
  is spent and none of its trials runs, one worker claims it (a beat every HEARTBEAT_S, so a
  claim of a dead worker lapses after GRACE_S) and runs the final round (`tune.final_round`), writes
  the winner to its machine's DB (the locked merge) and stores the result in the study
  (`ckgen:<run>:result`, read by the final table and by `ckgen db pull`).
- **A worker killed** (SIGKILL, a GPU fault) loses its running trials only: their heartbeats stop,
  the next scan after GRACE_S fails them (`optuna.storages.fail_stale_trials`), and their configs
  are proposed again; what finished is never measured again (every trial holds a distinct config).
- **Backends**: `GpuBackend` measures on the GPU the process sees (CUDA_VISIBLE_DEVICES pins it);
  `ckgen.tuner.replay.ReplayBackend` answers from recorded or synthetic times (the tests).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from ..ops import get_op
from ..ops.spec import OpSpec, Problem
from ..runtime.bench import Timing
from ..runtime.compile import pool_closed as compile_pool_closed
from ..runtime.compile import share_cpus as compile_share_cpus
from ..types import Config
from . import tune

RUN_PREFIX = "ckgen-run|"
RUN_ATTR, WORKER_ATTR = "run", "worker"  # trial user attrs
SEARCH, WAIT, FINALIZE, DONE = "search", "wait", "finalize", "done"
STORAGE_EXIT = 3  # a worker's exit code when the study storage failed it


def backend_factory() -> Callable[[], Any]:
    """The backend the CLI's workers measure with (the tests replace it)."""
    return GpuBackend


def visible_devices() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES values: the ones it names, else
    0..count-1 (CuPy's count; none without a GPU)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [d.strip() for d in env.split(",") if d.strip()]
    try:
        import cupy

        return [str(i) for i in range(cupy.cuda.runtime.getDeviceCount())]
    except Exception:  # noqa: BLE001 - no CuPy, no driver: no GPU
        return []


@dataclass(frozen=True)
class RunSpec:
    """What a command line asks of its workers (picklable: handed to spawned processes)."""

    op: str
    problems: tuple[str, ...]  # problem keys
    trials: int
    storage: str
    timeout: float | None = None
    total_timeout: float | None = None
    seed: int = 0
    sampler: str | None = None
    db: str | None = None  # the user DB the winners go to (None: none)
    ahead: int = tune.AHEAD
    rounds: int = tune.ROUNDS
    backend: Callable[[], Any] = field(default=None)  # type: ignore[assignment]
    poll_s: float = 2.0  # how often an idle worker looks again
    heartbeat_s: float | None = None  # tune.HEARTBEAT_S / GRACE_S in the workers (tests shorten them)
    grace_s: float | None = None
    # This command's launch (`launched`, by run_workers): its workers join the run it made however
    # late each starts. Not part of the digest: the same command on another machine joins too.
    launch: str = ""

    def digest(self) -> str:
        """Names the command: the same command on another machine joins the same run."""
        what = json.dumps([self.op, sorted(self.problems), self.trials, self.timeout, self.total_timeout,
                           self.sampler, self.seed], sort_keys=True)
        return hashlib.blake2b(what.encode(), digest_size=6).hexdigest()


def launched(spec: RunSpec) -> RunSpec:
    """`spec` for one launch of its command (a fresh `launch` id): what run_workers hands its
    workers."""
    return dataclasses.replace(spec, launch=uuid.uuid4().hex[:12])


# ------------------------------------------------------------------------------------ backends


class GpuBackend:
    """Measures on the GPU this process sees (device 0 after CUDA_VISIBLE_DEVICES pinning)."""

    def __init__(self) -> None:
        from ..runtime.target import device_info

        self.info = device_info(None)

    def evaluator(self, op: OpSpec, problem: Problem) -> Any:
        from ..runtime.bench import Timer
        from ..runtime.verify import Harness

        return tune.Objective(op, problem, self.info.target, Harness(op, problem, seed=None),
                              Timer(self.info.l2_bytes))

    def restrict(self, op: OpSpec, problem: Problem) -> Callable[[Config], bool] | None:
        return None

    def recorder(self, op: OpSpec, problem: Problem) -> Callable[..., None] | None:
        from ..model.records import Recorder

        return Recorder(op, problem, self.info.target, self.info.name)

    def model_seeds(self, op: OpSpec, problem: Problem, trials: int) -> tuple[Config, ...]:
        return tune.model_picks(op, problem, self.info.target, trials)

    def model(self) -> Any:
        """The cost model the sampler's prior mean comes from (`tune.TuneRequest.model`)."""
        from .. import model as cm

        return cm.load()

    def copy(self, op: OpSpec, problem: Problem) -> Timing:
        from ..runtime.bench import Timer

        return Timer(self.info.l2_bytes).copy_time(op.min_bytes(problem))

    def provenance(self, result: tune.TuneResult) -> dict[str, Any]:
        return tune.provenance(result)


# ------------------------------------------------------------------------------ the run's state


def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _key(run_id: str, what: str) -> str:
    return f"ckgen:{run_id}:{what}"


def run_study_name(spec: RunSpec, arch: str, device: str) -> str:
    return f"{RUN_PREFIX}{spec.op}|{arch}|{device}|{spec.digest()}"


def _counted(t: Any) -> bool:
    """Does this trial spend budget: running, complete, or failed for a reason (compile, launch,
    wrong result)? A trial lost with its worker, cancelled or dropped does not."""
    from optuna.trial import TrialState

    from .sampler import FAILURE_ATTR

    return t.state in (TrialState.RUNNING, TrialState.COMPLETE) or \
        (t.state == TrialState.FAIL and FAILURE_ATTR in t.user_attrs)


@dataclass
class _Problem:
    problem: Problem
    name: str  # the study's
    names: list[str]
    restrict: Callable[[Config], bool] | None = None  # the backend's (`_Worker.valid`)
    study: Any = None
    # Made when first needed, dropped when the problem is done (`_Worker.done`): the valid configs
    # take a second or more of CPU per problem (groupnorm_bwd: 31k configs validated), an evaluator
    # its problem's inputs and float64 reference; made up front for every problem, they delayed
    # a worker's first trial by seconds per problem, and the final round made the search's again.
    valid: list[Config] | None = None
    index: frozenset[Config] | None = None
    ev: Any = None  # the evaluator of this worker's search, reused by its final round


class _RunBudget:
    """`tune.Tuner`'s `run` hook: the run's budget for one problem, shared by all workers."""

    def __init__(self, worker: "_Worker", p: _Problem):
        self.w, self.p = worker, p
        self.study: Any = None
        # the run's trials on this problem as the last `allow` read them (finished, best time), and
        # how many this search had finished then: `progress` adds the ones finished here since,
        # rather than reading every trial from the storage again after each trial
        self.seen: tuple[int, float] = (0, math.inf)
        self.local = self.seen_local = 0

    def allow(self, study: Any) -> bool:  # under the study's propose lock
        self.study = study
        w, attrs = self.w, study.user_attrs
        if _key(w.run_id, "result") in attrs:
            return False
        start = attrs.get(_key(w.run_id, "start"))
        if start is None:
            start = time.time()
            study.set_user_attr(_key(w.run_id, "start"), start)
        if w.left(start) <= 0:
            return False
        mine = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(RUN_ATTR) == w.run_id]
        self.seen, self.seen_local = _finished(mine), self.local
        return sum(_counted(t) for t in mine) < w.spec.trials

    def tag(self, trial: Any) -> None:  # still under the lock
        trial.set_user_attr(RUN_ATTR, self.w.run_id)
        trial.set_user_attr(WORKER_ATTR, self.w.wid)

    def progress(self, done: int, best: float) -> tuple[int, float]:
        """(trials of the run finished on this problem, best time of the run's), given this search's
        (`done` trials finished, `best` time): the last `allow`'s reading and what finished here
        since (exact with one worker; the others' since then show at the next reading)."""
        self.local = done
        return self.seen[0] + done - self.seen_local, min(self.seen[1], best)


def _finished(trials: list[Any]) -> tuple[int, float]:
    """(how many of `trials` are finished and spent budget, the best time among them)."""
    from optuna.trial import TrialState

    done = sum(_counted(t) and t.state != TrialState.RUNNING for t in trials)
    best = min((t.value for t in trials if t.state == TrialState.COMPLETE and t.value is not None), default=math.inf)
    return done, best


class _Worker:
    def __init__(self, index: int, spec: RunSpec, backend: Any, emit: Callable[..., None]):
        import optuna

        self.index, self.spec, self.backend, self.emit = index, spec, backend, emit
        self.op = get_op(spec.op)
        self.info = backend.info
        self.target = self.info.target
        self.host = socket.gethostname()
        self.wid = f"{self.host}:{os.getpid()}"
        self.storage = tune.open_storage(spec.storage)
        self.optuna = optuna
        self.problems: dict[str, _Problem] = {}
        self.done: set[str] = set()  # problems found DONE for this run: they stay so, never read again
        for key in spec.problems:
            problem = self.op.problem_from_key(key)
            restrict = backend.restrict(self.op, problem)
            # the first valid config, not all of them (`valid`): a problem with none is reported
            if not any(self.op.validate(problem, c, self.target) and (restrict is None or restrict(c))
                       for c in self.op.space.enumerate()):
                emit("skip", key, f"{self.op.name} {problem.key()}: no config of the space is valid for this problem")
                continue
            self.problems[key] = _Problem(problem, tune.study_name(self.op, problem, self.target, self.info.name),
                                          list(self.op.space.params), restrict)
        self.run_id, self.deadline = self._join()

    def valid(self, p: _Problem) -> list[Config]:
        """Problem `p`'s valid configs (those the backend's restrict accepts), made once."""
        if p.valid is None:
            p.valid = tune.valid_space(self.op, p.problem, self.target, p.restrict)
            p.index = frozenset(p.valid)
        return p.valid

    def _index(self, p: _Problem) -> frozenset[Config]:
        self.valid(p)
        assert p.index is not None
        return p.index

    # -- the run record
    def _lock(self, name: str) -> Any:
        return tune.claim_lock(self.spec.storage, name)

    def _join(self) -> tuple[str, float | None]:
        name = run_study_name(self.spec, self.target.arch, self.info.name)
        study = self.optuna.create_study(study_name=name, storage=self.storage, load_if_exists=True)
        with self._lock(name):
            cur = study.user_attrs.get("current")
            now = time.time()
            if cur and self.spec.launch and cur.get("launch") == self.spec.launch:
                # made by this worker's own command: joined however late this worker starts (a
                # loaded machine, a slow GPU init), even past its deadline or closed: the run
                # left finds nothing to do, where a new run would tune everything again
                return cur["id"], cur.get("deadline")
            if cur and not cur.get("closed") and (cur.get("deadline") is None or now < cur["deadline"]):
                return cur["id"], cur.get("deadline")
            new = {"id": uuid.uuid4().hex[:12], "created": now, "closed": False,
                   "deadline": now + self.spec.total_timeout if self.spec.total_timeout else None,
                   "problems": len(self.spec.problems), "trials": self.spec.trials, "launch": self.spec.launch}
            study.set_user_attr("current", new)
            return new["id"], new["deadline"]

    def _close(self) -> None:
        name = run_study_name(self.spec, self.target.arch, self.info.name)
        study = self.optuna.load_study(study_name=name, storage=self.storage)
        with self._lock(name):
            cur = study.user_attrs.get("current")
            if cur and cur.get("id") == self.run_id and not cur.get("closed"):
                study.set_user_attr("current", {**cur, "closed": True, "closed_at": time.time()})

    def left(self, start: float | None) -> float:
        """Seconds left to this problem (from its `start`) and to the run."""
        now = time.time()
        ends = [e for e in (self.deadline, None if self.spec.timeout is None or start is None
                            else start + self.spec.timeout) if e is not None]
        return min(ends) - now if ends else math.inf

    def _study(self, p: _Problem) -> Any:
        if p.study is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                p.study = self.optuna.create_study(study_name=p.name, storage=self.storage, load_if_exists=True,
                                                   direction="minimize",
                                                   sampler=self.optuna.samplers.RandomSampler(0))
        return p.study

    # -- a problem's state
    def _state(self, p: _Problem) -> tuple[str, int]:
        """(SEARCH | WAIT | FINALIZE | DONE, trials of the run running) for problem `p`."""
        from optuna.trial import TrialState

        from .sampler import config_of, settled

        key = key_of(p)
        if key in self.done:
            return DONE, 0
        study = self._study(p)
        attrs = study.user_attrs
        if _key(self.run_id, "result") in attrs:
            return self._done(p)
        trials = study.get_trials(deepcopy=False)
        mine = [t for t in trials if t.user_attrs.get(RUN_ATTR) == self.run_id]
        running = sum(t.state == TrialState.RUNNING for t in mine)
        start = attrs.get(_key(self.run_id, "start"))
        expired = self.left(start) <= 0
        held = {c for t in trials if t.state != TrialState.WAITING and settled(t)
                and (c := config_of(t, p.names)) is not None}
        # every valid config held? (nothing held: no, without making the valid set)
        room = not held or len(held & self._index(p)) < len(self._index(p))
        if not expired and sum(_counted(t) for t in mine) < self.spec.trials and room:
            return SEARCH, running
        if running:
            return WAIT, running
        if expired and start is None:
            return self._done(p)  # the time ran out before it began: not tuned
        claim = attrs.get(_key(self.run_id, "final"))
        if claim and time.time() - claim.get("beat", 0) < tune.GRACE_S and claim.get("worker") != self.wid:
            return WAIT, 0
        return FINALIZE, 0

    def _done(self, p: _Problem) -> tuple[str, int]:
        """`p` is done for this run (its result is stored, or its time ran out before it began),
        for good: it is not read again, and what was made for it is let go."""
        self.done.add(key_of(p))
        p.valid = p.index = p.ev = None
        return DONE, 0

    def run(self) -> None:
        keys = list(self.problems)
        n = len(keys)
        # Start spread out: worker i first looks at the problems from i * n / workers on.
        offset = (self.index * n) // max(1, self.spec_workers) if n else 0
        order = keys[offset:] + keys[:offset]
        while True:
            states: dict[str, tuple[str, int]] = {}
            for key in order:
                p = self.problems[key]
                if key not in self.done:
                    self.optuna.storages.fail_stale_trials(self._study(p))  # a dead worker's trials: proposable again
                states[key] = self._state(p)
            if all(s == DONE for s, _ in states.values()):
                self._close()
                return
            todo = [k for k in order if states[k][0] == FINALIZE]
            if todo and self._finalize(self.problems[todo[0]]):
                continue
            search = [k for k in order if states[k][0] == SEARCH]
            if search:
                key = min(search, key=lambda k: states[k][1])  # fewest trials running: spread out
                self._search(self.problems[key])
                continue
            time.sleep(self.spec.poll_s)

    spec_workers = 1  # set by worker_main: how many workers this machine runs

    # -- the search and the final round: a tune.Tuner; the worker adds the claims and the reports
    def _request(self, p: _Problem, **fields: Any) -> tune.TuneRequest:
        """Problem `p`'s request: the run's settings on this worker's device kind and storage."""
        spec = self.spec
        # `trials`: the run's budget per problem, which the run hook holds the run to, and which
        # sizes the seeds as it does for `ckgen tune --trials` (`tune.n_seeds`)
        return tune.TuneRequest.on(self.op, p.problem, self.info, trials=spec.trials, storage=self.storage,
                                   seed=spec.seed, sampler=spec.sampler, ahead=spec.ahead, rounds=spec.rounds,
                                   restrict=p.restrict, **fields)

    def _search(self, p: _Problem) -> None:
        study = self._study(p)
        start = study.user_attrs.get(_key(self.run_id, "start"))
        left = self.left(start if start is not None else time.time())
        if left <= 0:
            return
        hook = _RunBudget(self, p)
        if p.ev is None:
            p.ev = self.backend.evaluator(self.op, p.problem)
        key = p.problem.key()
        self.emit("problem", key, self.spec.trials)

        def on_trial(done: int, total: int, best: float) -> None:
            run_done, run_best = hook.progress(done, best)
            self.emit("trial", key, run_done, self.spec.trials, run_best, done)

        request = self._request(p, timeout=None if math.isinf(left) else left,
                                picks=self.backend.model_seeds(self.op, p.problem, self.spec.trials),
                                model=self.backend.model())
        tune.Tuner(request, p.ev, record=self.backend.recorder(self.op, p.problem), on_trial=on_trial, run=hook,
                   valid=self.valid(p)).search()

    def _claim(self, p: _Problem) -> bool:
        with self._lock(p.name):
            if self._state(p)[0] != FINALIZE:
                return False
            self._study(p).set_user_attr(_key(self.run_id, "final"), {"worker": self.wid, "beat": time.time()})
            return True

    def _finalize(self, p: _Problem) -> bool:
        """Claim problem `p`'s final round; run it, write the winner. False: another worker has it."""
        if not self._claim(p):
            return False
        study, key = self._study(p), p.problem.key()

        def beat(_: Any) -> None:  # the claim lapses GRACE_S after the last beat
            study.set_user_attr(_key(self.run_id, "final"), {"worker": self.wid, "beat": time.time()})

        with tune.Heartbeat(beat) as claim:
            claim.add("final", now=False)  # `_claim` just wrote it
            result = self._final_round(p, study)
        study.set_user_attr(_key(self.run_id, "result"), result)
        self.emit("result", key, result)
        return True

    def _final_round(self, p: _Problem, study: Any) -> dict[str, Any]:
        from optuna.trial import TrialState

        from .sampler import FAILURE_ATTR

        op, problem = self.op, p.problem
        trials = study.get_trials(deepcopy=False)
        mine = [t for t in trials if t.user_attrs.get(RUN_ATTR) == self.run_id]
        measured = [t for t in mine if _counted(t) and t.state != TrialState.RUNNING]
        failures = [(Config.of(t.params).key(), t.user_attrs[FAILURE_ATTR]) for t in measured
                    if t.state == TrialState.FAIL and set(t.params) == set(p.names)]
        workers = sorted({t.user_attrs.get(WORKER_ATTR, "") for t in measured} - {""})
        start = study.user_attrs.get(_key(self.run_id, "start"))
        # this worker's search's evaluator if it searched the problem (its inputs, reference and
        # verified kernels: one `ckgen tune` reuses them too), else a new one
        ev, p.ev = p.ev or self.backend.evaluator(op, problem), None
        before = len(ev.failures)  # the search's are in `failures` already (from the study)
        base = {"worker": self.wid, "host": self.host, "trials": len(measured), "failed": len(failures),
                "workers": workers, "date": _now_iso()}
        tuner = tune.Tuner(self._request(p, model=None, picks=()), ev, record=self.backend.recorder(op, problem),
                           valid=self.valid(p))
        ranked = tuner.final(study)
        failures += ev.failures[before:]
        if not ranked:
            why = f"no candidate passed verification; failures: {failures[:3]}"
            self.emit("error", key_of(p), why)
            return {**base, "error": why}
        seconds = time.time() - start if start is not None else 0.0
        r = dataclasses.replace(tuner.result(ranked, self.backend.copy(op, problem)), trials=len(measured), pruned=0,
                                failures=failures, seconds=seconds)
        prov = {**self.backend.provenance(r), "host": self.host, "worker": self.wid, "workers": len(workers),
                "run": self.run_id}
        entry = tune.db_entry(r, self.info, prov)
        saved = None
        if self.spec.db:
            from ..runtime import db as dbmod

            try:
                dbmod.save_entries(self.spec.db, [entry])
                saved = self.spec.db
            except dbmod.DBError as e:  # a corrupt DB: the entry is kept in a side file (e.kept)
                self.emit("error", problem.key(), str(e))
        speedup = r.speedup_vs_default
        return {**base, "entry": entry.to_dict(), "instance": r.best.instance, "time_us": r.best.timing.median_us,
                "spread": r.best.timing.spread, "gbps": r.gbps, "efficiency": r.efficiency,
                "speedup_vs_default": None if math.isnan(speedup) else speedup, "db": saved}


def key_of(p: _Problem) -> str:
    return p.problem.key()


# ------------------------------------------------------------------------- processes and events


def worker_main(index: int, spec: RunSpec, events: Any, workers: int = 1) -> None:
    """A worker process: measures with `spec.backend()`, reports to `events` (the write end of a
    pipe of its own) as (kind, worker index, ...) tuples: hello, problem, trial, result, skip,
    error, bye. Not a multiprocessing.Queue shared by the workers: its feeder threads share a
    lock, and a worker killed while holding it would leave the others hanging at exit.

    The compile pool the work started is shut down before "bye", however the work ended: a
    multiprocessing child leaves through os._exit, never running atexit, and multiprocessing's
    exit joins the pool's processes, which wait for work forever (`compile.pool`)."""
    lock = threading.Lock()

    def emit(kind: str, *rest: Any) -> None:
        with lock:
            events.send((kind, index, *rest))

    code = 0
    try:
        with compile_pool_closed():
            _work(index, spec, emit, workers)
        emit("bye")
    except tune.StudyStorageError as e:
        code = STORAGE_EXIT
        _report(emit, str(e))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which says which worker
        code = 1
        _report(emit, f"{e.__class__.__name__}: {e}\n{traceback.format_exc(limit=6)}")
    finally:
        events.close()  # the parent sees EOF now, not when the process is reaped
    if code:
        sys.exit(code)


def _report(emit: Callable[..., None], why: str) -> None:
    try:
        emit("error", None, why)
    except OSError:  # the parent is gone (its pipe broke): nobody to tell
        pass


def _work(index: int, spec: RunSpec, emit: Callable[..., None], workers: int) -> None:
    if spec.heartbeat_s is not None:
        tune.HEARTBEAT_S = spec.heartbeat_s
    if spec.grace_s is not None:
        tune.GRACE_S = spec.grace_s
    compile_share_cpus(workers)  # the workers of this machine share its CPUs for compiling
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage")
    backend = (spec.backend or GpuBackend)()
    w = _Worker(index, spec, backend, emit)
    w.spec_workers = workers
    emit("hello", w.info.name, w.target.arch, w.host, os.getpid(), w.run_id,
         os.environ.get("CUDA_VISIBLE_DEVICES"))
    w.run()


# A worker that finished (said "bye", or closed its pipe) and has not exited this many seconds later
# is stopped (SIGTERM, then SIGKILL) and reported: its work is done and stored, and nothing it
# could still be doing is worth the run never ending (the exit of a worker whose compile pool was
# left running never came: `worker_main`).
EXIT_GRACE_S = 30.0
KILL_AFTER_S = 10.0  # after SIGTERM, before SIGKILL
# A worker silent this long (no trial, result or other event) is reported, and again each time as
# long: it may be in a long final round or compile, so it is not stopped.
QUIET_S = 600.0


@dataclass
class WorkerInfo:
    index: int
    device: str = ""  # CUDA_VISIBLE_DEVICES it was given ("" none)
    name: str = ""  # the GPU's name
    arch: str = ""
    host: str = ""
    pid: int = 0
    run_id: str = ""
    exitcode: int | None = None
    error: str | None = None
    finished: bool = False  # it said "bye": its work ended normally


@dataclass
class RunReport:
    workers: list[WorkerInfo]
    results: dict[tuple[str, str], dict[str, Any]]  # (device name, problem key) -> result
    seconds: float

    @property
    def died(self) -> list[WorkerInfo]:
        return [w for w in self.workers if w.exitcode not in (0, None)]


def exit_reason(code: int) -> str:
    """A worker's exit code in words: 'signal 9 (SIGKILL)', 'exit code 1'."""
    if code < 0:
        import signal

        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def run_workers(spec: RunSpec, workers: int, devices: list[str] | None = None,
                on_event: Callable[..., None] | None = None, poll: float = 0.2,
                exit_grace: float = EXIT_GRACE_S, quiet: float = QUIET_S) -> RunReport:
    """Start `workers` processes (spawned; worker i pinned to devices[i % len(devices)] through
    CUDA_VISIBLE_DEVICES when devices are given), pass their events to `on_event(event, procs)`
    until every one has exited, then read every problem's result from the storage.

    Events beside the workers' own: ("exit", i, exit code) when worker i has exited (a negative
    code: the signal that killed it); ("stuck", i, seconds) when it finished but had not exited
    `exit_grace` seconds later, and is stopped; ("quiet", i, seconds) when it has sent nothing for
    that long (every `quiet` seconds). The parent never waits on a worker without a bound: a
    dead worker is seen by its pipe's EOF and its exit, a stuck one is stopped."""
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    spec = spec if spec.launch else launched(spec)  # its workers join one run, whenever each starts
    infos = [WorkerInfo(i, devices[i % len(devices)] if devices else "") for i in range(workers)]
    procs, readers = [], {}
    t0 = time.monotonic()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for info in infos:
            if info.device:
                os.environ["CUDA_VISIBLE_DEVICES"] = info.device  # a spawned child starts with this env
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, args=(info.index, spec, w, workers), daemon=False)
            p.start()
            w.close()  # the child holds the write end: EOF here when it closes it, exits or is killed
            procs.append(p)
            readers[r] = info.index
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved

    heard = [time.monotonic()] * workers  # when each last sent an event
    ended: dict[int, float] = {}  # worker -> when it said bye or closed its pipe
    stopped: dict[int, float] = {}  # worker -> when it was sent SIGTERM

    def tell(ev: tuple[Any, ...]) -> None:
        if on_event is not None:
            on_event(ev, procs)

    def handle(ev: tuple[Any, ...]) -> None:
        kind, i = ev[0], ev[1]
        heard[i] = time.monotonic()
        if kind == "hello":
            infos[i].name, infos[i].arch, infos[i].host, infos[i].pid, infos[i].run_id = ev[2:7]
        elif kind == "error" and ev[2] is None:
            infos[i].error = ev[3]
        elif kind == "bye":
            infos[i].finished = True
            ended.setdefault(i, time.monotonic())
        tell(ev)

    def exits() -> None:
        for info, p in zip(infos, procs):
            if info.exitcode is None and p.exitcode is not None:
                info.exitcode = p.exitcode
                if p.exitcode != 0 and info.error is None and info.index not in stopped:
                    info.error = f"died ({exit_reason(p.exitcode)})" + ("" if info.finished else " before it finished")
                tell(("exit", info.index, p.exitcode))

    def watch() -> None:
        """Stop a worker that finished but does not exit; report one that is silent."""
        now = time.monotonic()
        for info, p in zip(infos, procs):
            i = info.index
            if info.exitcode is not None or p.exitcode is not None:
                continue
            if i in stopped:
                if now - stopped[i] > KILL_AFTER_S:
                    p.kill()
            elif i in ended and now - ended[i] > exit_grace:
                info.error = (f"finished, but had not exited {exit_grace:.0f} s later: stopped "
                              "(its results are stored; a process it started may have kept it alive)")
                stopped[i] = now
                tell(("stuck", i, now - ended[i]))
                p.terminate()
            elif i not in ended and now - heard[i] > quiet:
                tell(("quiet", i, now - heard[i]))
                heard[i] = now  # again after as long

    try:
        while readers or any(p.exitcode is None for p in procs):
            # the pipes, and the exit of every worker still running (a worker can exit with its
            # pipe still open only if something it started holds the pipe: its exit wakes us too)
            sentinels = {p.sentinel: p for p in procs if p.exitcode is None}
            for r in wait(list(readers) + list(sentinels), timeout=poll):
                if r in sentinels:
                    continue
                try:
                    ev = r.recv()
                except (EOFError, OSError):  # closed; a message cut by a kill is dropped
                    ended.setdefault(readers.pop(r), time.monotonic())
                    r.close()
                    continue
                handle(ev)
            exits()
            for r, i in list(readers.items()):  # a worker gone with its pipe held open elsewhere
                if procs[i].exitcode is not None and not r.poll():
                    del readers[r]
                    r.close()
            watch()
        for p in procs:
            p.join()
        exits()
    except BaseException:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join(timeout=KILL_AFTER_S)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=KILL_AFTER_S)
        raise
    results: dict[tuple[str, str], dict[str, Any]] = {}
    seen = {(w.name, w.arch, w.run_id) for w in infos if w.run_id}
    for name, arch, run_id in sorted(seen):
        results.update({(name, k): v for k, v in read_results(spec, arch, name, run_id).items()})
    return RunReport(infos, results, time.monotonic() - t0)


def read_results(spec: RunSpec, arch: str, device: str, run_id: str) -> dict[str, dict[str, Any]]:
    """problem key -> the run's result for each problem of `spec` on this device kind (what the
    final round stored: the winner's entry and the table's values, or an error)."""
    import optuna

    from ..types import Target

    storage = tune.open_storage(spec.storage)
    op, target = get_op(spec.op), Target.named(arch)
    known = set(optuna.get_all_study_names(storage))
    out = {}
    for key in spec.problems:
        problem = op.problem_from_key(key)
        name = tune.study_name(op, problem, target, device)
        if name not in known:
            continue
        attrs = storage.get_study_user_attrs(storage.get_study_id_from_name(name))
        result = attrs.get(_key(run_id, "result"))
        if result is not None:
            out[problem.key()] = result
    return out


def parse_workers(text: str) -> int | str:
    """`--workers`: a positive integer or `auto`."""
    if text == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"expected a positive integer or 'auto', got {text!r}") from None
    if n < 1:
        raise ValueError(f"must be a positive integer or 'auto', got {n}")
    return n




# ------------------------------------------------------------------------------------ db pull


@dataclass
class Pulled:
    entries: list[Any]  # db.Entry, one per study with a verified winner
    skipped: list[str]  # "study name: why"


def pull_entries(url: str) -> Pulled:
    """DB entries from the finished studies of a storage (`ckgen db pull`): per study of today's
    templates, the winner of its latest final round (`ckgen tune --workers`) if it has one, else its
    best complete trial (every complete trial passed verification). Provenance: the device (in the
    entry's target), the worker's host, the trials, the date. Running trials whose heartbeats
    stopped for tune.GRACE_S (a tune cut short) are failed first (optuna's fail_stale_trials).
    Studies with trials still running (live), without trials, of other template versions, or of
    unknown ops are skipped, with the reason; so is a study whose data cannot make an entry (one
    study's bad data never stops the pull)."""
    import optuna

    from ..codegen import templates_digest

    from .storage_url import sqlite_path

    path = sqlite_path(url)
    if path is not None:  # read, never created nor given optuna's tables
        why = tune.sqlite_storage_problem(path) if path.is_file() else f"no study storage at {path}"
        if why:
            raise tune.StudyStorageError(why)
    # so a SQLite file holds optuna's schema: opened without the schema lock, leaving no lock file
    storage = tune.open_storage(url, existing=True)
    digest = templates_digest()[:12]
    out = Pulled([], [])
    for name in sorted(optuna.get_all_study_names(storage)):
        if name.startswith(RUN_PREFIX):
            continue
        try:
            entry = _pull_study(storage, name, digest, out.skipped)
        except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as e:  # DBError is a ValueError
            out.skipped.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
            continue
        if entry is not None:
            out.entries.append(entry)
    return out


def _pull_study(storage: Any, name: str, digest: str, skipped: list[str]) -> Any:
    """The DB entry of one study for `pull_entries`, or None with the reason in `skipped`."""
    from optuna.trial import TrialState

    from .._version import __version__
    from ..runtime.bench import gbps
    from ..runtime.db import DBError, Entry
    from ..instance import render_instance
    from .sampler import FAILURE_ATTR
    from ..types import Target

    parts = name.split("|")
    if len(parts) != 5:
        skipped.append(f"{name}: not a ckgen study")
        return None
    op_name, arch, device, key, dg = parts
    if dg != digest:
        skipped.append(f"{name}: tuned with other templates (digest {dg}, today {digest})")
        return None
    try:
        op, target = get_op(op_name), Target.named(arch)
        problem = op.problem_from_key(key)
    except (ValueError, TypeError, KeyError) as e:
        skipped.append(f"{name}: {e}")
        return None
    study_id = storage.get_study_id_from_name(name)
    trials = storage.get_all_trials(study_id, deepcopy=False)
    if any(t.state == TrialState.RUNNING for t in trials):
        # A tune cut short (Ctrl-C, a crash) leaves RUNNING trials whose heartbeats stop: failed
        # as a tuner of the study would fail them (their configs are enqueued again), so the
        # study is pulled now rather than after the same tune ran again.
        import optuna

        with warnings.catch_warnings():  # fail_stale_trials is "experimental" in optuna's words
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(optuna.load_study(study_name=name, storage=storage))
        trials = storage.get_all_trials(study_id, deepcopy=False)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        if running:
            skipped.append(f"{name}: {running} trial(s) still running (their heartbeats are fresh: a tune at "
                           "work); pull again when it ends")
            return None
    if not trials:
        skipped.append(f"{name}: no trials yet")
        return None
    attrs = storage.get_study_user_attrs(study_id)
    finals = [v for k, v in attrs.items() if k.startswith("ckgen:") and k.endswith(":result")
              and isinstance(v, dict) and "entry" in v]
    if finals:
        # the latest by its ISO date; a date of another type (not written by ckgen) sorts first
        latest = max(finals, key=lambda v: (isinstance(v.get("date"), str), str(v.get("date"))))
        try:
            got = Entry.from_dict(latest["entry"])
            if got.ident != (op.name, target.arch, problem.key()):
                raise DBError(f"it is for {' '.join(got.ident)}, not for this study's problem")
            return got
        except DBError as e:
            skipped.append(f"{name}: its final result is not a DB entry ({e}); using its best trial")
    names = list(op.space.params)
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None
                and math.isfinite(t.value) and set(t.params) == set(names)]
    usable = [t for t in complete if op.validate(problem, Config.of(t.params), target)]
    if not usable:
        skipped.append(f"{name}: no complete trial valid today")
        return None
    best = min(usable, key=lambda t: (t.value, t.number))
    cfg = Config.of(best.params)
    src = render_instance(op, problem, cfg, target)
    default = op.space.nearest_default(lambda c: bool(op.validate(problem, c, target)))
    default_us = min((t.value for t in usable if Config.of(t.params) == default), default=-1.0)
    measured = [t for t in trials if t.state == TrialState.COMPLETE or
                (t.state == TrialState.FAIL and FAILURE_ATTR in t.user_attrs)]
    worker = str(best.user_attrs.get(WORKER_ATTR, ""))
    when = best.datetime_complete or best.datetime_start
    prov: dict[str, Any] = {"ckgen": __version__, "source": "db pull", "trials": len(measured),
                            "study": name}
    if when is not None:
        prov["date"] = when.astimezone(_dt.timezone.utc).isoformat(timespec="seconds")
    if worker:
        prov["host"], prov["worker"] = worker.rsplit(":", 1)[0], worker
    spread = best.user_attrs.get("spread")
    if isinstance(spread, bool) or not isinstance(spread, (int, float)) or not math.isfinite(spread):
        spread = None  # not recorded, or not a measure (the entry's other fields still are)
    return Entry(
        op=op.name, vendor=target.vendor, arch=target.arch, device=device, problem=problem.key(),
        config=cfg.items, instance=src.name, source_sha256=src.sha256, time_us=round(best.value, 3),
        gbps=round(gbps(op.min_bytes(problem), best.value), 1), default_time_us=round(default_us, 3),
        spread=spread, provenance=tuple(sorted(prov.items())))
