"""The instance library: which instances a target needs (DB winners or defaults), their sources
under generated/<arch>/<op>/, a manifest, and an offline build for every target: NVRTC for CUDA
(cubin, with the compiler's resource report) and clang for HIP (code object). No GPU needed.

manifest.yaml is deterministic (the drift check compares it); report.yaml holds what the
compiler said (registers, spills, shared memory), which depends on the compiler version."""
from __future__ import annotations

import concurrent.futures as cf
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

from . import db as dbmod
from . import settings
from .codegen import KernelSource
from .instance import render_instance
from .ops import all_ops, get_op
from .ops.spec import Config, OpSpec, Target


@dataclass(frozen=True)
class Instance:
    op: str
    target: Target
    config: Config
    source: KernelSource
    problems: tuple[str, ...]  # the problem keys this instance serves

    @property
    def file(self) -> str:
        return f"{self.source.name}.{'hip' if self.target.vendor == 'hip' else 'cu'}"


@dataclass(frozen=True)
class Built:
    instance: Instance
    ok: bool
    message: str  # the compiler's error, or "" when ok
    report: dict[str, Any]  # per kernel symbol: registers, spills, shared memory ...


def _default_for(op: OpSpec, problem: Any, target: Target) -> Config | None:
    for c in [op.space.default, *op.space.by_distance_from_default()]:
        if op.validate(problem, c, target):
            return c
    return None


def _problems(op: OpSpec, db: dbmod.InstanceDB) -> list[Any]:
    dp = op.space.default_problems
    keys = {e.problem for e in db.select(op.name)}
    probs = [op.problem_from_key(k) for k in sorted(keys)]
    if not probs:  # nothing tuned: the space's default problems
        probs = [op.parse_problem(N=s[0], C=s[1], H=s[2], W=s[3], G=s[4], dtype=d, layout=l, activation=a)
                 for s in dp["shapes"] for d in dp["dtypes"] for l in dp["layouts"] for a in dp["activations"]]
    return probs


def plan(targets: Iterable[str], ops: Iterable[str] | None = None, *, from_db: bool = True,
         db: dbmod.InstanceDB | None = None) -> list[Instance]:
    """Instances per target. from_db: each problem of the DB gets the winner tuned for this arch;
    failing that, a winner tuned on another arch that is valid here (nearest arch first); failing
    that, the default. Otherwise (defaults): the default config for every problem."""
    db = db if db is not None else dbmod.InstanceDB.load(dbmod.shipped_db_path())
    op_specs = [get_op(o) for o in ops] if ops else all_ops()
    out: dict[tuple[str, str], Instance] = {}
    for arch in targets:
        target = Target.named(arch)
        for op in op_specs:
            for problem in _problems(op, db):
                config = None
                if from_db:
                    mine = db.lookup(op.name, arch, problem.key())
                    others = sorted((e for e in db.select(op.name) if e.problem == problem.key() and e.arch != arch),
                                    key=lambda e: (e.vendor != target.vendor, e.arch))
                    for e in ([mine] if mine else []) + others:
                        cfg = Config.of(e.config_dict())
                        if op.validate(problem, cfg, target):
                            config = cfg
                            break
                config = config or _default_for(op, problem, target)
                if config is None:
                    continue
                src = render_instance(op, problem, config, target)
                key = (arch, src.name)
                prev = out.get(key)
                probs = tuple(sorted({*(prev.problems if prev else ()), problem.key()}))
                out[key] = Instance(op.name, target, config, src, probs)
    return [out[k] for k in sorted(out)]


def write(instances: list[Instance], root: Path) -> list[Path]:
    """Sources and one manifest.yaml per <arch>/<op>; returns the files written."""
    written: list[Path] = []
    groups: dict[tuple[str, str], list[Instance]] = {}
    for inst in instances:
        groups.setdefault((inst.target.arch, inst.op), []).append(inst)
    for (arch, op), insts in sorted(groups.items()):
        folder = root / arch / op
        folder.mkdir(parents=True, exist_ok=True)
        for inst in insts:
            (folder / inst.file).write_text(inst.source.code)
            written.append(folder / inst.file)
        manifest = {"op": op, "target": {"arch": arch, "vendor": insts[0].target.vendor},
                    "instances": [{"instance": i.source.name, "file": i.file, "config": i.config.as_dict(),
                                   "problems": list(i.problems), "source_sha256": i.source.sha256,
                                   "template": i.source.template} for i in insts]}
        (folder / "manifest.yaml").write_text("# generated by ckgen generate, do not edit\n"
                                              + yaml.safe_dump(manifest, sort_keys=True))
        written.append(folder / "manifest.yaml")
    return written


