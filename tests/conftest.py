import gc
import os
import resource
import time
from pathlib import Path

import pytest

# numpy's BLAS in one thread: the cost-model fits are small matrix products, and on CI's 2 cores
# (shared with the tests' workers and servers) a second BLAS thread spins more than it helps.
# Set before numpy is imported (the test modules import it, after this file).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# The cyclic garbage collector less often (a young collection every 50,000 allocations, not 700):
# the test processes hold large heaps (torch, compiled graphs, rendered sources), and collecting
# them at Python's default rate took a tenth of the tier's CPU time (measured over test_torch,
# test_costmodel and test_db: 16.8 s of collections, 31 of them full; 3.7 s and 2 full at these
# thresholds, and the files' CPU time fell by a quarter). Garbage is still collected, in bigger
# batches; nothing here relies on the collector's timing.
gc.set_threshold(50_000, 20, 10)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 8 (each imports torch and NumPy, and the compile
    tests start compilers of their own)."""
    return max(1, min(8, os.cpu_count() or 1))


def pytest_configure(config):
    """One compiled-kernel folder for the whole run (CKGEN_KERNEL_CACHE, unless set already): every
    test gets its own cache dir and DB (`_isolated_db`), but cubins are named by their source's
    sha256, so sharing them is safe, and a kernel that a module's prewarm or an earlier test
    compiled is not compiled again in every test."""
    if not os.environ.get("CKGEN_KERNEL_CACHE"):
        import tempfile

        os.environ["CKGEN_KERNEL_CACHE"] = config._ckgen_kernels = tempfile.mkdtemp(prefix="ckgen-test-kernels-")


def _cpu_seconds(children: bool = True) -> float:
    """User + system CPU seconds of this process (and of the child processes it has waited for:
    compilers, workers, tools; not servers that detach, such as PostgreSQL's)."""
    who = [resource.RUSAGE_SELF] + ([resource.RUSAGE_CHILDREN] if children else [])
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, who))


def pytest_sessionstart(session):
    session.config._ckgen_started = time.monotonic()
    session.config._ckgen_worker_cpu = []


def pytest_sessionfinish(session):
    """Before an xdist worker says it is done: its CPU time for the controller's summary, then
    one garbage collection and a freeze of what survives it. pytest collects garbage five times
    more after this (at unconfigure, for unraisable exceptions); over a worker's heap (torch,
    compiled graphs: 1.5 million objects) each pass took seconds, and execnet interrupts a worker
    still running 5 s after the controller's shutdown: a KeyboardInterrupt traceback at the end of
    the run. Frozen objects are not scanned again, so those passes take milliseconds."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["ckgen_cpu_s"] = _cpu_seconds()
    gc.collect()
    gc.freeze()


def pytest_testnodedown(node, error):
    """The controller: each worker's CPU time, for the summary line."""
    cpu = getattr(node, "workeroutput", {}).get("ckgen_cpu_s")
    if cpu is not None:
        node.config._ckgen_worker_cpu.append(cpu)


def pytest_terminal_summary(terminalreporter, config):
    """The run's CPU time, so that a slower test tier shows (README: the fast tier takes at most
    600 CPU-seconds, 5 minutes on 2 idle cores): with xdist, the controller's own and every
    worker's with the child processes each waited for."""
    workers = getattr(config, "_ckgen_worker_cpu", None)
    started = getattr(config, "_ckgen_started", None)
    if workers is None or started is None or hasattr(config, "workeroutput"):
        return
    cpu = _cpu_seconds(children=not workers) + sum(workers)
    how = f"{len(workers)} worker processes, " if workers else ""
    budget = "; the fast tier's budget: 600 s" if config.option.markexpr == "not quality" else ""
    terminalreporter.write_line(f"CPU time: {cpu:.0f} s in {time.monotonic() - started:.0f} s wall ({how}with the "
                                f"compilers and tools they ran{budget})")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A GPU test skipped for want of a GPU is reported at tests/gpu, not at its own line, so
    that `-ra` folds the whole GPU tier into one line."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and isinstance(rep.longrepr, tuple) and "gpu" in item.keywords and "no GPU: " in str(rep.longrepr[2]):
        rep.longrepr = (str(Path(__file__).parent / "gpu"), None, rep.longrepr[2])


def pytest_unconfigure(config):
    made = getattr(config, "_ckgen_kernels", None)
    if made:
        import shutil

        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop("CKGEN_KERNEL_CACHE", None)


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where a GPU is usable; elsewhere they are skipped with the reason."""
    from ckgen.runtime.target import gpu_status

    why = gpu_status()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"no GPU: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_db(tmp_path, monkeypatch):
    """Every test gets its own user DB and cache dir; the user's real DB is never touched."""
    from ckgen import settings

    rocm = settings.rocm_path()  # found through the real cache dir: keep it
    if rocm is not None:
        monkeypatch.setenv("CKGEN_ROCM_PATH", str(rocm))
    monkeypatch.setenv("CKGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CKGEN_DB", str(tmp_path / "cache" / "instances.yaml"))
    # Tests see no shipped DB unless they ask for it (test_shipped_db.py reads the packaged file).
    monkeypatch.setenv("CKGEN_SHIPPED_DB", str(tmp_path / "no-shipped-db.yaml"))
    # Nor a cost model (test_costmodel.py turns it on): the dispatcher's answers stay nearest/default.
    monkeypatch.setenv("CKGEN_MODEL", "off")
    # Nor online tuning (test_online.py turns it on), and nothing tried by another test counts.
    for name in ("CKGEN_TUNE", "CKGEN_TUNE_TRIALS", "CKGEN_TUNE_MAX_S"):
        monkeypatch.delenv(name, raising=False)
    from ckgen.tuner import online
    from ckgen.runtime.dispatch import dispatcher

    online.reset()
    dispatcher().reload()  # the DB paths changed: no choice or launch plan of another test's DB
    yield


@pytest.fixture
def model_on(monkeypatch):
    """The packaged cost model, as a user without CKGEN_MODEL gets it (`_isolated_db` turns it off)."""
    import ckgen
    from ckgen import model as cm

    monkeypatch.delenv("CKGEN_MODEL", raising=False)
    ckgen.reload_db()
    yield cm.load()
    ckgen.reload_db()


@pytest.fixture
def inproc(capsys, monkeypatch):
    """Run the CLI's main() in this process; returns (exit code, stdout, stderr)."""
    from rich.console import Console

    from ckgen import cli

    # A wide stdout console so table cells are not wrapped (the module's is made at import).
    monkeypatch.setattr(cli, "console", Console(soft_wrap=True, width=400))

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


class Hung(BaseException):
    """Raised by `no_hang`'s alarm: not an OSError, which ckgen's readers take for a missing file."""


@pytest.fixture
def no_hang():
    """`with no_hang(5): ...`: fail with Hung instead of blocking for ever (a FIFO opened for
    reading waits for a writer)."""
    import contextlib
    import signal

    @contextlib.contextmanager
    def within(seconds: int = 5):
        def hung(*args):
            raise Hung(f"still blocked after {seconds} s")

        old = signal.signal(signal.SIGALRM, hung)
        signal.alarm(seconds)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)

    return within
