"""What `ckgen tune --workers 1` costs over plain `ckgen tune`, measured without a GPU (issue 50).

The GPU is stood in for: the verification harness does its host work (the inputs, the float64
reference, the packed inputs: what `verify.Harness` computes before its copies to the device) and
passes every candidate; a timing sleeps --gpu-ms and answers a fixed time per (problem, config).
The rest is what runs on a GPU machine: the NVRTC compile pool (offline compiles, a fresh kernel
cache per run), the sampler, the cost model's seeds and prior, the SQLite study storage, the
records and the DB. Not the shipped DB: one process's `tune.dispatcher_pick` (a measurement a
worker does not make) reloads it after every DB write, seconds a problem on a slow CPU, which
would hide the workers' own costs.

    python bench/workers_overhead.py [--op groupnorm_bwd] [--problems 7] [--trials 8]
                                     [--gpu-ms 40] [--repeat 1] [--profile DIR]

--problems N: N of the op's default problems, evenly spaced over its list (small to large).

Runs, in turn, each --repeat times, each in a fresh interpreter (as a command starts: imports and
the cost model's and records' caches cold) and with fresh caches (kernel cache, study storage, DB,
records): "one process" (`tune.tune_problem` for each problem, then the DB entry, as `ckgen tune`
does) and "--workers 1" (`workers.run_workers(spec, 1)`, as `ckgen tune --workers 1` does). Prints
the wall and CPU times (the CPU of the run's processes: steadier than wall time on a shared
machine), the worker's start (its spawn to its first event) and where the time went: with
--profile DIR, a cProfile of each path run in this process, one after the other (the worker's
loop, `_Worker.run`, without its spawn; the second run finds the cost model and records loaded),
is written to DIR and summarized (the harnesses, valid spaces, sampler, compile waits, storage
calls, final rounds)."""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckgen.tuner import tune  # noqa: E402
from ckgen.tuner import workers as wk  # noqa: E402
from ckgen.runtime.bench import Timing  # noqa: E402
from ckgen.runtime.target import DeviceInfo  # noqa: E402
from ckgen.types import Target  # noqa: E402

DEVICE = "stand-in GPU"
TARGET = Target.named("sm_90")
GPU_S = [0.04]  # seconds a timing takes (--gpu-ms; read in the workers through the spec's backend)


def standin_us(problem: Any, config: Any) -> float:
    """A fixed time per (problem, config): the landscape the search walks."""
    h = int.from_bytes(hashlib.blake2b((problem.key() + config.key()).encode(), digest_size=4).digest(), "big")
    return 20.0 + (h % 10_000) / 100.0


def harness_host_work(op: Any, problem: Any, seed: int | None, eps: float) -> tuple[Any, Any, Any]:
    """What `verify.Harness` computes on the CPU: the inputs, the float64 reference, the packed inputs."""
    import numpy as np

    inputs = op.make_inputs(problem, np.random.default_rng(seed))
    return inputs, op.reference(problem, inputs, eps=eps), op.pack_inputs(problem, inputs)


class StandinHarness:
    """`verify.Harness`'s host work, no device: every candidate passes."""

    def __init__(self, op: Any, problem: Any, seed: int | None = None, eps: float = 1e-5):
        self.op, self.problem = op, problem
        self.inputs, self.ref, self.dev_in = harness_host_work(op, problem, seed, eps)

    def runner(self, src: Any, config: Any, target: Any) -> Any:
        from ckgen.runtime.compile import ensure_cubin

        ensure_cubin(src, target)  # what load_kernel reads (compiled here if the pool did not)

        def run() -> None:
            pass

        run.us = standin_us(self.problem, config)  # type: ignore[attr-defined]
        return run

    def check(self, run: Any, widen: Any = None) -> Any:
        from ckgen.runtime.verify import Check

        return Check(True, "stand-in")


class StandinTimer:
    def __init__(self, l2_bytes: int = 0, gpu_s: float | None = None):
        self.gpu_s = GPU_S[0] if gpu_s is None else gpu_s

    def time(self, fn: Any, runs: int | None = None, flush: Any = None) -> Timing:
        time.sleep(self.gpu_s)
        return Timing(fn.us, fn.us, fn.us, runs or 25)

    def copy_time(self, nbytes: int) -> Timing:
        us = nbytes / 3.0e6  # 3 TB/s
        return Timing(us, us, us, 25)


def standin_info() -> DeviceInfo:
    return DeviceInfo(TARGET, DEVICE, 132, 50 * 2**20)


def standin_provenance(result: Any) -> dict[str, Any]:
    from ckgen import __version__

    return {"ckgen": __version__, "trials": result.trials, "tuning_seconds": round(result.seconds, 1)}


