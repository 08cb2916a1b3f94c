"""CPU tests of the Timer's device side: its L2 flush and spin kernels build offline for the CUDA
targets (the flush's cache-policy PTX needs sm_80+), and the spin covers the call's host time."""
from __future__ import annotations

import hashlib

import pytest

from ckgen.bench import _FLUSH_SRC, _SPIN_SRC, spin_ns
from ckgen.codegen import KernelSource
from ckgen.compile import compile_offline, cubin_resources
from ckgen.ops.spec import Target


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name,code", [("timer_l2_flush", _FLUSH_SRC), ("timer_spin", _SPIN_SRC)])
def test_timer_kernels_compile_offline(arch: str, name: str, code: str) -> None:
    src = KernelSource(name, code, hashlib.sha256(code.encode()).hexdigest(), "ckgen/bench.py")
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
