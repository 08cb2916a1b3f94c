"""A CPU emulator for the pooling kernels: the HIP render of an instance (no inline PTX, fp16 via
_Float16) is compiled as plain C++ with a small shim for the GPU built-ins, and every launch runs
its blocks and threads one after another. The pooling kernels have no warp shuffles and their
atomics commute, so running the threads serially gives exactly the GPU's result (up to the order of
atomic adds). A kernel with a barrier (the max pool backward's smem algo: __syncthreads, dynamic
shared memory) runs its blocks one after another, each block's threads as OS threads meeting at a
real barrier, with one shared-memory buffer. This checks the kernels' index math and semantics
against the float64 reference on machines with no GPU. `prebuild` compiles many emulators in one
compiler run.
"""
from __future__ import annotations

import concurrent.futures as cf
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ckgen.codegen import render
from ckgen.ops.spec import Config, OpSpec, Target

SHIM = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>
#define __device__
#define __global__
#define __shared__
#define __forceinline__ inline
#define __launch_bounds__(...)
struct ck_dim3 { unsigned x, y, z; };
static thread_local ck_dim3 threadIdx, blockIdx;
static ck_dim3 blockDim, gridDim;
extern "C" { float ck_smem[1 << 16]; }  // `extern __shared__ float ck_smem[]`: one block runs at a time
struct ck_emu_barrier {  // __syncthreads for one block's threads
  std::mutex m; std::condition_variable cv; unsigned n, waiting = 0, gen = 0;
  explicit ck_emu_barrier(unsigned count) : n(count) {}
  void wait() {
    std::unique_lock<std::mutex> lk(m);
    const unsigned g = gen;
    if (++waiting == n) { waiting = 0; ++gen; cv.notify_all(); return; }
    cv.wait(lk, [&] { return gen != g; });
  }
};
static ck_emu_barrier* ck_emu_bar;
static inline void __syncthreads() { ck_emu_bar->wait(); }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __shfl_xor(float v, int, int) { return v; }
static inline float __frsqrt_rn(float v) { return 1.0f / std::sqrt(v); }
static inline float atomicAdd(float* p, float v) { float o = *p; *p = o + v; return o; }
using std::min; using std::max;
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct longlong2 { long long x, y; };
"""
WRAPPER = r"""
extern "C" void emu_{k}(unsigned grid, unsigned block, const void* x, void* y, long long* idx, const void* dy,
                        void* dx, float* ws, int N, int C, int H, int W, int OH, int OW) {{
  gridDim = ck_dim3{{grid, 1, 1}}; blockDim = ck_dim3{{block, 1, 1}};
  for (unsigned b = 0; b < grid; ++b)
    for (unsigned t = 0; t < block; ++t) {{
      blockIdx = ck_dim3{{b, 0, 0}}; threadIdx = ck_dim3{{t, 0, 0}};
      {k}((const ck_store_t*)x, (ck_store_t*)y, idx, (const ck_store_t*)dy, (ck_store_t*)dx, ws, N, C, H, W, OH, OW);
    }}
}}
"""
WRAPPER_THREADS = r"""
extern "C" void emu_{k}(unsigned grid, unsigned block, const void* x, void* y, long long* idx, const void* dy,
                        void* dx, float* ws, int N, int C, int H, int W, int OH, int OW) {{
  gridDim = ck_dim3{{grid, 1, 1}}; blockDim = ck_dim3{{block, 1, 1}};
  for (unsigned b = 0; b < grid; ++b) {{
    ck_emu_barrier bar(block);
    ck_emu_bar = &bar;
    std::memset(ck_smem, 0xff, sizeof(ck_smem));  // poison: a read before the block's write shows
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block; ++t)
      threads.emplace_back([=] {{
        blockIdx = ck_dim3{{b, 0, 0}}; threadIdx = ck_dim3{{t, 0, 0}};
        {k}((const ck_store_t*)x, (ck_store_t*)y, idx, (const ck_store_t*)dy, (ck_store_t*)dx, ws, N, C, H, W, OH, OW);
      }});
    for (auto& th : threads) th.join();
  }}
}}
"""
EMU_TARGET = Target.named("gfx1100")  # HIP dialect, wave32


def compiler() -> str | None:
    for c in (os.environ.get("CKGEN_HIP_CLANG", "clang++-19"), "clang++", "g++"):
        if c and shutil.which(c):
            return c
    return None


_cache: dict[str, ctypes.CDLL] = {}
FLAGS = ["-std=c++17", "-O1", "-fPIC", "-pthread", "-w"]
_shim_pch: dict[str, list[str] | None] = {}
_shim_lock = threading.Lock()


def _shim_flags(cc: str, folder: Path) -> list[str] | None:
    """The flags that put SHIM before a source from a precompiled header (the C++ standard
    headers it includes are most of an emulator build), or None where it cannot be built: then
    SHIM is written into the source. clang: -include-pch; g++: -include of the header beside
    its .gch."""
    with _shim_lock:
        return _shim_flags_locked(cc, folder)


def _shim_flags_locked(cc: str, folder: Path) -> list[str] | None:
    if cc not in _shim_pch:
        clang = "clang" in Path(cc).name
        key = hashlib.sha256("\0".join([cc, *FLAGS, SHIM]).encode()).hexdigest()[:16]
        header = folder / f"shim-{key}.h"
        pch = folder / f"shim-{key}.h.{'pch' if clang else 'gch'}"
        if not pch.is_file():
            header.write_text(SHIM)
            tmp = folder / f"shim-{key}.{os.getpid()}-{threading.get_ident()}.tmp"
            r = subprocess.run([cc, *FLAGS, "-x", "c++-header", str(header), "-o", str(tmp)], capture_output=True)
            if r.returncode == 0:
                os.replace(tmp, pch)
        _shim_pch[cc] = None if not pch.is_file() else (["-include-pch", str(pch)] if clang else ["-include", str(header)])
    return _shim_pch[cc]


def _source(op: OpSpec, problem, config: Config) -> tuple[str, str, list]:
    """(digest, C++ body, launches) of the emulator of (op, problem, config): the HIP render after
    its include line, then a wrapper per launch (`emu_<kernel>`), which runs the launch's blocks
    and threads. The digest names its build."""
    ok = op.validate(problem, config, EMU_TARGET)
    assert ok, ok.reason
    launches = op.launches(problem, config, EMU_TARGET)
    src = render(op.template, op.instance_name(problem, config), op.render_context(problem, config, EMU_TARGET))
    # the render's one include is where SHIM goes: only comment lines come before it
    head, include, body = src.code.partition("#include <hip/hip_runtime.h>")
    assert include and all(not ln.strip() or ln.startswith("//") for ln in head.splitlines()), src.name
    for l in launches:
        assert 4 * (1 << 16) >= l.shared_mem, "the emulator's shared memory is too small"
    wrapper = WRAPPER_THREADS if "__syncthreads" in src.code else WRAPPER
    body += "".join(wrapper.format(k=l.kernel) for l in launches)
    assert not re.search(r"\basm\b", body)
    return hashlib.sha256((SHIM + body).encode()).hexdigest()[:16], body, list(launches)


def _folder() -> Path:
    d = Path(tempfile.gettempdir()) / "ckgen-pool-emu"
    d.mkdir(exist_ok=True)
    return d


def _compile(so: Path, body: str) -> None:
    """`body` (C++ after SHIM) built into the shared library `so`, atomically (another thread or
    process may build the same one)."""
    d, cc = so.parent, compiler()
    shim = _shim_flags(cc, d)
    mine = f"{os.getpid()}-{threading.get_ident()}"
    cpp, tmp = d / f"{so.stem}.{mine}.cpp", d / f"{so.stem}.{mine}.so"
    cpp.write_text(body if shim is not None else SHIM + body)
    r = subprocess.run([cc, *FLAGS, *(shim or []), "-shared", "-o", str(tmp), str(cpp)], capture_output=True, text=True)
    assert r.returncode == 0, f"{so.name}: emulator build failed\n{r.stderr[-3000:]}"
    os.replace(tmp, so)
    cpp.unlink()


def build(op: OpSpec, problem, config: Config) -> tuple[ctypes.CDLL, list]:
    digest, body, launches = _source(op, problem, config)
    lib = _cache.get(digest)
    if lib is None:
        so = _folder() / f"{digest}.so"
        if not so.is_file():
            _compile(so, body)
        lib = _cache[digest] = ctypes.CDLL(str(so))
    return lib, launches


BATCH = 16  # emulators per compiler run in `prebuild`


def prebuild(jobs: list[tuple[OpSpec, Any, Config]]) -> None:
    """Build the emulators of these (op, problem, config) before they run: up to BATCH in one
    compiler run, each body in a namespace of its own (its wrappers and kernels are extern "C",
    so their symbols keep their names; a batch holds no kernel name twice), the batches one
    compiler per core (it runs outside the GIL). One compiler start, one load of the precompiled
    SHIM and one link for a batch made an emulator cost a third of the CPU time of one built
    alone. Each emulator's name is linked to its batch's library, where later runs look for it."""
    d = _folder()
    todo: dict[str, tuple[str, set[str]]] = {}
    for job in jobs:
        digest, body, launches = _source(*job)
        if digest not in _cache and digest not in todo and not (d / f"{digest}.so").is_file():
            todo[digest] = (body, {l.kernel for l in launches})
    batches: list[list[str]] = []
    names: list[set[str]] = []
    for digest, (_, kernels) in todo.items():
        k = next((i for i, b in enumerate(batches) if len(b) < BATCH and not kernels & names[i]), None)
        if k is None:
            batches.append([])
            names.append(set())
            k = len(batches) - 1
        batches[k].append(digest)
        names[k] |= kernels

    def one(batch: list[str]) -> None:
        so = d / f"batch-{hashlib.sha256(' '.join(sorted(batch)).encode()).hexdigest()[:16]}.so"
        if not so.is_file():
            _compile(so, "".join(f"namespace ckemu_{digest} {{\n{todo[digest][0]}\n}}\n" for digest in batch))
        lib = ctypes.CDLL(str(so))
        for digest in batch:
            _cache[digest] = lib
            try:
                os.link(so, d / f"{digest}.so")
            except OSError:  # there already (another run), or no hard links here: found through _cache
                pass

    with cf.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as ex:
        list(ex.map(one, batches))


def run(op: OpSpec, problem, config: Config, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run every launch of `config` on the CPU; returns the unpacked outputs (poisoned first)."""
    lib, launches = build(op, problem, config)
    dev_in = op.pack_inputs(problem, inputs)
    dev_out = {k: np.empty(n, dt) for k, (n, dt) in op.output_buffers(problem).items()}
    for a in dev_out.values():
        a.view(np.uint8).fill(0xFF)  # NaN bits in every dtype, -1 in int64
    ws = np.full(max(op.workspace_bytes(problem, config), 4) // 4, np.nan, dtype=np.float32)
    bufs = {**dev_in, **dev_out}

    def ptr(name: str):
        a = bufs.get(name)
        return a.ctypes.data_as(ctypes.c_void_p) if a is not None else None

    for l in launches:
        fn = getattr(lib, f"emu_{l.kernel}")
        fn(ctypes.c_uint(l.grid[0]), ctypes.c_uint(l.block[0]), ptr("x"), ptr("y"), ptr("indices"), ptr("dy"),
           ptr("dx"), ws.ctypes.data_as(ctypes.c_void_p), *(ctypes.c_int(v) for v in (
               problem.N, problem.C, problem.H, problem.W, problem.OH, problem.OW)))
    return op.unpack_outputs(problem, dev_out)
