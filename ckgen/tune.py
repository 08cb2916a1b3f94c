"""One optuna study per problem: TPE, seeded with the default config, invalid configs pruned
with their reason before any compile, wrong or failing candidates recorded as failed trials,
budgets in trials and seconds, resumable from optuna storage (SQLite under the cache dir)."""
from __future__ import annotations

import datetime as _dt
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .bench import Timer, Timing, gbps
from .compile import CompileError, compile_many
from .instance import render_instance
from .ops.spec import Config, OpSpec, Problem, Target
from .target import DeviceInfo
from .verify import Harness

# A trial the sampler proposed whose config the op rejects costs no compile; still, stop
# a study that proposes almost nothing valid.
MAX_PRUNED_PER_TRIAL = 50


class TrialFailed(Exception):
    """A candidate that failed to compile, launch, or verify: recorded, never a winner."""


@dataclass
class Measured:
    config: Config
    instance: str
    sha256: str
    timing: Timing


@dataclass
class TuneResult:
    op: str
    problem: Problem
    best: Measured
    default: Measured | None
    copy: Timing
    min_bytes: int
    trials: int
    pruned: int
    failures: list[tuple[str, str]] = field(default_factory=list)  # (config key, reason)
    seconds: float = 0.0
    warm: list[Measured] = field(default_factory=list)  # the warm-start configs, measured here

    @property
    def gbps(self) -> float:
        return gbps(self.min_bytes, self.best.timing.median_us)

    @property
    def efficiency(self) -> float:
        return self.copy.median_us / self.best.timing.median_us

    @property
    def speedup_vs_default(self) -> float:
        return self.default.timing.median_us / self.best.timing.median_us if self.default else float("nan")


def study_name(op: OpSpec, problem: Problem, target: Target) -> str:
    """Resuming a study is only sound while the templates are unchanged: their digest is part
    of the name, so an edited template starts a fresh study instead of trusting old timings."""
    from .codegen import templates_digest

    return f"{op.name}|{target.arch}|{problem.key()}|{templates_digest()[:12]}"


class _Objective:
    def __init__(self, op: OpSpec, problem: Problem, target: Target, harness: Harness, timer: Timer):
        self.op, self.problem, self.target, self.h, self.timer = op, problem, target, harness, timer
        self.space = op.space
        self.failures: list[tuple[str, str]] = []
        self.measured: dict[Config, Measured] = {}
        self.compile_errors: dict[str, str] = {}
        self.pruned = 0

    def prepare(self, configs: list[Config]) -> None:
        """Compile a batch in parallel worker processes (compile is the slow part)."""
        srcs = [render_instance(self.op, self.problem, c, self.target) for c in configs if c not in self.measured]
        self.compile_errors.update(compile_many(srcs, self.target))

    def measure(self, config: Config) -> Measured:
        if config in self.measured:
            return self.measured[config]
        src = render_instance(self.op, self.problem, config, self.target)
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
        m = Measured(config, src.name, src.sha256, self.timer.time(run))
        self.measured[config] = m
        return m


