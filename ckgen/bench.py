"""Timing: device events, warm-up, median and spread; two views of one call.

- `Timer.time`: GPU time. L2 is flushed before every timed run, and the flush (a long kernel)
  lets the host run ahead, so host overhead is hidden: this is the kernels' own time.
- `Timer.back_to_back`: host-inclusive time per call, as a model's loop (and
  `triton.testing.do_bench` without its flush) sees it: many calls in a row, no flush, time
  between the first call's start and the last one's end on the stream, divided by the calls.
  When the host is slower than the GPU, this is the host's time per call.

Plus the copy that defines copy-equivalent efficiency, timed like `Timer.time`."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable


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


class Timer:
    """Times callables on the current CuPy stream, flushing L2 by overwriting a buffer twice
    its size before each timed run (outside the timed region)."""

    def __init__(self, l2_bytes: int, warmup: int = 3, runs: int = 25):
        import cupy

        self._cupy = cupy
        self._flush = cupy.empty(max(2 * l2_bytes, 8 << 20), dtype=cupy.uint8)
        self.warmup, self.runs = warmup, runs

    def time(self, fn: Callable[[], object], runs: int | None = None) -> Timing:
        cp = self._cupy
        for _ in range(self.warmup):
            fn()
        n = runs or self.runs
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(n)]
        for i, (a, b) in enumerate(events):
            self._flush.fill(i & 0xFF)
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

    def copy_time(self, total_bytes: int) -> Timing:
        """A device-to-device copy moving `total_bytes` (half read, half written)."""
        cp = self._cupy
        half = max(total_bytes // 2, 1)
        src = cp.empty(half, dtype=cp.uint8)
        src.fill(1)
        dst = cp.empty(half, dtype=cp.uint8)
        return self.time(lambda: dst.data.copy_from_device_async(src.data, half))


def gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9 if us > 0 else 0.0


def host_cells(r: dict) -> str:
    """The host-inclusive cells of a benchmark row (ckgen / eager / compile us, the two speedups),
    as the suite scripts print them; compile entries may be None (not run)."""
    comp = f"{r['compile_host_us']:.1f}" if r.get("compile_host_us") else "n/a"
    spc = f"{r['speedup_compile_host']:.2f}x" if r.get("speedup_compile_host") else "n/a"
    return f"{r['ckgen_host_us']:.1f} / {r['eager_host_us']:.1f} / {comp} | {r['speedup_eager_host']:.2f}x | {spc} | "
