"""The held-out list of bench/heldout.yaml is what it claims: valid problems of every public op,
dtype and layout, none of them in the shipped instance DB (for any arch)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ckgen.runtime import db as dbmod

ROOT = Path(__file__).resolve().parent.parent


def _heldout():
    spec = importlib.util.spec_from_file_location("heldout", ROOT / "bench" / "heldout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_heldout_problems_are_valid_and_cover_every_op_dtype_layout():
    h = _heldout()
    cases = h.load_cases()
    assert len(cases) >= 40
    problems = [h.problem_of(c) for c in cases]
    keys = [(op.name, p.key()) for op, p in problems]
    assert len(set(keys)) == len(keys), "a held-out problem is listed twice"
    ops = {op.name for op, _ in problems}
    assert ops == {"groupnorm_fwd", "groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta",
                   "maxpool2d_fwd", "maxpool2d_bwd", "avgpool2d_fwd", "avgpool2d_bwd"}
    assert {p.dtype for _, p in problems} == {"fp32", "fp16", "bf16"}
    assert {p.layout for _, p in problems} == {"nchw", "nhwc"}


def test_no_heldout_problem_is_in_the_shipped_db():
    h = _heldout()
    shipped = dbmod.InstanceDB.load(dbmod.packaged_db_path())
    tuned = {(e.op, e.problem) for e in shipped.entries}
    assert tuned, "the packaged DB is empty: this test would check nothing"
    for case in h.load_cases():
        op, p = h.problem_of(case)
        assert (op.name, p.key()) not in tuned, f"held-out {op.name} {p.key()} is in the shipped DB"
