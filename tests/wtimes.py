"""Synthetic timings for the multi-worker tests (importable by spawned workers): 8 max-pooling
problems (a space that enumerates in a fraction of a second, so each worker starts fast), each searched over a fixed subset of its valid configs, with a smooth landscape that
differs per problem."""
from __future__ import annotations

import functools
import hashlib

from ckgen.ops import get_op
from ckgen.types import Config, Target

OP = get_op("maxpool2d_fwd")
SM90 = Target.named("sm_90")
SHAPES = [(32, 64, 112, 112), (8, 128, 56, 56), (16, 256, 28, 28), (4, 512, 14, 14),
          (2, 64, 224, 224), (64, 32, 56, 56), (8, 96, 64, 64), (1, 160, 128, 128)]
PROBLEMS = [OP.parse_problem(N=n, C=c, H=h, W=w, kernel=3, stride=2, padding=1, dtype="bf16", layout=lay)
            for (n, c, h, w), lay in zip(SHAPES, ["nhwc", "nchw"] * 4)]
KEYS = [p.key() for p in PROBLEMS]
SUBSET = 10  # configs searched per problem


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "big")


@functools.lru_cache(maxsize=None)
def subset(key: str) -> frozenset[Config]:
    p = OP.problem_from_key(key)
    valid = sorted((c for c in OP.space.enumerate() if OP.validate(p, c, SM90)), key=lambda c: _h(key + c.key()))
    default = OP.space.nearest_default(lambda c: bool(OP.validate(p, c, SM90)))
    return frozenset(valid[: SUBSET - 1] + [default])


def restrict_to(key: str, config: Config) -> bool:
    return config in subset(key)


def time_of(key: str, config: Config) -> float | None:
    """Smooth in the knobs, shifted per problem; a few configs fail (a recorded failure)."""
    if _h("fail" + key + config.key()) % 17 == 0:
        return None
    k = _h(key) % 7
    return (100.0 + 10 * k - 2.0 * config["vec_bytes"] + abs(config["threads"] - 64 * (1 + k % 4)) / 64
            + config["tw"] * config["th"] / 4 + (_h(key + config.key()) % 1000) / 500.0)


class CompilingBackend:
    """A `ckgen.tuner.workers` backend that compiles every proposal through the real compile pool
    (`tune.Objective.start`: NVRTC offline, in the worker's spawned pool processes) and answers
    `time_of`'s replayed times for the GPU part, so a worker owns a real pool as it does on a GPU
    machine. `delay` seconds per measurement stand in for the GPU's time."""

    def __init__(self, delay: float = 0.0):
        from ckgen.tuner.replay import ReplayBackend

        self.replay = ReplayBackend(time_of, restrict_to, delay=delay)
        self.info = self.replay.info

    def __call__(self) -> "CompilingBackend":  # the backend factory of a RunSpec
        return self

    def evaluator(self, op, problem):
        return CompilingEvaluator(op, problem, self.info.target, self.replay.evaluator(op, problem))

    def __getattr__(self, name: str):  # restrict, recorder, model_seeds, model, copy, provenance
        if name == "replay":
            raise AttributeError(name)
        return getattr(self.replay, name)


class CompilingEvaluator:
    """Compiles in the background through `tune.Objective` (its `start` and the pool it uses),
    waits for each config's cubin before answering the replayed evaluator's time."""

    def __init__(self, op, problem, target, replayed):
        from ckgen.tuner import tune

        self.objective = tune.Objective(op, problem, target, None, None)  # no harness, no timer: no GPU
        self.replayed = replayed

    def __getattr__(self, name: str):  # measured, failures, pruned, retime
        if name in ("replayed", "objective"):
            raise AttributeError(name)
        return getattr(self.replayed, name)

    @property
    def pruned(self) -> int:
        return self.replayed.pruned

    @pruned.setter
    def pruned(self, value: int) -> None:
        self.replayed.pruned = value

    def start(self, configs) -> None:
        self.objective.start(configs)
        self.replayed.start(configs)

    def measure(self, config):
        from ckgen.tuner.tune import TrialFailed

        job = self.objective.pending.pop(config, None)
        if job is not None:
            msg = job.result(timeout=300)
            if msg:
                raise TrialFailed(f"compile error: {msg}")
        return self.replayed.measure(config)


class HangingBackend(CompilingBackend):
    """A CompilingBackend that also leaves a non-daemon thread waiting forever: a worker whose
    work ends normally but whose process can never exit (multiprocessing's exit joins it), as a
    worker whose compile pool was never shut down could not."""

    def __call__(self) -> "HangingBackend":
        import threading

        threading.Thread(target=threading.Event().wait, name="never-ends").start()
        return self


def compile_in_child(count: int = 3) -> None:
    """A multiprocessing child's work that compiles `count` configs of the first problem through
    the tuner's background compile pool and returns without shutting the pool down (as a
    script's own child running `tune.tune_problem` would)."""
    from ckgen.tuner import tune

    problem = PROBLEMS[0]
    objective = tune.Objective(OP, problem, SM90, None, None)
    configs = sorted(subset(KEYS[0]), key=lambda c: c.key())[:count]
    objective.start(configs)
    for c in configs:
        assert objective.pending[c].result(timeout=300) is None


class CountingBackend:
    """A ReplayBackend (`backend`) that also appends a line to `<log_dir>/evaluators-<pid>.txt`
    for each evaluator it makes (the problem's key): how many harnesses a GPU worker would build."""

    def __init__(self, backend):
        self.backend = backend
        self.info = backend.info

    def __call__(self) -> "CountingBackend":
        return self

    def evaluator(self, op, problem):
        import os
        from pathlib import Path

        with open(Path(self.backend.log_dir) / f"evaluators-{os.getpid()}.txt", "a") as f:
            f.write(problem.key() + "\n")
        return self.backend.evaluator(op, problem)

    def __getattr__(self, name: str):
        if name == "backend":
            raise AttributeError(name)
        return getattr(self.backend, name)
