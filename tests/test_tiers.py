"""The test run itself (tests/conftest.py, tests/tiers.py): a run ends with its CPU time, a
machine without a GPU gets the GPU tier's skips in one line, and a SWEEP check runs its sample in
the fast tier and its whole sweep in the quality tier."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SWEEP_TEST = '''
import pytest
from tiers import SWEEP


@pytest.mark.parametrize("full", SWEEP)
def test_sweep(full):
    assert isinstance(full, bool)
'''
GPU_TEST = '''
import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("k", range(3))
def test_on_a_gpu(k):
    assert k >= 0
'''


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest on a sample test folder with the suite's conftest.py and tiers.py."""
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "test_on_a_gpu.py").write_text(GPU_TEST)
    (tmp_path / "test_sweep.py").write_text(SWEEP_TEST)
    for name in ("conftest.py", "tiers.py"):
        shutil.copy(TESTS / name, tmp_path / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n    quality: the quality tier\n"
                                         "addopts = -ra -p no:cacheprovider\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(tmp_path)])}
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_run_ends_with_its_cpu_time_and_one_line_of_gpu_skips(tmp_path):
    from ckgen.runtime.target import gpu_status

    r = _run(tmp_path, "-m", "not quality", "-n", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("CPU time: "))
    assert re.fullmatch(r"CPU time: \d+ s in \d+ s wall \(2 worker processes, .*\)", line), line
    assert "1 passed" in r.stdout.splitlines()[-1]  # the sample; the whole sweep is the quality tier's
    if gpu_status() is not None:  # no GPU here: the three GPU tests, skipped, in one line
        skips = [ln for ln in r.stdout.splitlines() if ln.startswith("SKIPPED")]
        assert len(skips) == 1 and skips[0].startswith("SKIPPED [3] gpu: no GPU: "), skips


def test_a_sweep_runs_whole_in_the_quality_tier_only(tmp_path):
    r = _run(tmp_path, "-m", "quality", "-n", "0", "--collect-only", "-q")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [ln for ln in r.stdout.splitlines() if "::" in ln] == ["test_sweep.py::test_sweep[full]"]
