"""The covering outputs of a pooling backward tile in closed form (ckgen/ops/pool/problem.py),
CPU tier: the same lists as the loop over the window they replace, and validation of a tall
window no longer walks it (a legal kernel has up to 2^31 taps)."""
from __future__ import annotations

import math
import time

import pytest

from ckgen.ops import get_op
from ckgen.ops.pool.problem import covering, covering_span
from ckgen.ops.spec import Target

SM90 = Target.named("sm_90")


def _by_the_window(k, s, pad, d, t):
    """The definition: every tap of the window, kept where it lands on a multiple of the stride."""
    return sorted({(t + pad - i * d) // s for i in range(k) if (t + pad - i * d) % s == 0})


def test_covering_equals_the_loop_over_the_window():
    n = 0
    for k in range(1, 10):
        for s in range(1, 10):
            for d in range(1, 7):
                for pad in range(k // 2 + 1):
                    for t in range(24):
                        want = _by_the_window(k, s, pad, d, t)
                        assert covering(k, s, pad, d, t) == want, (k, s, pad, d, t)
                        assert covering_span(k, s, pad, d, t) == ((want[0], want[-1]) if want else None)
                        n += 1
    assert n == 9 * 6 * 24 * sum(k // 2 + 1 for k in range(1, 10))  # every case was compared


@pytest.mark.parametrize("k, s, d", [(k, s, d) for k in (1, 2, 3, 5, 7) for s in (1, 2, 3, 4) for d in (1, 2, 3)])
def test_windows_per_element_is_the_largest_cover(k, s, d):
    op = get_op("maxpool2d_bwd")
    p = op.parse_problem(N=1, C=1, H=64, W=64, kernel=(k, 1), stride=(s, 1), padding=(k // 2, 0), dilation=(d, 1),
                         dtype="fp32", layout="nchw")
    s = p.stride[0]  # canonical
    assert p.windows_per_element == max(len(_by_the_window(k, s, k // 2, d, t)) for t in range(s))
    assert p.windows_per_element == math.ceil(k / (s // math.gcd(d, s)))


@pytest.mark.parametrize("op", ["maxpool2d_bwd", "avgpool2d_bwd", "maxpool2d_fwd", "avgpool2d_fwd"])
def test_validating_a_tall_window_does_not_walk_it(op):
    """A 1,000,000 x 1 window: every config of the space validated, in CPU time that does not grow
    with the window (the loop over it took seconds per 100,000 taps and config)."""
    spec = get_op(op)
    p = spec.parse_problem(N=2, C=16, H=2_000_000, W=4, kernel=(1_000_000, 1), stride=1, dtype="fp32", layout="nchw")
    configs = spec.space.enumerate()
    best = math.inf
    for _ in range(3):
        t = time.thread_time()
        valid = [c for c in configs if spec.validate(p, c, SM90)]
        best = min(best, time.thread_time() - t)
    assert valid  # 1-row tiles (the scatter, and the forward) still run it
    assert best < 0.5, f"{len(configs)} configs validated in {best:.2f} s of CPU"
