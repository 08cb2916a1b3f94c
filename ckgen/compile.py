"""Compile rendered kernels.

- `compile_offline`: NVRTC -> cubin for a named arch. Needs only libnvrtc, no GPU, no CUDA
  context, so it runs in CI and in worker processes.
- `compile_many`: the same for many sources, in parallel processes (compile is the slow part
  of tuning), deduplicated by source hash, each result stored in the on-disk cubin cache.
- `load_kernel`: a CuPy kernel for the current device: memory cache, then the disk cache
  (`<cache>/kernels/<arch>/<name>-<sha12>.cubin`, or `$CKGEN_KERNEL_CACHE/<arch>/...`), then NVRTC."""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import multiprocessing as mp
import os
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import settings
from .codegen import KernelSource
from .types import Target

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


_EIATTR_FRAME_SIZE = 0x11  # .nv.info attribute: a function's stack frame, bytes per thread
_EIATTR_REGCOUNT = 0x2F  # .nv.info attribute: a function's registers per thread


def cubin_resources(cubin: bytes) -> dict[str, int] | None:
    """What the cubin's ELF `.nv.info` section says of its functions, the largest over them:
    "registers" per thread (EIATTR_REGCOUNT) and "stack_bytes", the stack frame ptxas -v reports
    (EIATTR_FRAME_SIZE); None if the cubin cannot be read. ckgen's kernels keep no local arrays,
    so a frame is spill space: over the 861 sm_90 kernels of generated/, frame > 0 exactly where
    ptxas reports spill stores."""
    keys = {_EIATTR_REGCOUNT: "registers", _EIATTR_FRAME_SIZE: "stack_bytes"}
    try:
        if cubin[:4] != b"\x7fELF" or cubin[4] != 2:  # 64-bit ELF
            return None
        shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
        heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
        strtab = heads[shstrndx][4]
        out: dict[str, int] | None = None
        for h in heads:
            start = strtab + h[0]
            if cubin[start:cubin.index(b"\0", start)] != b".nv.info":
                continue
            data, i, out = cubin[h[4]:h[4] + h[5]], 0, dict.fromkeys(keys.values(), 0)
            while i + 4 <= len(data):
                fmt, attr = data[i], data[i + 1]
                if fmt == 4:  # EIFMT_SVAL: u16 size, payload (these: u32 symbol, u32 value)
                    size = struct.unpack_from("<H", data, i + 2)[0]
                    if attr in keys and size >= 8:
                        out[keys[attr]] = max(out[keys[attr]], struct.unpack_from("<I", data, i + 8)[0])
                    i += 4 + size
                else:  # EIFMT_NVAL / BVAL / HVAL: two bytes of value
                    i += 4
        return out
    except (struct.error, ValueError, IndexError):
        return None


def frame_bytes(cubin: bytes) -> int | None:
    """The largest stack frame (bytes per thread) of the cubin's functions (`cubin_resources`),
    spill space for ckgen's kernels; None if the cubin cannot be read."""
    res = cubin_resources(cubin)
    return None if res is None else res["stack_bytes"]


def cubin_path(src: KernelSource, arch: str) -> Path:
    return settings.kernel_cache_dir() / arch / f"{src.name}-{src.sha256[:12]}.cubin"


def _store(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: readers never see a partial cubin
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_cubin(src: KernelSource, target: Target) -> Path:
    """The cached cubin for (src, arch), compiling it if missing. Raises CompileError."""
    path = cubin_path(src, target.arch)
    if not path.is_file():
        _store(path, compile_offline(src, target).cubin)
    return path


def _worker(args: tuple[KernelSource, Target]) -> str | None:
    src, target = args
    try:
        ensure_cubin(src, target)
        return None
    except CompileError as e:
        return f"{src.name}: {e.log.strip()[-400:]}"


_pool: cf.ProcessPoolExecutor | None = None


def compile_many(sources: list[KernelSource], target: Target, workers: int | None = None) -> dict[str, str]:
    """Compile every source (deduplicated by hash) into the disk cache, in parallel.
    Returns {instance name: compiler message} for those that failed; the rest are cached."""
    global _pool
    todo = {s.sha256: s for s in sources if not cubin_path(s, target.arch).is_file()}
    if not todo:
        return {}
    workers = workers or max(1, min(16, (os.cpu_count() or 2) - 1))
    if len(todo) == 1 or workers == 1:
        out = [_worker((s, target)) for s in todo.values()]
    else:
        if _pool is None:
            _pool = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
            atexit.register(_pool.shutdown)  # before interpreter teardown, not during it
        out = list(_pool.map(_worker, [(s, target) for s in todo.values()]))
    return {msg.split(":", 1)[0]: msg for msg in out if msg}


_cache: dict[tuple[int, str, str], Any] = {}
_lock = threading.Lock()


def load_kernel(src: KernelSource, target: Target | None = None, symbol: str | None = None) -> Any:
    """A CuPy kernel `symbol` (default: the instance name) of `src` on the current device;
    each source is compiled once per arch, each module loaded once per device."""
    import cupy

    from .target import device_info

    dev = cupy.cuda.Device().id
    symbol = symbol or src.name
    key = (dev, src.sha256, symbol)
    with _lock:
        kern = _cache.get(key)
    if kern is not None:
        return kern
    target = target or device_info(dev).target
    if target.vendor == "cuda":
        path = ensure_cubin(src, target)
        kern = cupy.RawModule(path=str(path)).get_function(symbol)
    else:  # ROCm builds of CuPy: hiprtc through RawModule (not exercised here: no AMD GPU)
        try:
            kern = cupy.RawModule(code=src.code, options=("-std=c++17",)).get_function(symbol)
        except cupy.cuda.compiler.CompileException as e:
            raise CompileError(src.name, str(e)) from None
    with _lock:
        _cache[key] = kern
    return kern
