"""The tuning records the package ships (ckgen/data/records.jsonl.gz), built from what the repo
holds: the exhaustive sweeps (tests/data/sweeps), every trial of the DB tuning runs
(bench/results/tuning), the shipped DB's winners and default timings, and the suite benchmarks
(bench/results/*.json), never the held-out problems (bench/heldout.yaml). `tools/build_records.py`
writes them and refits the cost model on them. An offline job: it reads the DB and the sweeps,
which the records format itself (ckgen/model/records.py) does not need."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..model.records import SWEEP_SOURCE, legacy_kernel_version, make_record, read
from ..ops import all_ops, get_op
from ..ops.spec import Config, OpSpec, Problem, Target
from ..runtime import db as dbmod
from ..tuner.replay import load_sweep, sweep_paths


def _config_of_instance(op: OpSpec, p: Problem, target: Target, instance: str) -> Config | None:
    """The valid config whose instance name is `instance` (benchmarks record only the name)."""
    for c in op.space.enumerate():
        if op.validate(p, c, target) and op.instance_name(p, c) == instance:
            return c
    return None


def build_shipped(repo: Path | str) -> list[dict[str, Any]]:
    """The records the package ships, from the repo's measurements (see the module doc):
    sweeps (every config measured), the shipped DB (winner and default of each problem), and
    the suite benchmarks (ckgen's pick per shape). Held-out problems are dropped. Sorted, so a
    rebuild gives the same file."""
    repo = Path(repo)
    heldout = _heldout_keys(repo)
    out: list[dict[str, Any]] = []
    for path in sweep_paths(repo / "tests" / "data" / "sweeps"):
        sw = load_sweep(path)
        src = f"{SWEEP_SOURCE}{path.name}"
        for cfg, t in sw.times.items():
            out.append(_legacy(make_record(sw.op, sw.problem, sw.target, sw.device, cfg, ok=True, time_us=t,
                                           phase="sweep", source=src, date="2025-01-01T00:00:00+00:00")))
        for cfg, why in sw.failed.items():
            out.append(_legacy(make_record(sw.op, sw.problem, sw.target, sw.device, cfg, ok=False, reason=why,
                                           phase="sweep", source=src, date="2025-01-01T00:00:00+00:00")))
    for path in sorted((repo / "bench" / "results" / "tuning").glob("*.records.jsonl*")):
        out += read(path)  # every trial of the repo's DB tuning runs (bench/tune_db.sh), as measured
    shipped = dbmod.InstanceDB.load(repo / "ckgen" / "data" / "instances.yaml")
    for e in shipped.entries:
        op, target = get_op(e.op), Target.named(e.arch)
        p = op.problem_from_key(e.problem)
        date = e.date or "2025-01-01T00:00:00+00:00"
        # a re-timed entry's time was measured when it was re-timed (tools/retime-entries.py): the
        # winner's record says so (its kernel_version follows from that date);
        # its default time is the tuning run's
        retimed = e.provenance_dict().get("retimed")
        out.append(_legacy(make_record(op, p, target, e.device, Config.of(e.config_dict()), ok=True,
                                       time_us=e.time_us, phase="winner", source="ckgen/data/instances.yaml",
                                       date=retimed if isinstance(retimed, str) else date)))
        if e.default_time_us > 0:
            # the tuner's "default": the space default, or the valid config nearest it
            d = op.space.nearest_default(lambda c: bool(op.validate(p, c, target)))
            if d is not None:
                out.append(_legacy(make_record(op, p, target, e.device, d, ok=True, time_us=e.default_time_us,
                                               phase="default", source="ckgen/data/instances.yaml", date=date)))
    for path in sorted((repo / "bench" / "results").glob("*.json")):
        if path.name.startswith(("heldout", "host_overhead", "models")):
            continue  # held-out problems; host-only timings; whole-model timings
        doc = json.loads(path.read_text())
        device, arch = doc.get("device", ""), "sm_90" if "H100" in str(doc.get("device", "")) else None
        if not arch or not isinstance(doc.get("rows"), list):
            continue
        target = Target.named(arch)
        default_op = path.name.split("-")[0]
        for row in doc["rows"]:
            name = row.get("op", default_op)
            if name not in {o.name for o in all_ops()} or "instance" not in row or "ckgen_us" not in row:
                continue
            op = get_op(name)
            p = op.problem_from_key(row["problem"])
            cfg = _config_of_instance(op, p, target, row["instance"])
            if cfg is None:  # an instance of an older space: its config is not known today
                continue
            out.append(_legacy(make_record(op, p, target, device, cfg, ok=True, time_us=float(row["ckgen_us"]),
                                           phase="bench", source=f"bench/results/{path.name}",
                                           date="2026-11-23T00:00:00+00:00")))
    out = [r for r in out if (r["op"], r["problem"]) not in heldout]
    out.sort(key=lambda r: (r["op"], r["arch"], r["problem"], r["phase"], json.dumps(r["config"], sort_keys=True),
                            r.get("time_us", 0.0), r["source"]))
    return out


def _legacy(rec: dict[str, Any]) -> dict[str, Any]:
    """A record of the repo's measurements (sweeps, the shipped DB, benchmarks), which say when
    they were timed but not with which kernels: its kernel_version by the legacy migration."""
    rec["kernel_version"] = legacy_kernel_version(rec)
    return rec


def _heldout_keys(repo: Path) -> set[tuple[str, str]]:
    """(op, problem key) of every held-out problem of bench/heldout.yaml."""
    import importlib.util

    path = repo / "bench" / "heldout.py"
    if not path.exists():
        return set()
    spec = importlib.util.spec_from_file_location("_ckgen_heldout", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    keys = set()
    for case in mod.load_cases(repo / "bench" / "heldout.yaml"):
        op, p = mod.problem_of(case)
        keys.add((op.name, p.key()))
    return keys
