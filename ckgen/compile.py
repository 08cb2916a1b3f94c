"""Compile rendered kernels: offline to a cubin for a named arch (no GPU needed), or into a
CuPy RawModule on the current device, cached per (device, instance source)."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .codegen import KernelSource
from .ops.spec import Target

NVRTC_OPTIONS = ("-std=c++17", "--use_fast_math")


class CompileError(RuntimeError):
    """A kernel failed to compile; `log` holds the compiler's message."""

    def __init__(self, name: str, log: str):
        super().__init__(f"{name}: compile failed\n{log}")
        self.name = name
        self.log = log


@dataclass(frozen=True)
class Binary:
    name: str
    arch: str
    cubin: bytes
    log: str


def compile_offline(src: KernelSource, target: Target) -> Binary:
    """NVRTC -> cubin for `target.arch`. Works without a GPU (only libnvrtc is needed)."""
    if target.vendor != "cuda":
        raise ValueError(f"target: offline compile of {target.vendor} sources is not supported here")
    from cupy.cuda import nvrtc  # the NVRTC binding works without a device

    prog = nvrtc.createProgram(src.code, f"{src.name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={target.arch}", *NVRTC_OPTIONS])
        except nvrtc.NVRTCError:
            raise CompileError(src.name, nvrtc.getProgramLog(prog)) from None
        return Binary(src.name, target.arch, nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


_cache: dict[tuple[int, str], Any] = {}
_lock = threading.Lock()


def load_kernel(src: KernelSource) -> Any:
    """A cupy.RawKernel for `src` on the current device (compiled once per device and source)."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (dev, src.sha256)
    with _lock:
        kern = _cache.get(key)
    if kern is not None:
        return kern
    try:
        mod = cupy.RawModule(code=src.code, options=NVRTC_OPTIONS, name_expressions=None)
        kern = mod.get_function(src.name)
        kern.compile()
    except cupy.cuda.compiler.CompileException as e:
        raise CompileError(src.name, str(e)) from None
    with _lock:
        _cache[key] = kern
    return kern


def _prewarm_one(code: str, name: str) -> str | None:
    import cupy

    try:
        cupy.RawModule(code=code, options=NVRTC_OPTIONS).get_function(name).compile()
        return None
    except Exception as e:  # reported, not raised: the caller compiles again and sees it
        return f"{name}: {e}"


def prewarm(sources: list[KernelSource], workers: int = 8) -> list[str]:
    """Compile many sources in parallel processes so that CuPy's on-disk kernel cache holds
    them; later `load_kernel` calls in this process then only load. Returns failures."""
    import concurrent.futures as cf
    import multiprocessing as mp

    uniq = {s.sha256: s for s in sources}
    if len(uniq) < 4 or workers < 2:
        return []
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        out = ex.map(_prewarm_one, [s.code for s in uniq.values()], [s.name for s in uniq.values()])
        return [r for r in out if r]
