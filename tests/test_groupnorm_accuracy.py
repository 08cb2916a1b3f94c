"""GroupNorm forward: the limit on serial fp32 adds per thread (MAX_SERIAL_ADDS), checked two ways.

1. A float32 emulation of what slice_in=reload does in NHWC (each thread sums its channel's
   values, shifted by one sample of the group, one pixel row after another; then the block adds
   the per-channel sums; mean = shift + sum / count), against the float64 mean: at the limit the
   error stays well inside the mean's tolerance, far past it it does not (the H100 sweep of
   1x256x256x256 bf16 NHWC fails verification exactly on the configs with 32,768 and 65,536
   serial adds: tests/data/sweeps/sweep-groupnorm_fwd-nhwc-1x256x256x256-*.json).
2. validate() rejects every config over the limit and only those (the sweep's failures among them)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ckgen.ops import get_op
from ckgen.ops.groupnorm import MAX_SERIAL_ADDS
from ckgen.tuner.replay import read_sweep_doc, sweep_paths
from ckgen.types import Target

SWEEPS = Path(__file__).resolve().parent / "data" / "sweeps"
T90 = Target.named("sm_90")


def emulated_mean_error(serial: int, groups: int = 4, seed: int = 3) -> float:
    """Worst |mean - exact| / tolerance over `groups` groups of 8 bf16 channels x `serial` pixels,
    each channel summed serially in float32 as one thread of the kernel does (R = 1)."""
    op = get_op("groupnorm_fwd")
    p = op.problem_from_key(f"N=1,C={8 * groups},H={serial},W=1,G={groups},dtype=bf16,layout=nhwc,act=none")
    x = op.make_inputs(p, np.random.default_rng(seed))["x"][0].reshape(8 * groups, serial)
    tol = op.tolerance("bf16", "mean")
    worst = 0.0
    for g in range(groups):
        xg = x[8 * g:8 * g + 8]
        exact = xg.mean()
        k = np.float32(xg[0, 0])
        per_channel = np.cumsum(xg.astype(np.float32) - k, axis=1, dtype=np.float32)[:, -1]  # serial adds
        s1 = np.float32(0)
        for v in per_channel:  # the block's sum over channels, in fp32
            s1 = np.float32(s1 + v)
        mean = np.float32(k + np.float32(s1 / np.float32(8 * serial)))
        worst = max(worst, abs(float(mean) - exact) / (tol.atol + tol.rtol * abs(exact)))
    return worst


def test_serial_fp32_sum_at_the_limit_is_accurate_and_far_past_it_is_not():
    at = emulated_mean_error(MAX_SERIAL_ADDS)
    far = emulated_mean_error(8 * MAX_SERIAL_ADDS)
    assert at <= 0.5, f"{MAX_SERIAL_ADDS} serial adds: mean error {at:.2f}x its tolerance"
    assert far > 2 * at, f"8x the limit: {far:.2f}x vs {at:.2f}x at the limit (the limit would not matter)"


def _serial_adds(p, c) -> int:
    """Independent of validate(): the adds one thread makes into one accumulator (reload)."""
    vec = c["vec_bytes"] // {"fp32": 4, "fp16": 2, "bf16": 2}[p.dtype]
    split = c["cluster"] if c["merge"] == "cluster" else c["global_split"]
    if vec == 0:
        return 0  # a vector narrower than one element: invalid for another reason
    if p.layout == "nchw":
        share = -(-(p.Cg * p.HW // vec) // split)  # vectors per block
        return -(-share // c["threads"]) * vec
    cols = c["groups_per_block"] * p.Cg // vec
    rows = c["threads"] // cols if cols else 0
    if rows == 0:
        return 0  # more columns than threads: invalid for another reason
    return -(-(-(-p.HW // split)) // rows)


@pytest.mark.parametrize("key", [
    "N=1,C=256,H=256,W=256,G=32,dtype=bf16,layout=nhwc,act=none",
    "N=1,C=4,H=1024,W=1024,G=2,dtype=bf16,layout=nchw,act=none",
    "N=1,C=32,H=512,W=512,G=1,dtype=fp32,layout=nhwc,act=none",
])
def test_validate_rejects_exactly_the_reload_configs_over_the_limit(key):
    op = get_op("groupnorm_fwd")
    p = op.problem_from_key(key)
    over = under = 0
    for c in op.space.enumerate():
        if c["slice_in"] != "reload":
            continue
        ok = op.validate(p, c, T90)
        if _serial_adds(p, c) > MAX_SERIAL_ADDS:
            over += 1
            assert not ok, f"{c.key()}: {_serial_adds(p, c)} serial adds accepted"
        elif ok:
            under += 1
        else:
            assert "serially" not in ok.reason, f"{c.key()}: rejected for serial adds at {_serial_adds(p, c)}"
    assert over and under, (over, under)  # the problem exercises both sides


def test_the_sweeps_verification_failures_are_now_invalid():
    op = get_op("groupnorm_fwd")
    paths = sweep_paths(SWEEPS, "sweep-groupnorm_fwd-nhwc-1x256x256x256-*")
    assert paths, "the large NHWC GroupNorm-forward sweep is missing"
    doc = read_sweep_doc(paths[0])
    p = op.problem_from_key(doc["problem"])
    failed = [c for c, why in doc["failed"] if "mean" in why]
    assert failed
    from ckgen.types import Config
    assert all(not op.validate(p, Config.of(c), T90) for c in failed)
    # ... and the sweep's best configs all stay valid
    assert all(op.validate(p, Config.of(r[2]), T90) for r in doc["rows"][:50])
