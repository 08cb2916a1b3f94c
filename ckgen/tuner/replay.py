"""Tuning without a GPU: a recorded exhaustive sweep (bench/sweep.py output, tests/data/sweeps/)
stands in for the device, so a `tune.Tuner`'s search can be run and scored anywhere (tests, sampler
comparisons: bench/replay_search.py).

A sweep recorded before a knob joined the space lacks that knob: its configs are read with the
space default's value for it (the only value they were measured with), and a replay searches
only the recorded configs (`Sweep.covers`), never guessing times for the rest."""
from __future__ import annotations

import gzip
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..ops import get_op
from ..ops.spec import OpSpec, Problem
from ..runtime.bench import Timing
from ..types import Config, Target
from .tune import AHEAD, Measured, TrialFailed, Tuner, TuneRequest, final_measured, model_picks

# Sweeps in the first format carry no op or arch: they are groupnorm_fwd runs on an H100.
LEGACY_OP, LEGACY_ARCH = "groupnorm_fwd", "sm_90"


@dataclass
class Sweep:
    path: Path
    op: OpSpec
    problem: Problem
    target: Target
    device: str
    times: dict[Config, float]  # median us of every config measured
    failed: dict[Config, str]  # configs that failed to compile or verify, with why
    filled: dict[str, Any] = field(default_factory=dict)  # knobs the recording lacks -> value assumed
    unrecorded: int = 0  # valid configs of today's space the sweep does not hold
    num_sms: int = 132
    complete: bool = True  # False: still being measured (its best is not the exhaustive best)
    # What every replay of this sweep asks again, answered once (`replay`): the op and the model
    # (`_Remembered`), the seeds per trial count; "held_out": its held-out model, if given
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def best(self) -> float:
        return min(self.times.values())

    def covers(self, config: Config) -> bool:
        return config in self.times or config in self.failed

    @property
    def name(self) -> str:
        return sweep_stem(self.path)


def sweep_stem(path: Path) -> str:
    """A sweep file's name without .json or .json.gz."""
    name = Path(path).name
    return name[: -len(".json.gz")] if name.endswith(".json.gz") else Path(name).stem


def read_sweep_doc(path: Path | str) -> dict[str, Any]:
    """A sweep file's JSON: plain (bench/sweep.py while measuring) or gzipped (the repo's)."""
    path = Path(path)
    if path.name.endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text())


def sweep_paths(folder: Path | str, pattern: str = "sweep-*") -> list[Path]:
    """The sweep files in `folder` matching `pattern` (without the suffix), .json or .json.gz, sorted."""
    folder = Path(folder)
    return sorted([*folder.glob(pattern + ".json"), *folder.glob(pattern + ".json.gz")], key=lambda p: p.name)


def load_sweep(path: Path | str) -> Sweep:
    path = Path(path)
    doc = read_sweep_doc(path)
    op = get_op(doc.get("op", LEGACY_OP))
    problem = op.problem_from_key(doc["problem"])
    target = Target.named(doc.get("arch", LEGACY_ARCH))
    default = op.space.default.as_dict()
    filled: dict[str, Any] = {}

    def full(cfg: dict[str, Any]) -> Config:
        for k in default:
            if k not in cfg:
                filled[k] = default[k]
        return Config.of({**{k: default[k] for k in default if k not in cfg}, **cfg})

    times = {full(cfg): float(us) for us, _, cfg in doc["rows"]}
    failed = {full(cfg): str(why) for cfg, why in doc.get("failed", [])}
    valid = [c for c in op.space.enumerate() if op.validate(problem, c, target)]
    unrecorded = sum(1 for c in valid if c not in times and c not in failed)
    stray = [c for c in list(times) + list(failed) if not op.validate(problem, c, target)]
    if stray:  # the space or validate changed since the recording: those configs are not searched
        for c in stray:
            times.pop(c, None)
            failed.pop(c, None)
    if not times:
        raise ValueError(f"{path}: no recorded config is valid in today's space")
    return Sweep(path, op, problem, target, doc.get("device", "NVIDIA H100 80GB HBM3"), times, failed,
                 filled, unrecorded, int(doc.get("num_sms", 132)), bool(doc.get("complete", True)))


class ReplayEvaluator:
    """A `tune.Tuner`'s evaluator answering from recorded times; TrialFailed for recorded failures.
    `noise` (relative, seeded) perturbs the final round's re-timings, for tests of the pick."""

    def __init__(self, time_of: Callable[[Config], float | None], instance: Callable[[Config], str] = Config.key,
                 noise: float = 0.0, seed: int = 0):
        self.time_of, self.instance = time_of, instance
        self.measured: dict[Config, Measured] = {}
        self.failures: list[tuple[str, str]] = []
        self.pruned = 0
        self.calls: list[Config] = []  # measure() calls, in order
        self.started: list[Config] = []  # start() calls, in order
        self.noise, self.rng = noise, random.Random(seed)

    def start(self, configs: list[Config]) -> None:
        self.started += configs

    def measure(self, config: Config) -> Measured:
        self.calls.append(config)
        t = self.time_of(config)
        if t is None:
            raise TrialFailed("wrong result: replayed failure")
        m = Measured(config, self.instance(config), "replay", Timing(t, t, t, 1))
        self.measured[config] = m
        return m

    def retime(self, configs: list[Config], rounds: int) -> tuple[dict[Config, Measured], dict[Config, str]]:
        out, failed = {}, {}
        for c in configs:
            t = self.time_of(c)
            if t is None:
                failed[c] = "wrong result: replayed failure"
                continue
            ts = [t * (1.0 + self.rng.gauss(0.0, self.noise)) for _ in range(rounds)]
            out[c] = final_measured(c, self.instance(c), "replay", ts)
        return out, failed