def search(op: OpSpec, problem: Problem, target: Target, num_sms: int, ev: "_Objective", *,
           trials: int, timeout: float | None, storage: str | None, seed: int, batch: int = 16,
           on_trial: Callable[[int, int, float], None] | None = None,
           warm: tuple[Config, ...] = ()) -> tuple[Any, Config]:
    """The search loop, apart from the device: `ev` prepares (compiles) and measures configs, or
    raises TrialFailed. Returns the optuna study and the default config measured first.
    `trials` counts measured candidates (failed ones included); pruned proposals are free.
    `warm`: configs to measure first (e.g. another arch's winners), before the default and seeds."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t0 = time.monotonic()
    study = optuna.create_study(study_name=study_name(op, problem, target), storage=storage,
                                load_if_exists=True, direction="minimize",
                                sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=8))
    valid = [c for c in op.space.enumerate() if op.validate(problem, c, target)]
    if not valid:
        raise RuntimeError(f"{op.name} {problem.key()}: no config of the space is valid for this problem")
    # Search only values that occur in some valid config (NCHW never varies groups_per_block):
    # far fewer proposals are pruned, and the sampler's history stays small.
    choices = {n: [v for v in vals if any(c[n] == v for c in valid)] for n, vals in op.space.params.items()}
    # "The default" is the space's default, or the valid config nearest it (as the dispatcher does).
    default_cfg = op.space.nearest_default(lambda c: bool(op.validate(problem, c, target)))
    assert default_cfg is not None  # `valid` is non-empty
    for cfg in warm:
        if op.validate(problem, cfg, target):
            study.enqueue_trial(cfg.as_dict(), skip_if_exists=True)
    study.enqueue_trial(default_cfg.as_dict(), skip_if_exists=True)
    for seed_cfg in op.seed_configs(problem, target, num_sms, count=max(2, min(12, trials // 4))):
        study.enqueue_trial(seed_cfg.as_dict(), skip_if_exists=True)
    States = optuna.trial.TrialState
    trials = min(trials, len(valid))  # a small space is simply measured whole
    # A resumed study already holds measurements (same templates: the name carries their digest):
    # a repeat of one is told its stored value or failure instead of being measured again.
    known: dict[Config, float] = {}
    failed: dict[Config, str] = {}
    for t in study.trials:
        if t.state == States.COMPLETE and set(t.params) == set(choices):
            known[Config.of(t.params)] = t.value
        elif t.state == States.FAIL and "failure" in t.user_attrs and set(t.params) == set(choices):
            failed[Config.of(t.params)] = t.user_attrs["failure"]
    done, asked = 0, 0
    best = math.inf
    while done < trials and (timeout is None or time.monotonic() - t0 < timeout):
        pending: list[tuple[Any, Config]] = []
        while len(pending) < min(batch, trials - done) and asked < MAX_PRUNED_PER_TRIAL * max(trials, 1):
            asked += 1
            trial = study.ask()
            config = Config.of({n: trial.suggest_categorical(n, ch) for n, ch in choices.items()})
            ok = op.validate(problem, config, target)
            if not ok:
                ev.pruned += 1
                trial.set_user_attr("invalid", ok.reason)
                study.tell(trial, state=States.PRUNED)
            elif config in ev.measured:  # a repeat: its value is known, nothing new to measure
                study.tell(trial, ev.measured[config].timing.median_us)
            elif config in known:  # measured by an earlier run of this study
                study.tell(trial, known[config])
            elif config in failed:  # a repeat of a failure: fail again without retrying
                trial.set_user_attr("failure", failed[config])
                study.tell(trial, state=States.FAIL)
            elif any(config == c for _, c in pending):
                study.tell(trial, state=States.PRUNED)
            else:
                pending.append((trial, config))
        if not pending:
            break
        ev.prepare([c for _, c in pending])
        for trial, config in pending:
            try:
                m = ev.measure(config)
            except TrialFailed as e:
                failed[config] = str(e)
                trial.set_user_attr("failure", str(e))
                ev.failures.append((config.key(), str(e)))
                study.tell(trial, state=States.FAIL)
            else:
                trial.set_user_attr("instance", m.instance)
                trial.set_user_attr("spread", round(m.timing.spread, 4))
                study.tell(trial, m.timing.median_us)
                best = min(best, m.timing.median_us)
            done += 1
            if on_trial:
                on_trial(done, trials, best)
    return study, default_cfg


def tune_problem(op: OpSpec, problem: Problem, info: DeviceInfo, *, trials: int = 40,
                 timeout: float | None = None, storage: str | None = None, seed: int = 0,
                 batch: int = 16, warm: tuple[Config, ...] = (),
                 on_trial: Callable[[int, int, float], None] | None = None) -> TuneResult:
    """Tune one problem on the current GPU and pick the winner. Candidates are asked from optuna
    in batches of `batch`, compiled in parallel, then verified and timed one by one.
    `on_trial(done, total, best_us)` reports progress."""
    import optuna

    t0 = time.monotonic()
    target = info.target
    timer = Timer(info.l2_bytes)
    harness = Harness(op, problem, seed=None)  # fresh random inputs every run
    obj = _Objective(op, problem, target, harness, timer)
    study, default_cfg = search(op, problem, target, info.num_sms, obj, trials=trials, timeout=timeout,
                                storage=storage, seed=seed, batch=batch, on_trial=on_trial, warm=warm)
    States = optuna.trial.TrialState
    # Winner: re-measure the best few of this study (incl. earlier sessions) in this run.
    finished = sorted((t for t in study.trials if t.state == States.COMPLETE), key=lambda t: t.value)
    finalists: list[Measured] = []
    for t in finished[:3]:
        cfg = Config.of(t.params)
        if op.validate(problem, cfg, target):
            try:
                finalists.append(obj.measure(cfg))
            except TrialFailed as e:
                obj.failures.append((cfg.key(), str(e)))
    default_m = None
    try:
        default_m = obj.measure(default_cfg)
        finalists.append(default_m)
    except TrialFailed as e:
        obj.failures.append((default_cfg.key(), str(e)))
    if not finalists:
        raise RuntimeError(f"{op.name} {problem.key()}: no candidate passed verification; "
                           f"failures: {obj.failures[:3]}")
    best_m = min(finalists, key=lambda m: m.timing.median_us)
    copy = timer.copy_time(op.min_bytes(problem))
    return TuneResult(op.name, problem, best_m, default_m, copy, op.min_bytes(problem),
                      trials=len(obj.measured), pruned=obj.pruned,
                      failures=obj.failures, seconds=time.monotonic() - t0,
                      warm=[obj.measured[c] for c in warm if c in obj.measured])


def provenance(result: TuneResult) -> dict[str, Any]:
    import cupy

    from . import __version__

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


def db_entry(result: TuneResult, info: DeviceInfo) -> Any:
    """The instance-DB entry recording a tuning result (winner, timings, provenance)."""
    from .db import Entry

    return Entry(op=result.op, vendor=info.target.vendor, arch=info.target.arch, device=info.name,
                 problem=result.problem.key(), config=result.best.config.items,
                 instance=result.best.instance, source_sha256=result.best.sha256,
                 time_us=round(result.best.timing.median_us, 3), gbps=round(result.gbps, 1),
                 default_time_us=round(result.default.timing.median_us, 3) if result.default else -1.0,
                 provenance=tuple(sorted(provenance(result).items())))


@dataclass(frozen=True)
class RetuneItem:
    op: str
    problem: str
    from_arch: str
    config: Config  # the other arch's winner: the warm start, and the "before" on this GPU


def retune_plan(db: Any, arch: str, from_arch: str | None = None, ops: list[str] | None = None) -> list[RetuneItem]:
    """Every (op, problem) of the DB tuned on another arch and not yet on `arch`, with the winner
    of the nearest arch (same vendor first, then the closest arch number) as its warm start."""
    from .ops.spec import Target

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
