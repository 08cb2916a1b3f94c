"""Host cost of the pieces a ckgen call is made of (allocation, signatures, stream, launch), and
a cProfile of one op's calls: to see where a call's host time goes. Prints a table.

    python tools/host-micro.py [--calls 2000] [--profile OP]"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import struct
import time


def per_call(fn, calls: int, rounds: int = 5) -> float:
    for _ in range(100):
        fn()
    best = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter() - t0) * 1e6 / calls)
    best.sort()
    return best[len(best) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", default="groupnorm_fwd")
    args = ap.parse_args()

    import cupy
    import torch
    from cupy.cuda import driver, runtime

    import ckgen
    from ckgen.runtime.tensors import sig

    x = torch.randn(2, 32, 8, 8, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(32, device="cuda", dtype=torch.bfloat16)
    dev = x.device
    cx = cupy.empty((2, 32, 8, 8), "float16")
    mod = cupy.RawModule(code='extern "C" __global__ void k(void* a, void* b, int n) {}')
    fptr = mod.get_function("k").kernel.ptr
    import numpy as np

    buf = np.zeros(8, np.uint64)
    kargs = np.array([buf.ctypes.data + 8 * i for i in range(8)], np.uint64)
    kaddr = int(kargs.ctypes.data)
    pack = struct.Struct("<7Q").pack_into
    raw = torch._C._cuda_getCurrentRawStream
    pieces = {
        "torch.empty_strided dev obj": lambda: torch.empty_strided((2, 32, 8, 8), (2048, 64, 8, 1), dtype=torch.bfloat16, device=dev),
        "torch.empty_strided dev int": lambda: torch.empty_strided((2, 32, 8, 8), (2048, 64, 8, 1), dtype=torch.bfloat16, device=0),
        "torch.empty shape dev obj": lambda: torch.empty((2, 32, 8, 8), dtype=torch.bfloat16, device=dev),
        "torch.empty (2,8) f32": lambda: torch.empty((2, 8), dtype=torch.float32, device=dev),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "x.new_empty(shape)": lambda: x.new_empty((2, 32, 8, 8)),
        "x.new_empty((2,8), f32)": lambda: x.new_empty((2, 8), dtype=torch.float32),
        "empty((2,2,8)).unbind(0)": lambda: torch.empty((2, 2, 8), dtype=torch.float32, device=dev).unbind(0),
        "sig(x)": lambda: sig(x),
        "sig(gamma)": lambda: sig(g),
        "(shape,stride,dtype,get_device,is_cuda)": lambda: (x.shape, x.stride(), x.dtype, x.get_device(), x.is_cuda),
        "(shape,stride,dtype,device)": lambda: (x.shape, x.stride(), x.dtype, x.device),
        "x.data_ptr()": lambda: x.data_ptr(),
        "x.shape": lambda: x.shape,
        "x.stride()": lambda: x.stride(),
        "x.device": lambda: x.device,
        "x.get_device()": lambda: x.get_device(),
        "raw stream": lambda: raw(0),
        "torch is_current_stream_capturing": lambda: torch.cuda.is_current_stream_capturing(),
        "cupy streamIsCapturing": lambda: runtime.streamIsCapturing(0),
        "cupy getDevice": lambda: runtime.getDevice(),
        "struct pack 7Q": lambda: pack(buf, 0, 1, 2, 3, 4, 5, 6, 7),
        "launchKernel (3 args)": lambda: driver.launchKernel(fptr, 1, 1, 1, 32, 1, 1, 0, 0, kaddr, 0),
        "cupy.cuda.alloc": lambda: cupy.cuda.alloc(4096),
        "cupy.empty": lambda: cupy.empty((2, 32, 8, 8), "float16"),
        "cupy.ndarray(mem, strides)": lambda: cupy.ndarray((2, 32, 8, 8), cupy.float16, cupy.cuda.alloc(4096),
                                                           (4096, 2, 512, 64)),
        "cupy.empty nhwc transpose": lambda: cupy.empty((2, 8, 8, 32), "float16").transpose(0, 3, 1, 2),
        "ckgen.bfloat16(a)": lambda: ckgen.bfloat16(cx.view(cupy.uint16)),
        "sig(cupy)": lambda: sig(cx),
        "cupy current stream ptr": lambda: cupy.cuda.get_current_stream().ptr,
    }
    torch.cuda.synchronize()
    for name, fn in pieces.items():
        t = per_call(fn, args.calls)
        torch.cuda.synchronize()
        print(f"  {name:42s} {t:7.3f} us", flush=True)

    gamma, beta = g, g.clone()
    calls = {
        "groupnorm_fwd": lambda: ckgen.groupnorm_fwd(x, gamma, beta, 8),
        "maxpool2d_fwd": lambda: ckgen.maxpool2d_fwd(x, 3, 2, 1),
    }
    fn = calls[args.profile]
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
