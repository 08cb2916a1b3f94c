"""Compile rendered kernels.

- `compile_offline`: NVRTC -> cubin for a named arch. Needs only libnvrtc, no GPU, no CUDA
  context, so it runs in CI and in worker processes.
- `compile_many`: the same for many sources, in parallel processes (compile is the slow part
  of tuning), deduplicated by source hash, each result stored in the on-disk cubin cache.
- `load_kernel`: a CuPy kernel for the current device: memory cache, then the disk cache
  (`<cache>/kernels/<arch>/<name>-<sha12>.cubin`, or `$CKGEN_KERNEL_CACHE/<arch>/...`), then NVRTC.

The disk cache may be shared by several users: its files are created with the umask's mode (as
the DB's are), an entry this process cannot read is compiled again (and replaced where it can
be), and a cache folder that cannot take a cubin (a file in its place, read-only, a parent that
cannot be created) costs one KernelCacheWarning: kernels are then compiled and used without it."""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import multiprocessing as mp
import os
import secrets
import shutil
import struct
import tempfile
import threading
import warnings
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


class KernelCacheWarning(UserWarning):
    """The kernel cache folder cannot hold compiled kernels (not a folder, not writable, its parent
    cannot be created): kernels are compiled and used without it, in this process only."""


_warned: set[str] = set()
_fallback_dir: Path | None = None  # this process's private folder for cubins the cache cannot hold
_fallback_lock = threading.Lock()


def _warn_unusable(folder: Path, e: OSError) -> None:
    key = str(folder)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(f"ckgen kernel cache {folder}: {e.__class__.__name__}: {e.strerror or e}; compiled kernels are "
                  f"kept in this process only (set ${settings.ENV_KERNEL_CACHE} to a writable folder to keep them)",
                  KernelCacheWarning, stacklevel=4)


def _new_temp(folder: Path) -> tuple[int, Path]:
    """A new temp file in `folder`, opened for writing, created with mode 0666 so that the umask
    applies as to any new file: tempfile's 0600 made every cubin private to its writer, and a
    cache shared by two users failed for the second (the DB saves do the same, ckgen/db.py)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = folder / f".tmp-{secrets.token_hex(8)}"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


def _store(path: Path, data: bytes) -> bool:
    """Write `data` to `path` atomically (readers never see a partial cubin); False, with one
    KernelCacheWarning per folder, where the cache cannot take it."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _new_temp(path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        _warn_unusable(path.parent, e)
        return False


def _read(path: Path) -> bytes | None:
    """The cached cubin at `path`, or None for a miss: missing, or unreadable (another user's
    private file, a folder in its place): such an entry is compiled again, not fatal."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _cached(path: Path) -> bool:
    """Is the cache entry at `path` there and readable (no read of its contents)?"""
    try:
        os.close(os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
    except OSError:
        return False
    return path.is_file()


def _fallback_path(path: Path, data: bytes) -> Path:
    """`data` in this process's private folder (removed at exit), for a loader that needs a file
    where the cache could not take it."""
    global _fallback_dir
    with _fallback_lock:
        if _fallback_dir is None:
            _fallback_dir = Path(tempfile.mkdtemp(prefix="ckgen-kernels-"))
            atexit.register(shutil.rmtree, _fallback_dir, True)
        out = _fallback_dir / path.parent.name / path.name
        if not out.is_file():
            out.parent.mkdir(exist_ok=True)
            tmp = out.with_name(f".tmp-{secrets.token_hex(8)}")
            tmp.write_bytes(data)
            os.replace(tmp, out)
        return out


def cubin_bytes(src: KernelSource, target: Target) -> bytes:
    """The cubin of (src, arch): the disk cache's, else compiled (NVRTC) and stored there. An
    unreadable entry is a miss; a cache that cannot take the cubin gives one KernelCacheWarning
    and the bytes are returned all the same. Raises CompileError."""
    path = cubin_path(src, target.arch)
    data = _read(path)
    if data is None:
        data = compile_offline(src, target).cubin
        _store(path, data)
    return data


def ensure_cubin(src: KernelSource, target: Target) -> Path:
    """A readable file holding the cubin of (src, arch), compiling it if missing or unreadable:
    the cached one, else (a cache that cannot take it: one KernelCacheWarning) a copy in this
    process's private folder. Raises CompileError."""
    path = cubin_path(src, target.arch)
    if _cached(path):
        return path
    data = compile_offline(src, target).cubin
    return path if _store(path, data) else _fallback_path(path, data)


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
    todo = {s.sha256: s for s in sources if not _cached(cubin_path(s, target.arch))}
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