class StandinBackend(wk.GpuBackend):
    """`workers.GpuBackend` with the stand-in harness and timer (its seeds, prior and records real)."""

    def __init__(self, gpu_s: float = 0.04):
        self.info, self.gpu_s = standin_info(), gpu_s

    def __call__(self) -> "StandinBackend":  # the RunSpec's backend factory, called in the worker
        return self

    def evaluator(self, op: Any, problem: Any) -> Any:
        return tune.Objective(op, problem, self.info.target, StandinHarness(op, problem),
                               StandinTimer(gpu_s=self.gpu_s))

    def copy(self, op: Any, problem: Any) -> Timing:
        return StandinTimer(gpu_s=0).copy_time(op.min_bytes(problem))

    def provenance(self, result: Any) -> dict[str, Any]:
        return standin_provenance(result)


def fresh_env(root: Path) -> None:
    """Fresh caches for one run: kernels, studies, DB, records (the spawned workers inherit them)."""
    root.mkdir(parents=True)
    os.environ["CKGEN_CACHE_DIR"] = str(root / "cache")
    os.environ["CKGEN_KERNEL_CACHE"] = str(root / "kernels")
    os.environ["CKGEN_DB"] = str(root / "cache" / "instances.yaml")
    os.environ["CKGEN_SHIPPED_DB"] = str(root / "no-shipped-db.yaml")  # see the module's doc
    from ckgen.runtime import dispatch

    dispatch.dispatcher().reload()


def one_process(op: Any, problems: list[Any], trials: int) -> float:
    """`ckgen tune`'s loop (cli.cmd_tune): tune_problem, then the entry into the DB."""
    from ckgen.runtime import db as dbmod
    from ckgen import settings

    tune.Harness, tune.Timer, tune.provenance = StandinHarness, StandinTimer, standin_provenance  # type: ignore
    info, storage = standin_info(), settings.study_storage_url()
    t0 = time.monotonic()
    for p in problems:
        r = tune.tune_problem(tune.TuneRequest.on(op, p, info, trials=trials, storage=storage, seed=0), info)
        dbmod.save_entries(os.environ["CKGEN_DB"], [tune.db_entry(r, info)])
    from ckgen.runtime.compile import close_pool

    close_pool()  # its processes' exit is part of the run (the CLI's exit)
    return time.monotonic() - t0


def workers_run(op: Any, problems: list[Any], trials: int, gpu_s: float) -> tuple[float, float, dict[str, Any]]:
    """`ckgen tune --workers 1`: (wall s, s from the spawn to the worker's hello, results)."""
    GPU_S[0] = gpu_s
    from ckgen import settings

    spec = wk.RunSpec(op.name, tuple(p.key() for p in problems), trials, settings.study_storage_url(),
                      db=os.environ["CKGEN_DB"], backend=StandinBackend(gpu_s))
    t0 = time.monotonic()
    hello: list[float] = []

    def on_event(ev: tuple[Any, ...], procs: Any) -> None:
        if ev[0] == "hello":
            hello.append(time.monotonic() - t0)
        elif ev[0] == "error":
            print(f"worker {ev[1]}: {ev[3]}", file=sys.stderr)

    report = wk.run_workers(spec, 1, on_event=on_event)
    assert [w.exitcode for w in report.workers] == [0], [w.error for w in report.workers]
    return time.monotonic() - t0, hello[0] if hello else float("nan"), report.results


def in_process_worker(op: Any, problems: list[Any], trials: int, gpu_s: float) -> None:
    """The worker's loop (`_Worker.run`) in this process, for the profiler."""
    from ckgen import settings
    from ckgen.runtime.compile import close_pool

    spec = wk.RunSpec(op.name, tuple(p.key() for p in problems), trials, settings.study_storage_url(),
                      db=os.environ["CKGEN_DB"], backend=StandinBackend(gpu_s))
    import warnings

    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # as worker_main does
    w = wk._Worker(0, spec, spec.backend(), lambda *a: None)
    w.run()
    close_pool()


PROFILE_ROWS = {  # what the summary adds up: (file the function is in, its name), cumulative time and calls
    "harnesses (inputs, float64 reference)": ("workers_overhead.py", "harness_host_work"),
    "valid spaces (tune.valid_space)": ("tune.py", "valid_space"),
    "config validations (op.validate)": ("/ops/", "validate"),
    "sampler proposals (GP fit and pick)": ("sampler.py", "sample_relative"),
    "proposals under the propose lock": ("tune.py", "propose"),
    "waits for compiles": ("_base.py", "result"),
    "stand-in GPU timings (sleep)": ("workers_overhead.py", "time"),
    "budget checks (_RunBudget.allow)": ("workers.py", "allow"),
    "progress (_RunBudget.progress)": ("workers.py", "progress"),
    "problem scans (_Worker._state)": ("workers.py", "_state"),
    "stale-trial sweeps (fail_stale_trials)": ("_heartbeat.py", "fail_stale_trials"),
    "stale-trial sweeps (fail_stale_trials)": ("_heartbeat.py", "fail_stale_trials"),
    "study storage: all trials read": ("_storage.py", "get_all_trials"),
    "study storage: SQLite commits": ("~", "<method 'commit' of 'sqlite3.Connection' objects>"),
    "cost model seeds (tune.model_picks)": ("tune.py", "model_picks"),
    "dispatcher's pick (tune.dispatcher_pick)": ("tune.py", "dispatcher_pick"),
    "final round (tune.final_round)": ("tune.py", "final_round"),
    "DB writes (db.save_entries)": ("db.py", "save_entries"),
}


