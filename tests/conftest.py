import os

import pytest

# numpy's BLAS in one thread: the cost-model fits are small matrix products, and on CI's 2 cores
# (shared with the tests' workers and servers) a second BLAS thread spins more than it helps.
# Set before numpy is imported (the test modules import it, after this file).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


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