# ---- building ----------------------------------------------------------------------------
_PTXAS = re.compile(r"Function properties for (\S+)\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
                    r"(\d+) bytes spill loads\n.*?Used (\d+) registers.*?(\d+) bytes smem", re.S)


def _build_cuda(inst: Instance) -> Built:
    from cupy.cuda import nvrtc

    from .compile import NVRTC_OPTIONS

    prog = nvrtc.createProgram(inst.source.code, inst.file, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={inst.target.arch}", *NVRTC_OPTIONS,
                                        "--ptxas-options=-v"])
        except nvrtc.NVRTCError:
            return Built(inst, False, nvrtc.getProgramLog(prog).strip()[-2000:], {})
        log = nvrtc.getProgramLog(prog)
        if not nvrtc.getCUBIN(prog):
            return Built(inst, False, "empty cubin", {})
    finally:
        nvrtc.destroyProgram(prog)
    report = {m[0]: {"registers": int(m[4]), "spill_stores": int(m[2]), "spill_loads": int(m[3]),
                     "stack_bytes": int(m[1]), "smem_bytes": int(m[5])} for m in _PTXAS.findall(log)}
    return Built(inst, True, "", report)


def hip_toolchain() -> tuple[str, Path, Path] | None:
    """(clang++, ROCm root with include/hip, device bitcode dir), or None. `tools/hip-check`
    installs one into the cache dir; $CKGEN_ROCM_PATH points at another ROCm root."""
    clang = shutil.which(os.environ.get("CKGEN_HIP_CLANG", "clang++-19"))
    root = settings.rocm_path()
    if not clang or root is None or not (root / "include" / "hip" / "hip_runtime.h").is_file():
        return None
    bitcode = next((p.parent for p in root.rglob("oclc_isa_version_900.bc")), None)
    return (clang, root, bitcode) if bitcode else None


_HIPRES = re.compile(r"Function Name: (\S+).*?SGPRs: (\d+).*?VGPRs: (\d+).*?ScratchSize \[bytes/lane\]: (\d+)"
                     r".*?LDS Size \[bytes/block\]: (\d+)", re.S)


def _build_hip(inst: Instance) -> Built:
    tc = hip_toolchain()
    if tc is None:
        return Built(inst, False, "no HIP toolchain: run tools/hip-check once (installs clang-19 + ROCm "
                                  "headers/bitcode into the cache dir) or set CKGEN_ROCM_PATH", {})
    clang, root, bitcode = tc
    with tempfile.TemporaryDirectory() as d:
        src, obj = Path(d) / inst.file, Path(d) / "kernel.co"
        src.write_text(inst.source.code)
        cmd = [clang, "-x", "hip", "-std=c++17", "-O3", "--cuda-device-only", "--no-gpu-bundle-output",
               f"--offload-arch={inst.target.arch}", f"--rocm-path={root}", f"--rocm-device-lib-path={bitcode}",
               "-isystem", str(root / "include"), "-Rpass-analysis=kernel-resource-usage", "-c", str(src),
               "-o", str(obj)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode or not obj.is_file():
            return Built(inst, False, r.stderr.strip()[-2000:], {})
    report = {m[0]: {"sgprs": int(m[1]), "vgprs": int(m[2]), "scratch_bytes_per_lane": int(m[3]),
                     "lds_bytes": int(m[4])} for m in _HIPRES.findall(r.stderr)}
    return Built(inst, True, "", report)


def build(instances: list[Instance], jobs: int | None = None) -> list[Built]:
    """Compile every instance for its target (threads: NVRTC and clang run outside the GIL)."""
    jobs = jobs or max(1, (os.cpu_count() or 2))
    with cf.ThreadPoolExecutor(jobs) as ex:
        return list(ex.map(lambda i: _build_hip(i) if i.target.vendor == "hip" else _build_cuda(i), instances))


def write_reports(built: list[Built], root: Path) -> None:
    groups: dict[tuple[str, str], list[Built]] = {}
    for b in built:
        groups.setdefault((b.instance.target.arch, b.instance.op), []).append(b)
    for (arch, op), bs in sorted(groups.items()):
        doc = {b.instance.source.name: ({"ok": True, "kernels": b.report} if b.ok else {"ok": False, "error": b.message})
               for b in bs}
        (root / arch / op / "report.yaml").write_text(
            "# compiler report of `ckgen generate` (depends on the compiler version; not drift-checked)\n"
            + yaml.safe_dump(doc, sort_keys=True))


def drift(root: Path, fresh: Path) -> list[str]:
    """Files (sources and manifests) that differ between two library folders."""
    def files(base: Path) -> dict[str, bytes]:
        return {str(p.relative_to(base)): p.read_bytes() for p in base.rglob("*")
                if p.is_file() and p.name != "report.yaml"}
    a, b = files(root), files(fresh)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