def held_out_records(sweep: Sweep) -> list[dict[str, Any]]:
    """The shipped records (ckgen/data/records.jsonl.gz) without any of the sweep's problem: the
    shipped ones hold the sweep itself (and bench timings of its problem), so a model fit on them
    has seen the answer, and the sweep's winner would be its own nearest recorded winner."""
    from ..model import records

    key = (sweep.op.name, sweep.problem.key())
    return [r for r in records.read_cached(records.packaged_records_path()) if (r["op"], r["problem"]) != key]


def held_out_model(sweep: Sweep) -> Any:
    """The cost model a replay seeds from: fit (`model.fit`, as the packaged one) on
    `held_out_records(sweep)`: leave-one-out, never the packaged model. Fit once per problem
    (`model.packaged_fit_data()`, which leave-one-out shares) and shared: do not change it."""
    from .. import model as cm

    return cm.packaged_fit_data().fit(exclude=(sweep.op.name, sweep.problem.key()))


class _Remembered:
    """An op or a cost model for the replays of one sweep: the answers that depend on the problem
    and the config alone (the op's validate, launches and seed configs; the model's predictions)
    are remembered, since every seed's search asks the same questions again; every other
    attribute is the wrapped object's. Pure functions of their arguments, so a replay's result
    is the same with them (`replay(remember=False)`)."""

    REMEMBERED = ("validate", "launches", "seed_configs", "predict_many")

    def __init__(self, inner: Any):
        self._inner = inner
        self._answers: dict[Any, Any] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Remembered, (self._inner,))

    def __getattr__(self, name: str) -> Any:
        if name in ("_inner", "_answers"):  # not set yet (an object being built): no recursion
            raise AttributeError(name)
        attr = getattr(self._inner, name)
        if name not in self.REMEMBERED:
            return attr

        def remembered(*args: Any, **kwargs: Any) -> Any:
            key = (name, *(tuple(a) if isinstance(a, list) else a for a in args), *sorted(kwargs.items()))
            if key not in self._answers:
                self._answers[key] = attr(*args, **kwargs)
            return self._answers[key]

        return remembered


def replay(sweep: Sweep, trials: int, seed: int, sampler: str | None = None, ahead: int = AHEAD,
           storage: Any = None, model: bool = True, remember: bool = True) -> tuple[float, ReplayEvaluator]:
    """One search on the recorded times, seeded as `ckgen tune` seeds it (`tune.model_picks`: the
    cost model's picks and the nearest recorded problems' winners) but from `held_out_model(sweep)`
    and `held_out_records(sweep)` (`model=False`: no such seeds, and no prior mean): (best found /
    recorded best, the evaluator). `remember`: the op's and the model's answers and the seeds of a
    trial count are kept in `sweep.memo` for the sweep's next replays (`_Remembered`)."""
    ev = ReplayEvaluator(sweep.times.get)
    memo = sweep.memo if remember else {}
    op = memo.setdefault("op", _Remembered(sweep.op)) if remember else sweep.op
    cost = None
    if model:
        if remember:
            cost = memo.get("model")
            if cost is None:
                cost = memo["model"] = _Remembered(memo.get("held_out") or held_out_model(sweep))
        else:
            cost = memo.get("held_out") or held_out_model(sweep)
    picks: tuple[Config, ...] = ()
    if model:
        key = ("picks", trials)
        if key not in memo:
            ok = lambda c: sweep.covers(c) and bool(op.validate(sweep.problem, c, sweep.target))  # noqa: E731
            memo[key] = model_picks(op, sweep.problem, sweep.target, trials, ok, cost, records=held_out_records(sweep))
        picks = memo[key]
    request = TuneRequest(op, sweep.problem, sweep.target, num_sms=sweep.num_sms, trials=trials, storage=storage,
                          seed=seed, sampler=sampler, ahead=ahead, restrict=sweep.covers, model=cost, picks=picks)
    Tuner(request, ev).search()
    found = min((m.timing.median_us for m in ev.measured.values()), default=math.inf)
    return found / sweep.best, ev


def _replay_sweep(path: str, trials: tuple[int, ...], seeds: tuple[int, ...], model: Any) -> tuple[dict, Any]:
    """Every (trials, seed) replay of the sweep at `path`, in a worker process (`replay_sweeps`),
    with `model` as its held-out model (None: fit here); the ratios and that model."""
    sw = load_sweep(path)
    sw.memo["held_out"] = model if model is not None else held_out_model(sw)
    ratios = {t: [replay(sw, t, seed)[0] for seed in seeds] for t in trials}
    return ratios, sw.memo["held_out"]


