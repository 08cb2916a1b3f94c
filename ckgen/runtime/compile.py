"""Compile rendered kernels.

- `compile_offline`: NVRTC -> cubin for a named arch. Needs only libnvrtc, no GPU, no CUDA
  context, so it runs in CI and in worker processes.
- `compile_many`: the same for many sources, in parallel processes (compile is the slow part
  of tuning), deduplicated by source hash, each result stored in the on-disk cubin cache.
- `pool`: the process's compile pool (spawned processes), shared by `compile_many` and the
  tuner's background compiles; `close_pool` / `pool_closed` shut it down (see `pool`).
- `load_kernel`: a CuPy kernel for the current device: memory cache, then the disk cache
  (`<cache>/kernels/<arch>/<name>-<sha12>.cubin`, or `$CKGEN_KERNEL_CACHE/<arch>/...`), then NVRTC.

The disk cache may be shared by several users: its files are created with the umask's mode (as
the DB's are), an entry this process cannot read is compiled again (and replaced where it can
be), and a cache folder that cannot take a cubin (a file in its place, read-only, a parent that
cannot be created) costs one KernelCacheWarning: kernels are then compiled and used without it.

Each cubin has a record beside it (`<cubin>.sha256`: the full sha256 of the source it was
compiled from, and of its own bytes). An entry is used only when its record names the source
asked for and its bytes match, are a whole ELF file and are read as a regular file of at most
MAX_CUBIN_BYTES; anything else (a cut or empty cubin, another entry's cubin under this name, a
FIFO) is a miss, compiled again and replaced. Both files are fsynced before their rename. This
catches damage and mix-ups, not malice: whoever can write a shared cache can write a matching
pair, so every user of a shared cache runs the code its writers put there."""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import hashlib
import multiprocessing as mp
import os
import secrets
import shutil
import struct
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import parsecache, settings
from ..codegen import KernelSource
from ..types import Target

NVRTC_OPTIONS = ("-std=c++17", "--use_fast_math")
# A cubin read from the cache at most: ckgen's are tens of KB, so a larger file (or /dev/zero put
# there) is not a cubin of ours and is not read without bound.
MAX_CUBIN_BYTES = 64 * 2**20


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


def nvrtc_missing() -> str | None:
    """None when NVIDIA targets can be built offline (NVRTC through CuPy), else what is missing."""
    from .target import CUPY_HINT

    try:
        from cupy.cuda import nvrtc
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "cupy":
            return f"CuPy is not installed; {CUPY_HINT}"
        return f"CuPy's NVRTC binding failed to import ({e.__class__.__name__}: {e})"
    except Exception as e:  # noqa: BLE001 - a CUDA library that fails to load
        return f"CuPy's NVRTC binding failed to import ({e.__class__.__name__}: {e})"
    try:
        nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001 - libnvrtc missing
        return f"libnvrtc cannot be loaded ({e.__class__.__name__}: {e}); {CUPY_HINT} installs the NVRTC wheel"
    return None


def cubin_path(src: KernelSource, arch: str) -> Path:
    return settings.kernel_cache_dir() / arch / f"{src.name}-{src.sha256[:12]}.cubin"


def _record_path(path: Path) -> Path:
    """The record of the cubin at `path`: the source's and the cubin's sha256."""
    return path.with_name(path.name + ".sha256")


def _record(src: KernelSource, data: bytes) -> bytes:
    return f"{src.sha256} {hashlib.sha256(data).hexdigest()}\n".encode()


_SHT_NOBITS = 8  # a section that takes no bytes in the file (.bss-like)


def elf_whole(data: bytes) -> bool:
    """Is `data` a whole 64-bit little-endian ELF file: its header, its section header table and
    every section with bytes inside it? A cubin cut short (or empty) is not: NVRTC's cubins end
    with their section and program header tables."""
    try:
        if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            return False
        shoff = struct.unpack_from("<Q", data, 0x28)[0]
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        if shnum == 0:
            return True
        if shentsize < 64 or shoff + shentsize * shnum > len(data):
            return False
        for i in range(shnum):
            kind, _, _, offset, size = struct.unpack_from("<IQQQQ", data, shoff + i * shentsize + 4)
            if kind != _SHT_NOBITS and offset + size > len(data):
                return False
        return True
    except struct.error:
        return False


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



