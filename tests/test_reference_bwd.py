"""The float64 GroupNorm backward reference against central finite differences of the
forward reference, with and without swish."""
from __future__ import annotations

import numpy as np
import pytest

from ckgen.ops.groupnorm import groupnorm_bwd_reference, groupnorm_fwd_reference


def numeric_grad(f, a: np.ndarray, h: float = 1e-6) -> np.ndarray:
    out = np.zeros_like(a)
    it = np.nditer(a, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        keep = a[i]
        a[i] = keep + h
        up = f()
        a[i] = keep - h
        down = f()
        a[i] = keep
        out[i] = (up - down) / (2 * h)
    return out


@pytest.mark.parametrize("activation", ["none", "swish"])
@pytest.mark.parametrize("shape", [(2, 6, 3, 2, 3), (1, 4, 1, 1, 4), (2, 4, 2, 3, 1)],
                         ids=["N2C6G3", "HW1-GC", "G1"])
def test_backward_matches_finite_differences(activation, shape):
    N, C, H, W, G = shape
    rng = np.random.default_rng(7)
    x = rng.normal(0.5, 1.5, size=(N, C, H, W))
    gamma = 1 + 0.3 * rng.standard_normal(C)
    beta = 0.3 * rng.standard_normal(C)
    w = rng.standard_normal((N, C, H, W))  # upstream gradient: L = sum(w * out)
    eps = 1e-5

    def loss() -> float:
        return float((w * groupnorm_fwd_reference(x, gamma, beta, G, eps, activation)["y"]).sum())

    fwd = groupnorm_fwd_reference(x, gamma, beta, G, eps, activation)
    got = groupnorm_bwd_reference(w, x, fwd["mean"], np.asarray(fwd["rstd"]), gamma, G, beta, activation)
    for name, arr in (("dx", x), ("dgamma", gamma), ("dbeta", beta)):
        want = numeric_grad(loss, arr)
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-7, err_msg=name)


def test_backward_without_affine_matches_unit_gamma():
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((2, 8, 4, 4)), rng.standard_normal((2, 8, 4, 4))
    fwd = groupnorm_fwd_reference(x, None, None, 4)
    a = groupnorm_bwd_reference(dy, x, fwd["mean"], fwd["rstd"], None, 4)
    b = groupnorm_bwd_reference(dy, x, fwd["mean"], fwd["rstd"], np.ones(8), 4, np.zeros(8))
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-12, atol=1e-14)
