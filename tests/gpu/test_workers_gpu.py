"""GPU tier: `ckgen tune --workers 2` end to end on the device. Two worker processes
(placed round-robin on the visible GPUs: both on GPU 0 where there is one GPU), 4 small GroupNorm
backward problems, 6 trials each, a fresh kernel cache (every candidate compiles in the workers'
NVRTC pools) and fresh SQLite storage, the whole command under a time bound: a worker that never
exits (its compile pool left running, as before the fix) fails the test instead of hanging it.
Checked: the command's JSON (every problem, both workers alive to the end), the DB it wrote (an
entry per problem, for this GPU, verified against today's templates, with the run's trials), and
the storage (each problem got exactly its budget, and both workers measured)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

cupy = pytest.importorskip("cupy")
optuna = pytest.importorskip("optuna")

from ckgen import cli  # noqa: E402
from ckgen.runtime import db as dbmod  # noqa: E402
from ckgen.tuner import tune  # noqa: E402
from ckgen.tuner import workers as wk  # noqa: E402
from ckgen.ops import get_op  # noqa: E402
from ckgen.runtime.target import device_info  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
OP = "groupnorm_bwd"
PROBLEM_ARGS = ["--shape", "2,64,16,16", "--groups", "8", "--dtype", "bf16", "--dtype", "fp16",
                "--layout", "nchw", "--layout", "nhwc"]  # 4 problems
TRIALS = 6
BOUND_S = 540  # the command takes about a minute; the test stops it (and its workers) past this


def _exclusive_single_gpu() -> str | None:
    """Why two processes cannot share this machine's only GPU, if so (an exclusive compute mode)."""
    devices = wk.visible_devices()
    if len(devices) != 1:
        return None
    mode = cupy.cuda.Device(0).attributes.get("ComputeMode", 0)
    return None if mode == 0 else f"one GPU, in compute mode {mode} (not shared): two workers cannot both use it"


def test_tune_with_two_workers_writes_every_entry(tmp_path):
    why = _exclusive_single_gpu()
    if why:
        pytest.skip(why)
    db = tmp_path / "tuned.yaml"
    storage = f"sqlite:///{tmp_path / 'studies.sqlite3'}"
    env = {**os.environ, "CKGEN_CACHE_DIR": str(tmp_path / "cache"), "CKGEN_KERNEL_CACHE": str(tmp_path / "kernels"),
           "CKGEN_DB": str(db)}
    cmd = [sys.executable, "-m", "ckgen", "tune", OP, *PROBLEM_ARGS, "--trials", str(TRIALS), "--workers", "2",
           "--db", str(db), "--storage", storage, "--format", "json"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # a session of its own: on a timeout the command, its workers and their pools are killed together
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert proc.returncode != -signal.SIGKILL, f"`{' '.join(cmd[1:])}` did not end within {BOUND_S} s\n{stderr[-4000:]}"
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{stderr[-4000:]}"
    doc = json.loads(stdout)
    op = get_op(OP)
    info = device_info(None)
    problems = sorted(p.key() for p in cli._problems(op, cli.parser().parse_args(["tune", OP, *PROBLEM_ARGS])))
    assert len(problems) == 4
    assert doc["workers"] == 2 and doc["died"] == [], stderr[-4000:]
    rows = {r["problem"]: r for r in doc["results"]}
    assert sorted(rows) == problems, stderr[-4000:]
    assert all(r["time_us"] > 0 for r in rows.values())

    entries = {e.problem: e for e in dbmod.InstanceDB.load(db).entries}
    assert sorted(entries) == problems
    for key, e in entries.items():
        assert e.op == OP and e.device == info.name and e.arch == info.target.arch, e
        assert e.instance == rows[key]["instance"]
        assert dbmod.entry_verified(e), f"{key}: the entry's source does not render from today's templates"
        assert e.time_us > 0 and e.provenance_dict()["trials"] == TRIALS, e.provenance_dict()

    workers = set()
    storage_obj = optuna.storages.RDBStorage(storage)
    for key in problems:
        study = optuna.load_study(study_name=tune.study_name(op, op.problem_from_key(key), info.target, info.name),
                                  storage=storage_obj)
        spent = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(wk.RUN_ATTR) and wk._counted(t)]
        assert len(spent) == TRIALS, (key, len(spent))  # the run's budget, exactly
        workers |= {t.user_attrs[wk.WORKER_ATTR] for t in spent}
    assert len(workers) == 2, f"trials measured by {sorted(workers)}: one worker did all the work"