def _write_synced(path: Path, data: bytes) -> None:
    """`data` into a temp file beside `path`, fsynced, then renamed onto it: readers never see a
    partial file, and a crash after the rename cannot leave an empty or cut one."""
    fd, tmp = parsecache.new_temp(path.parent, ".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _store(path: Path, src: KernelSource, data: bytes) -> bool:
    """Write the cubin `data` of `src` to `path`, then its record (each atomically, fsynced);
    False, with one KernelCacheWarning per folder, where the cache cannot take it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_synced(path, data)
        _write_synced(_record_path(path), _record(src, data))
        with contextlib.suppress(OSError):  # the renames themselves (not possible everywhere)
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        return True
    except OSError as e:
        _warn_unusable(path.parent, e)
        return False


def _read(path: Path, src: KernelSource) -> bytes | None:
    """The cached cubin of `src` at `path`, or None for a miss: missing, unreadable (another
    user's private file, a folder or FIFO in its place, over MAX_CUBIN_BYTES), or not the cubin
    of `src` by its record, or damaged (its bytes' hash, a cut ELF). A miss is compiled again."""
    data = parsecache.read_file(path, MAX_CUBIN_BYTES)
    record = parsecache.read_file(_record_path(path), 1024) if data is not None else None
    if record is None or record != _record(src, data) or not elf_whole(data):
        return None
    return data


def _cached(path: Path, src: KernelSource) -> bool:
    """Is the cache entry at `path` a usable cubin of `src` (`_read`)?"""
    return _read(path, src) is not None


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
    data = _read(path, src)
    if data is None:
        data = compile_offline(src, target).cubin
        _store(path, src, data)
    return data


def ensure_cubin(src: KernelSource, target: Target) -> Path:
    """A readable file holding the cubin of (src, arch), compiling it if missing or unreadable:
    the cached one, else (a cache that cannot take it: one KernelCacheWarning) a copy in this
    process's private folder. Raises CompileError."""
    path = cubin_path(src, target.arch)
    if _cached(path, src):
        return path
    data = compile_offline(src, target).cubin
    return path if _store(path, src, data) else _fallback_path(path, data)


def _worker(args: tuple[KernelSource, Target]) -> str | None:
    src, target = args
    try:
        ensure_cubin(src, target)
        return None
    except CompileError as e:
        return f"{src.name}: {e.log.strip()[-400:]}"


# The process's compile pool (`pool`) and what sizes it (`share_cpus`).
_pool: cf.ProcessPoolExecutor | None = None
_pool_pid = 0  # the process that made `_pool`
_finalizer_pid = [0]  # the process whose multiprocessing finalizers hold `close_pool`
_pool_lock = threading.Lock()
_sharers = 1  # processes of this machine that compile at once (`share_cpus`)
MAX_POOL = 16  # NVRTC compiles of one tuner: more processes than this only add start-up time


def cpu_count() -> int:
    """CPUs this process may run on (its affinity: a container's or `taskset`'s share, where
    os.cpu_count() says the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 2


def share_cpus(processes: int) -> None:
    """This process is one of `processes` on the machine that compile at once (the workers of
    `ckgen tune --workers`): its pool, made after this, gets its share of the CPUs."""
    global _sharers
    _sharers = max(1, processes)


def pool_size() -> int:
    """Processes of a new pool: this process's share of the CPUs (all of them, or one in
    `share_cpus`'s count) less one, the process itself, which feeds the GPU and fits the sampler;
    at least 1, at most MAX_POOL. 16 CPUs: one tuner 15, each of 2 workers 7, of 4 workers 3."""
    return max(1, min(MAX_POOL, cpu_count() // _sharers - 1))


def _orphan_guard(parent: int) -> None:
    """In each pool process: exit once the process that started the pool is gone. A pool process
    waits for work forever, and a tuner killed with SIGKILL (or dead of a GPU fault) never tells it
    to stop: without this it would outlive the tuner, holding memory, for good."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="ckgen-orphan-guard").start()


def pool(workers: int | None = None) -> cf.ProcessPoolExecutor:
    """The process's compile pool: `workers` spawned processes (default `pool_size()`), made on
    first use and kept for the process's later compiles (their start-up, an interpreter and the
    NVRTC library each, is paid once). Shut down by `close_pool`: explicitly where a process's
    work ends (`pool_closed`: a `ckgen tune --workers` worker, before it says it is done), else at
    exit. Not by atexit alone: a multiprocessing child leaves through os._exit, never running
    atexit, and multiprocessing's exit joins the child's own children first, the pool's
    processes, which wait for work forever; so it is also a multiprocessing finalizer, which that
    exit runs before the join (any multiprocessing child that compiles through the pool: a
    script's own child running `compile_many` or `tune.tune_problem`, say)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():  # a pool of the process this one forked from is not ours
            _pool = cf.ProcessPoolExecutor(workers or pool_size(), mp_context=mp.get_context("spawn"),
                                           initializer=_orphan_guard, initargs=(os.getpid(),))
            _pool_pid = os.getpid()
            if _finalizer_pid[0] != _pool_pid:
                from multiprocessing import util

                util.Finalize(None, close_pool, exitpriority=100)
                _finalizer_pid[0] = _pool_pid
        return _pool


def close_pool() -> None:
    """Shut the process's compile pool down: compiles not started are cancelled, running ones
    finish (seconds), its processes are joined. A later `pool()` starts a new one."""
    global _pool
    with _pool_lock:
        ex, _pool = (_pool, None) if _pool_pid == os.getpid() else (None, None)
    if ex is not None:
        ex.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def pool_closed() -> Any:
    """`with pool_closed(): ...`: whatever started the pool inside, it is shut down on the way
    out, however the block ends (a worker process's whole work runs inside one)."""
    try:
        yield
    finally:
        close_pool()


atexit.register(close_pool)  # the main process: before interpreter teardown, not during it


def compile_many(sources: list[KernelSource], target: Target, workers: int | None = None) -> dict[str, str]:
    """Compile every source (deduplicated by hash) into the disk cache, in parallel (`pool`;
    `workers` sizes it if this makes it).
    Returns {instance name: compiler message} for those that failed; the rest are cached."""
    todo = {s.sha256: s for s in sources if not _cached(cubin_path(s, target.arch), s)}
    if not todo:
        return {}
    workers = workers or pool_size()
    if len(todo) == 1 or workers == 1:
        out = [_worker((s, target)) for s in todo.values()]
    else:
        out = list(pool(workers).map(_worker, [(s, target) for s in todo.values()]))
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
