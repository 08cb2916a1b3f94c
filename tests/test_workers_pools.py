"""Worker processes and the compile pools they own: a worker that compiled through the
real NVRTC compile pool (offline, no GPU; replayed times for the GPU part: tests/wtimes.py's
CompilingBackend) exits when its work ends. A spawned child leaves through os._exit and never
runs atexit, so a pool shut down only at exit kept the worker alive forever, and the parent,
waiting for it, with it. The runs are child processes of the test, each in a session of its own,
under a time bound: a hang fails the test, and its whole process tree is killed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import wtimes

TESTS = str(Path(__file__).resolve().parent)
ROOT = str(Path(__file__).resolve().parents[1])
BOUND_S = 240  # a run takes 10-30 s here; a hung worker never ends


def run_bounded(code: str, env: dict[str, str], bound: float = BOUND_S) -> dict:
    """Run `code` in a fresh interpreter (a session of its own), kill its whole tree past `bound`,
    and whatever of it is left when it ends; returns the JSON document it printed last. Its output
    goes to files, not pipes: a process it left behind holding them would keep a pipe open."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, text=True,
                                stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the driver, its workers and their pool processes
            except ProcessLookupError:  # nothing of it is left
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert proc.returncode != -signal.SIGKILL, f"the run did not end within {bound} s\n{stderr[-3000:]}"
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def test_a_worker_that_compiled_through_the_real_pool_exits(tmp_path):
    env = {**os.environ, "CKGEN_KERNEL_CACHE": str(tmp_path / "kernels"), "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    keys = wtimes.KEYS[:2]
    doc = run_bounded(f"""
        import json
        import wtimes
        from ckgen.tuner import workers as wk

        spec = wk.RunSpec(wtimes.OP.name, {tuple(keys)!r}, 3, {f"sqlite:///{tmp_path / 's.sqlite3'}"!r},
                          db={str(tmp_path / 'db.yaml')!r}, backend=wtimes.CompilingBackend(), poll_s=0.2)
        report = wk.run_workers(spec, 1)
        print(json.dumps({{"exit": [w.exitcode for w in report.workers], "errors": [w.error for w in report.workers],
                          "results": {{k: r.get("instance") for (_, k), r in report.results.items()}},
                          "seconds": report.seconds}}))
        """, env)
    assert doc["exit"] == [0], doc["errors"]
    assert sorted(doc["results"]) == sorted(keys) and all(doc["results"].values()), doc
    cubins = {p.name.rsplit("-", 1)[0] for p in (tmp_path / "kernels").rglob("*.cubin")}
    assert set(doc["results"].values()) <= cubins  # the winners were compiled, by the pool


def test_a_worker_that_finishes_but_never_exits_is_stopped_and_reported(tmp_path):
    env = {**os.environ, "CKGEN_KERNEL_CACHE": str(tmp_path / "kernels"), "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    keys = wtimes.KEYS[:1]
    doc = run_bounded(f"""
        import json
        import wtimes
        from ckgen.tuner import workers as wk

        events = []
        spec = wk.RunSpec(wtimes.OP.name, {tuple(keys)!r}, 2, {f"sqlite:///{tmp_path / 's.sqlite3'}"!r},
                          backend=wtimes.HangingBackend(), poll_s=0.2)
        report = wk.run_workers(spec, 1, on_event=lambda ev, procs: events.append(ev[0]), exit_grace=3)
        w = report.workers[0]
        print(json.dumps({{"exit": w.exitcode, "error": w.error, "finished": w.finished, "events": events,
                          "results": sorted(k for _, k in report.results)}}))
        """, env)
    assert doc["finished"] and doc["results"] == sorted(keys)  # its work was done and stored
    assert "stuck" in doc["events"] and doc["exit"] == -signal.SIGTERM, doc
    assert "had not exited 3 s later: stopped" in doc["error"]


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    """Running (not exited, nor an exited process nobody reaped yet: a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from Linux /proc")
def test_a_killed_worker_is_reported_and_its_compile_pool_does_not_outlive_it(tmp_path):
    env = {**os.environ, "CKGEN_KERNEL_CACHE": str(tmp_path / "kernels"), "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    doc = run_bounded(f"""
        import json, os, signal, time
        import wtimes
        from ckgen.tuner import workers as wk
        from test_workers_pools import _alive, _children

        pool = []

        def on_event(ev, procs):
            if ev[0] == "trial" and not pool:  # it has compiled: its pool is up
                pool.extend(_children(procs[0].pid))
                os.kill(procs[0].pid, signal.SIGKILL)

        spec = wk.RunSpec(wtimes.OP.name, {tuple(wtimes.KEYS[:2])!r}, 4, {f"sqlite:///{tmp_path / 's.sqlite3'}"!r},
                          backend=wtimes.CompilingBackend(delay=0.5), poll_s=0.2)
        report = wk.run_workers(spec, 1, on_event=on_event)
        t0 = time.monotonic()
        while any(map(_alive, pool)) and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        w = report.workers[0]
        print(json.dumps({{"exit": w.exitcode, "error": w.error, "pool": pool, "alive": [p for p in pool if _alive(p)]}}))
        """, env)
    assert doc["exit"] == -signal.SIGKILL and doc["error"] == "died (signal 9 (SIGKILL)) before it finished", doc
    assert doc["pool"], "the worker had no compile pool processes to check"
    assert doc["alive"] == [], f"compile pool processes outlived their killed worker: {doc}"


def test_any_multiprocessing_child_that_compiled_through_the_pool_exits(tmp_path):
    """Not only `ckgen tune --workers` workers: a child that leaves its compile pool open exits too
    (the pool is a multiprocessing finalizer, run before the child's exit joins the pool)."""
    env = {**os.environ, "CKGEN_KERNEL_CACHE": str(tmp_path / "kernels"), "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    doc = run_bounded("""
        import json, multiprocessing as mp
        import wtimes

        p = mp.get_context("spawn").Process(target=wtimes.compile_in_child)
        p.start()
        p.join(60)
        hung = p.exitcode is None
        if hung:
            p.kill()
        print(json.dumps({"exit": p.exitcode, "hung": hung}))
        """, env)
    assert not doc["hung"], "the child had not exited 60 s after its work"
    assert doc["exit"] == 0, doc
    assert len(list((tmp_path / "kernels").rglob("*.cubin"))) == 3  # compiled through the pool
