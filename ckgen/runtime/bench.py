"""Timing: device events, warm-up, median and spread; two views of one call.

- `Timer.time`: GPU time. L2 is flushed before every timed run, and after the flush the GPU
  spins for longer than the call's host side takes, so the host runs ahead and its overhead is
  hidden: this is the kernels' own time.
- `Timer.back_to_back`: host-inclusive time per call, as a model's loop (and
  `triton.testing.do_bench` without its flush) sees it: many calls in a row, no flush, time
  between the first call's start and the last one's end on the stream, divided by the calls.
  When the host is slower than the GPU, this is the host's time per call.

Plus the copy that defines copy-equivalent efficiency, timed like `Timer.time`."""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    runs: int

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: two results closer than this are a tie."""
        return (self.p90_us - self.p10_us) / self.median_us if self.median_us else 0.0


# The L2 flush (CUDA, sm_80+). A plain fill of a buffer twice L2's size does not evict lines
# that a kernel loaded with an evict_last hint, as Triton's kernels (torch.compile's) load their
# inputs: the held-out 16x256x28x28 fp32 max pool's input stayed partly in L2 across
# plain fills once torch.compile had run on it, and ckgen's kernel on the same input went from
# 12.4 to 10.1 us, torch.compile's was 9.6. So the buffer is written with evict_last stores, which
# displace those lines too, and each line is demoted to evict_normal once written: L2 is left as a
# plain fill leaves it (dirty lines of the buffer at normal priority) and holds nothing of the
# timed call's inputs (with this flush: 12.3 and 10.7 us). Then a spin keeps the GPU busy while
# the host enqueues the call. The kernels' names do not start with ckgen_, so profilers that
# select ckgen's kernels (`ncu -k regex:ckgen_`, tools/prof-pool.sh) pass over them.
_FLUSH_SRC = r"""
extern "C" __global__ void timer_l2_flush(unsigned* p, unsigned long long n, unsigned v) {
  unsigned long long pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += stride) {
    asm volatile("st.global.L2::cache_hint.b32 [%0], %1, %2;" :: "l"(p + i), "r"(v), "l"(pol) : "memory");
    __syncwarp();
    if ((threadIdx.x & 31) == 0) asm volatile("applypriority.global.L2::evict_normal [%0], 128;" :: "l"(p + i) : "memory");
  }
}
"""
_SPIN_SRC = r"""
extern "C" __global__ void timer_spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


@functools.lru_cache(maxsize=1)
def _timer_kernels() -> tuple[Any, Any] | None:
    """(flush, spin) RawKernels, built once per process (every Timer shares them: the tuner and
    online tuning make one per problem); None where they cannot be built (HIP, before sm_80)."""
    import cupy

    try:
        flush, spin = cupy.RawKernel(_FLUSH_SRC, "timer_l2_flush"), cupy.RawKernel(_SPIN_SRC, "timer_spin")
        flush.compile()
        spin.compile()
        return flush, spin
    except Exception:  # noqa: BLE001 - a plain fill and no spin then
        return None


def spin_ns(host_s: float) -> int:
    """The spin before a timed run: twice the call's host time in seconds (counted up to 2 ms,
    so a slow or unknown host time spins 4 ms) plus 20 us, in nanoseconds."""
    return int(round((2 * min(host_s, 2e-3) + 20e-6) * 1e9))


