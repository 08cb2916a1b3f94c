"""GPU tier: the prelude's conversions on the device against the host's rounding
(ckgen/ops/numeric.py:to_storage, checked against direct formulas in tests/test_reference.py)."""
from __future__ import annotations

import numpy as np
import pytest

from ckgen.ops.numeric import to_storage

pytestmark = pytest.mark.gpu

KERNELS = r"""{% include "common/prelude.cuh.j2" %}
{% include "common/vec_io.cuh.j2" %}
extern "C" __global__ void ck_round_scalar(const float* in, unsigned short* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = ck_f2bf(in[i]);
}
extern "C" __global__ void ck_round_vec(const float* in, unsigned short* out, int n) {
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) * {{ vec }};
  if (i < n) {
    float v[{{ vec }}];
    for (int e = 0; e < {{ vec }}; ++e) v[e] = in[i + e];
    ck_store(out + i, v);
  }
}
"""


def kernels_source(target) -> str:
    from ckgen.codegen import environment

    return environment().from_string(KERNELS).render(target=target, dtype="bf16", storage="unsigned short",
                                                     itemsize=2, vec=8)


def test_bf16_rounding_on_the_device_matches_the_host() -> None:
    """Every bf16 upper half with halfway, just-below/above-halfway, all-ones and random lower
    halves: ck_f2bf (one element) and ck_store (8 at a time; on CUDA cvt.rn.bf16.f32 and
    cvt.rn.bf16x2.f32) give the host's round-to-nearest-even bits; NaN stays NaN (on CUDA the
    canonical NaN: its payload is not kept)."""
    cupy = pytest.importorskip("cupy")
    from ckgen.runtime.target import current_target

    target = current_target()
    rng = np.random.default_rng(0)
    upper = np.arange(1 << 16, dtype=np.uint32) << 16
    lower = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, *rng.integers(0, 1 << 16, 2)], dtype=np.uint32)
    bits = (upper[:, None] | lower[None, :]).ravel()
    f = bits.view(np.float32)
    want = to_storage(f, "bf16")
    nan = np.isnan(f)
    src = kernels_source(target)
    n = f.size
    dev_in = cupy.asarray(f)
    for name, threads in (("ck_round_scalar", n), ("ck_round_vec", n // 8)):
        out = cupy.full(n, 0x1234, dtype=cupy.uint16)
        cupy.RawKernel(src, name)(((threads + 255) // 256,), (256,), (dev_in, out, np.int32(n)))
        got = cupy.asnumpy(out)
        np.testing.assert_array_equal(got[~nan], want[~nan], err_msg=name)
        assert ((got[nan] & 0x7F80) == 0x7F80).all() and ((got[nan] & 0x7F) != 0).all(), f"{name}: NaN lost"
