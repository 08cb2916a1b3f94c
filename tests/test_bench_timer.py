"""CPU tests of the Timer's device side: its L2 flush and spin kernels build offline for the CUDA
targets (the flush's cache-policy PTX needs sm_80+), and the spin covers the call's host time."""
from __future__ import annotations

import hashlib

import pytest

from ckgen.runtime.bench import _FLUSH_SRC, _SPIN_SRC, Timer, Timing, spin_ns
from ckgen.codegen import KernelSource
from ckgen.runtime.compile import compile_offline, cubin_resources
from ckgen.ops.spec import Target


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name,code", [("timer_l2_flush", _FLUSH_SRC), ("timer_spin", _SPIN_SRC)])
def test_timer_kernels_compile_offline(arch: str, name: str, code: str) -> None:
    src = KernelSource(name, code, hashlib.sha256(code.encode()).hexdigest(), "ckgen/runtime/bench.py")
    b = compile_offline(src, Target.named(arch))
    assert name.encode() in b.cubin
    res = cubin_resources(b.cubin)
    assert res is not None and res["stack_bytes"] == 0


def test_flush_writes_with_evict_last_and_demotes_each_line() -> None:
    assert "createpolicy.fractional.L2::evict_last" in _FLUSH_SRC
    assert "st.global.L2::cache_hint" in _FLUSH_SRC
    assert "applypriority.global.L2::evict_normal" in _FLUSH_SRC


@pytest.mark.parametrize("host_s,want_ns", [(0.0, 20_000), (10e-6, 40_000), (1e-3, 2_020_000),
                                            (0.5, 4_020_000), (float("inf"), 4_020_000)])
def test_spin_covers_twice_the_host_time(host_s: float, want_ns: int) -> None:
    assert spin_ns(host_s) == want_ns


class _ScriptedTimer(Timer):
    """Timer's side_by_side over scripted timings (no device): each call's function returns the
    name it stands for, and `time`/`back_to_back`/`copy_time` look its time up."""

    def __init__(self, gpu: dict[str, float], host: dict[str, float]) -> None:  # no cupy, no buffers
        self.gpu, self.host, self.calls = gpu, host, []

    def time(self, fn, runs=None, flush=None):
        name = fn()
        self.calls.append(("time", name))
        us = self.gpu[name]
        return Timing(us, 0.9 * us, 1.1 * us, 40)

    def back_to_back(self, fn, gpu_us=None, rounds=7, target_us=20000.0):
        name = fn()
        self.calls.append(("back_to_back", name, gpu_us))
        return Timing(self.host[name], self.host[name], self.host[name], rounds)

    def copy_time(self, total_bytes):
        self.calls.append(("copy", total_bytes))
        return Timing(self.gpu["copy"], self.gpu["copy"], self.gpu["copy"], 40)


def test_side_by_side_times_every_side_both_ways_and_derives_the_suite_columns() -> None:
    t = _ScriptedTimer({"copy": 8.0, "ours": 10.0, "eager": 40.0, "comp": 20.0},
                       {"ours": 12.0, "eager": 48.0, "comp": 30.0})
    built = []

    def compiled():
        built.append(1)
        return lambda: "comp"

    sb = t.side_by_side(lambda: "ours", lambda: "eager", 2_000_000, compiled)
    assert built == [1]
    # the copy first, then each side GPU-only before host-inclusive; back_to_back sizes its rounds
    # from that side's GPU time
    assert [c[:2] for c in t.calls] == [("copy", 2_000_000), ("time", "ours"), ("time", "eager"),
                                        ("back_to_back", "ours"), ("back_to_back", "eager"),
                                        ("time", "comp"), ("back_to_back", "comp")]
    assert [c[2] for c in t.calls if c[0] == "back_to_back"] == [10.0, 40.0, 20.0]
    col = sb.suite_columns()
    assert col["min_MB"] == 2.0 and col["copy_us"] == 8.0 and col["ckgen_us"] == 10.0
    assert col["ckgen_eff"] == 0.8 and col["eager_eff"] == 0.2
    assert col["ckgen_GBps"] == pytest.approx(200.0)  # 2 MB in 10 us
    assert abs(col["ckgen_spread"] - 0.2) < 1e-12
    assert col["speedup_eager"] == 4.0 and col["speedup_compile"] == 2.0
    assert col["ckgen_host_us"] == 12.0 and col["speedup_eager_host"] == 4.0 and col["speedup_compile_host"] == 2.5


def test_side_by_side_records_a_failed_compile_as_none_and_runs_none_when_not_asked() -> None:
    t = _ScriptedTimer({"copy": 8.0, "ours": 10.0, "eager": 40.0}, {"ours": 12.0, "eager": 48.0})

    def broken():
        raise RuntimeError("dynamo says no")

    seen = []
    sb = t.side_by_side(lambda: "ours", lambda: "eager", 1000, lambda: broken, seen.append)
    assert [str(e) for e in seen] == ["dynamo says no"]
    assert sb.comp is None and sb.comp_host is None
    col = sb.suite_columns()
    assert col["compile_us"] is None and col["speedup_compile"] is None and col["speedup_compile_host"] is None
    with pytest.raises(RuntimeError, match="dynamo says no"):  # no handler: it propagates
        t.side_by_side(lambda: "ours", lambda: "eager", 1000, lambda: broken)
    t.calls.clear()
    sb = t.side_by_side(lambda: "ours", lambda: "eager", 1000)
    assert sb.comp is None and not [c for c in t.calls if c[1] == "comp"]