class Timer:
    """Times callables on the current CuPy stream. Before each timed run (outside the timed
    region): an L2 flush that evicts every line (`_FLUSH_SRC`), then a spin of twice the call's
    host time (the fastest warm-up call, counted up to 2 ms) plus 20 us. Where these kernels
    cannot be built (HIP, before sm_80): a plain fill and no spin."""

    def __init__(self, l2_bytes: int, warmup: int = 3, runs: int = 25):
        import cupy

        self._cupy = cupy
        self._flush = cupy.empty(max(2 * l2_bytes, 8 << 20) // 128 * 128, dtype=cupy.uint8)
        self.warmup, self.runs = warmup, runs
        kernels = _timer_kernels()
        self._flush_kernel, self._spin = kernels if kernels is not None else (None, None)
        self._flush_blocks = 4 * cupy.cuda.Device().attributes["MultiProcessorCount"]

    def fill(self, i: int) -> None:
        """The plain fill of the buffer (the flush where the flush kernel cannot be built; it
        leaves lines loaded with evict_last in L2)."""
        self._flush.fill(i & 0xFF)

    def flush(self, i: int) -> None:
        """Evict L2 (the buffer's content differs from run to run)."""
        if self._flush_kernel is None:
            self.fill(i)
        else:
            cp = self._cupy
            self._flush_kernel((self._flush_blocks,), (1024,),
                               (self._flush, cp.uint64(self._flush.nbytes // 4), cp.uint32(i)))

    def time(self, fn: Callable[[], object], runs: int | None = None,
             flush: Callable[[int], None] | None = None) -> Timing:
        """GPU time of fn: `flush` (default `self.flush`) and the spin before each run."""
        cp = self._cupy
        flush = flush or self.flush
        host = float("inf")
        for _ in range(self.warmup):
            t0 = time.perf_counter()
            fn()
            host = min(host, time.perf_counter() - t0)
        spin = cp.uint64(spin_ns(host))
        n = runs or self.runs
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(n)]
        for i, (a, b) in enumerate(events):
            flush(i)
            if self._spin is not None:
                self._spin((1,), (1,), (spin,))
            a.record()
            fn()
            b.record()
        events[-1][1].synchronize()
        ts = sorted(cp.cuda.get_elapsed_time(a, b) * 1e3 for a, b in events)
        q = statistics.quantiles(ts, n=10) if len(ts) >= 2 else [ts[0]] * 9
        return Timing(statistics.median(ts), q[0], q[-1], n)

    def back_to_back(self, fn: Callable[[], object], gpu_us: float | None = None, rounds: int = 7,
                     target_us: float = 20000.0) -> Timing:
        """Host-inclusive time per call: `rounds` rounds of n back-to-back calls (n from
        `gpu_us`, the GPU time if known, to make each round ~target_us; 10..2000), each round's
        event-to-event time / n; median and spread over the rounds."""
        cp = self._cupy
        for _ in range(self.warmup):
            fn()
        n = int(min(2000, max(10, target_us / max(gpu_us or 5.0, 1.0))))
        per = []
        for _ in range(rounds):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            cp.cuda.get_current_stream().synchronize()
            a.record()
            for _ in range(n):
                fn()
            b.record()
            b.synchronize()
            per.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / n)
        per.sort()
        q = statistics.quantiles(per, n=10) if len(per) >= 2 else [per[0]] * 9
        return Timing(statistics.median(per), q[0], q[-1], rounds)

    def side_by_side(self, ours: Callable[[], object], eager: Callable[[], object], nbytes: int,
                     compiled: Callable[[], Callable[[], object]] | None = None,
                     on_compile_error: Callable[[Exception], None] | None = None) -> SideBySide:
        """One problem as the benchmarks time it, in one run: the copy of its `nbytes` minimum
        bytes, then ckgen (`ours`) and PyTorch eager, each GPU-only (`time`) and host-inclusive
        (`back_to_back`), then torch.compile: `compiled()` builds the compiled callable, which is
        called once (the compile) and timed both ways. A compile or a compiled call that raises
        goes to `on_compile_error` and leaves the compile columns None (without a handler it
        propagates); `compiled=None`: not run."""
        copy = self.copy_time(nbytes)
        t_ours, t_eager = self.time(ours), self.time(eager)
        h_ours = self.back_to_back(ours, t_ours.median_us)
        h_eager = self.back_to_back(eager, t_eager.median_us)
        t_comp = h_comp = None
        if compiled is not None:
            try:
                comp = compiled()
                comp()
                t_comp = self.time(comp)
                h_comp = self.back_to_back(comp, t_comp.median_us)
            except Exception as e:  # noqa: BLE001 - the caller records it; the run goes on
                if on_compile_error is None:
                    raise
                t_comp = h_comp = None
                on_compile_error(e)
        return SideBySide(nbytes, copy, t_ours, t_eager, t_comp, h_ours, h_eager, h_comp)

    def copy_time(self, total_bytes: int) -> Timing:
        """A device-to-device copy moving `total_bytes` (half read, half written)."""
        cp = self._cupy
        half = max(total_bytes // 2, 1)
        src = cp.empty(half, dtype=cp.uint8)
        src.fill(1)
        dst = cp.empty(half, dtype=cp.uint8)
        return self.time(lambda: dst.data.copy_from_device_async(src.data, half))


@dataclass(frozen=True)
class SideBySide:
    """`Timer.side_by_side`'s timings of one problem: the copy of its minimum bytes, then ckgen,
    PyTorch eager and torch.compile (None: not run, or it failed), GPU-only and host-inclusive."""
    nbytes: int
    copy: Timing
    ours: Timing
    eager: Timing
    comp: Timing | None
    ours_host: Timing
    eager_host: Timing
    comp_host: Timing | None

    def suite_columns(self) -> dict[str, Any]:
        """The columns that the suite benchmarks (bench/groupnorm_fwd.py, groupnorm_bwd.py,
        pooling.py) write for every row: us (GPU and host-inclusive), GB/s, copy-equivalent
        efficiency (copy time / time), speedups (> 1: ckgen faster); compile ones None if not run."""
        o, e, c = self.ours.median_us, self.eager.median_us, self.comp.median_us if self.comp else None
        ho, he = self.ours_host.median_us, self.eager_host.median_us
        hc = self.comp_host.median_us if self.comp_host else None
        return {
            "min_MB": self.nbytes / 1e6, "copy_us": self.copy.median_us,
            "ckgen_us": o, "ckgen_spread": self.ours.spread, "ckgen_GBps": gbps(self.nbytes, o),
            "ckgen_eff": self.copy.median_us / o,
            "eager_us": e, "eager_eff": self.copy.median_us / e,
            "compile_us": c,
            "ckgen_host_us": ho, "eager_host_us": he, "compile_host_us": hc,
            "speedup_eager_host": he / ho, "speedup_compile_host": hc / ho if hc else None,
            "speedup_eager": e / o, "speedup_compile": c / o if c else None,
        }


def gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9 if us > 0 else 0.0


def host_cells(r: dict) -> str:
    """The host-inclusive cells of a benchmark row (ckgen / eager / compile us, the two speedups),
    as the suite scripts print them; compile entries may be None (not run)."""
    comp = f"{r['compile_host_us']:.1f}" if r.get("compile_host_us") else "n/a"
    spc = f"{r['speedup_compile_host']:.2f}x" if r.get("speedup_compile_host") else "n/a"
    return f"{r['ckgen_host_us']:.1f} / {r['eager_host_us']:.1f} / {comp} | {r['speedup_eager_host']:.2f}x | {spc} | "