def replay_sweeps(sws: list[Sweep], trials: Sequence[int], seeds: Sequence[int], jobs: int = 1,
                  ) -> dict[tuple[str, int], list[float]]:
    """{(sweep name, trials): [best found / best of each seed's replay]} over every sweep, trial
    count and seed; `jobs` > 1: that many worker processes, a sweep each at a time (its replays
    share what they remember). A held-out model this process has is handed to the worker, and
    one fit there is kept here (`model.packaged_fit_data()`), so leave-one-out and the
    replays fit each problem once in all. The same ratios as one process."""
    from .. import model as cm

    trials, seeds = tuple(trials), tuple(seeds)
    out: dict[tuple[str, int], list[float]] = {}
    if jobs <= 1 or len(sws) <= 1:
        for sw in sws:
            for t in trials:
                out[(sw.name, t)] = [replay(sw, t, seed)[0] for seed in seeds]
        return out
    import concurrent.futures as cf
    import multiprocessing as mp

    data = cm.packaged_fit_data()
    keys = [(sw.op.name, sw.problem.key()) for sw in sws]
    known = [sw.memo.get("held_out") or data.fitted(exclude=k) for sw, k in zip(sws, keys)]
    # spawn: a fresh interpreter per worker (forking a process that holds threads, torch's or
    # BLAS's, can deadlock); the biggest sweeps first, so the last ones to finish are short
    order = sorted(range(len(sws)), key=lambda i: -len(sws[i].times))
    with cf.ProcessPoolExecutor(min(jobs, len(sws)), mp_context=mp.get_context("spawn")) as pool:
        futures = {i: pool.submit(_replay_sweep, str(sws[i].path), trials, seeds, known[i]) for i in order}
        for i, sw in enumerate(sws):
            ratios, model = futures[i].result()
            data.remember(model, exclude=keys[i])
            for t in trials:
                out[(sw.name, t)] = ratios[t]
    return out


def sweeps(folder: Path | str) -> list[Sweep]:
    """Every complete sweep in `folder` (a partial one, "complete": false, is still being measured:
    its best is not the exhaustive best)."""
    return [sw for sw in map(load_sweep, sweep_paths(folder)) if sw.complete]


class ReplayBackend:
    """A `ckgen.tuner.workers` backend with no GPU: every problem's times come from `time_of(problem_key,
    config)` (None: the config fails), optionally on the configs `restrict_to(problem_key, config)`
    accepts. Each measurement sleeps `delay` seconds (a stand-in for the GPU's time) and, with
    `log_dir`, is appended to `<log_dir>/measure-<pid>.jsonl` first (so a test knows what each
    worker measured, even one that was killed). Picklable when its callables are module-level."""

    def __init__(self, time_of: Callable[[str, Config], float | None],
                 restrict_to: Callable[[str, Config], bool] | None = None, arch: str = "sm_90",
                 device: str = "replayed GPU", delay: float = 0.0, log_dir: str | None = None):
        from ..runtime.target import DeviceInfo

        self.time_of, self.restrict_to, self.delay, self.log_dir = time_of, restrict_to, delay, log_dir
        self.info = DeviceInfo(Target.named(arch), device, 132, 50 * 2**20)

    def __call__(self) -> "ReplayBackend":  # the backend factory of a RunSpec
        return self

    def evaluator(self, op: OpSpec, problem: Problem) -> ReplayEvaluator:
        key, backend = problem.key(), self

        class _Logged(ReplayEvaluator):
            def measure(self, config: Config) -> Measured:
                if backend.log_dir:
                    import os

                    line = json.dumps({"pid": os.getpid(), "problem": key, "config": config.key()})
                    with open(Path(backend.log_dir) / f"measure-{os.getpid()}.jsonl", "a") as f:
                        f.write(line + "\n")
                        f.flush()
                if backend.delay:
                    import time

                    time.sleep(backend.delay)
                return super().measure(config)

        return _Logged(lambda c: self.time_of(key, c), instance=lambda c: op.instance_name(problem, c))

    def restrict(self, op: OpSpec, problem: Problem) -> Callable[[Config], bool] | None:
        if self.restrict_to is None:
            return None
        key, fn = problem.key(), self.restrict_to
        return lambda c: fn(key, c)

    def recorder(self, op: OpSpec, problem: Problem) -> None:
        return None

    def model_seeds(self, op: OpSpec, problem: Problem, trials: int) -> tuple[Config, ...]:
        return ()

    def model(self) -> None:
        return None  # no prior mean: a replay's sampler sees the recorded times only

    def copy(self, op: OpSpec, problem: Problem) -> Timing:
        return Timing(1.0, 1.0, 1.0, 1)

    def provenance(self, result: Any) -> dict[str, Any]:
        import datetime as dt

        from .._version import __version__

        return {"ckgen": __version__, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "trials": result.trials, "tuning_seconds": round(result.seconds, 1), "source": "replay"}