def profile_summary(path: Path) -> dict[str, tuple[float, int]]:
    """label -> (cumulative s, calls) of the PROFILE_ROWS functions, and the total."""
    import pstats

    st = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    out = {"total": (max(v[3] for v in st.values()), 1)}
    for label, (file, func) in PROFILE_ROWS.items():
        hits = [v for (f, _, fn), v in st.items() if (f.endswith(file) or (file.startswith("/") and file in f))
                and fn == func]
        out[label] = (sum(v[3] for v in hits), sum(v[1] for v in hits))
    return out


def cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (a worker, the compile pools'
    processes: each joined its own), user and system: the work done, less noisy than wall time
    on a shared machine."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _child(path: str, op_name: str, keys: list[str], trials: int, gpu_s: float, out: Any) -> None:
    """A fresh interpreter's run of one path; what it returns goes to `out` (a queue)."""
    from ckgen.ops import get_op

    op = get_op(op_name)
    problems = [op.problem_from_key(k) for k in keys]
    GPU_S[0] = gpu_s
    if path == "one":
        out.put(one_process(op, problems, trials))
    else:
        out.put(workers_run(op, problems, trials, gpu_s)[1])


def timed(path: str, op: Any, problems: list[Any], trials: int, gpu_s: float) -> tuple[float, float, Any]:
    """(wall s, CPU s, what the path returned) of a path run in a fresh interpreter (spawned with
    this process's environment: `fresh_env`'s caches)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    c0, t0 = cpu_s(), time.monotonic()
    proc = ctx.Process(target=_child, args=(path, op.name, [p.key() for p in problems], trials, gpu_s, q))
    proc.start()
    got = q.get()
    proc.join()
    wall, cpu = time.monotonic() - t0, cpu_s() - c0
    assert proc.exitcode == 0, proc.exitcode
    return wall, cpu, got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="groupnorm_bwd")
    ap.add_argument("--problems", type=int, default=7, help="N of the op's default problems, evenly spaced")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--gpu-ms", type=float, default=40.0, help="what a timing takes on the stand-in GPU")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--profile", metavar="DIR", help="also profile both paths in this process; .prof files here")
    args = ap.parse_args()
    from ckgen.ops import get_op

    op = get_op(args.op)
    every = op.default_problems()
    problems = [every[i * len(every) // args.problems] for i in range(min(args.problems, len(every)))]
    GPU_S[0] = gpu_s = args.gpu_ms / 1e3
    print(f"{op.name}: {len(problems)} problems x {args.trials} trials, stand-in GPU {args.gpu_ms:g} ms a timing, "
          f"{os.cpu_count()} CPUs", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckgen-workers-overhead-") as tmp:
        for rep in range(args.repeat):
            fresh_env(Path(tmp) / f"one-{rep}")
            one, one_cpu, _ = timed("one", op, problems, args.trials, gpu_s)
            fresh_env(Path(tmp) / f"workers-{rep}")
            wall, cpu, hello = timed("workers", op, problems, args.trials, gpu_s)
            rows.append((one, wall, one_cpu, cpu))
            print(f"run {rep + 1}: one process {one:.1f} s ({one_cpu:.1f} s CPU), --workers 1 {wall:.1f} s "
                  f"({cpu:.1f} s CPU): {wall / one:.2f}x wall, {cpu / one_cpu:.2f}x CPU; the worker's hello "
                  f"{hello:.1f} s after its spawn", flush=True)
        if args.profile:
            import cProfile

            out = Path(args.profile)
            out.mkdir(parents=True, exist_ok=True)
            sums = {}
            for name, fn in (("one-process", lambda: one_process(op, problems, args.trials)),
                             ("worker", lambda: in_process_worker(op, problems, args.trials, gpu_s))):
                fresh_env(Path(tmp) / f"profile-{name}")
                prof = cProfile.Profile()
                prof.runcall(fn)
                prof.dump_stats(str(out / f"{name}.prof"))
                sums[name] = profile_summary(out / f"{name}.prof")
            print(f"\n{'cProfile, main thread: cumulative s (calls)':48} {'one process':>16} {'worker':>16}")
            for label in ["total", *PROFILE_ROWS]:
                cells = [f"{sums[n][label][0]:.1f} ({sums[n][label][1]})" for n in ("one-process", "worker")]
                print(f"{label:48} {cells[0]:>16} {cells[1]:>16}")
    if rows:
        import statistics

        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        print(f"\nmedian of {len(rows)}: one process {med[0]:.1f} s ({med[2]:.1f} s CPU), --workers 1 {med[1]:.1f} s "
              f"({med[3]:.1f} s CPU): {med[1] / med[0]:.2f}x wall, {med[3] / med[2]:.2f}x CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
