"""The pooling ops' class check on arrays of knob values (`OpSpec.class_check_many`), mixed into
`base._PoolOp`: the candidate walk asks it of a whole step of the space's lattice at once, with
the same answers as `class_check` (tests/test_pick_latency.py compares them on every op)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import numpy as np

from ...types import DTYPES, Target
from .problem import cover_extent

if TYPE_CHECKING:
    from .problem import PoolProblem


class VectorChecks:
    """`class_check_many` and its parts; the op classes provide `backward`, `pool` and the
    forward ops' `_acc_words_many`."""

    backward: bool
    pool: str

    def class_check_many(self, p: PoolProblem, k: Mapping[str, np.ndarray], target: Target) -> np.ndarray:
        """`class_check` on arrays of knob values (`OpSpec.class_check_many`): the same tests. A
        new pooling class (another window, stride or layout) is common among unseen problems, and
        the walk asked the scalar check of each of its nodes."""
        item = DTYPES[p.dtype]["itemsize"]
        vb, threads, th, tw = k["vec_bytes"], k["threads"], k["th"], k["tw"]
        ok = (vb % item == 0) & (threads % target.warp_size == 0)
        vec = np.maximum(vb // item, 1)  # where vb < item, ok is already False
        if p.layout == "nchw":
            wide = vec != 1
            if self.backward:
                smem = k["algo"] == "smem"
                ok &= ~wide | self._x_footprint_many(p, k) | smem
                ok &= ~(wide & ~smem & (tw % vec != 0))
            ok &= ~(wide & (p.W % vec != 0))
            if not self.backward:
                ok &= ~(wide & ((tw * p.stride[1]) % vec != 0))
        else:
            ok &= p.C % vec == 0
        ek = p.eff_kernel
        footprint = ((th - 1) * p.stride[0] + ek[0]) * ((tw - 1) * p.stride[1] + ek[1])
        ok &= ~(((th > 1) | (tw > 1)) & (footprint > 256))
        ok &= self._regs_needed_many(p, k, vec) <= np.minimum(255, 65536 // (threads * k["min_blocks"]))
        return ok

    def _regs_needed_many(self, p: PoolProblem, k: Mapping[str, np.ndarray], vec: np.ndarray) -> np.ndarray:
        """`_regs_needed` on arrays (`vec`: vec_bytes / itemsize, at least 1). Forward ops:
        `_fwd_regs` of `_acc_words_many`."""
        acc = self._acc_words_many(p, k, vec)
        th, tw, vb = k["th"], k["tw"], k["vec_bytes"]
        ek = p.eff_kernel
        fr, fc = (th - 1) * p.stride[0] + ek[0], (tw - 1) * p.stride[1] + ek[1]
        if p.layout == "nchw":
            return acc + fc + p.padding[1] + 24
        return acc + np.minimum(fr, 3) * fc * np.maximum(1, vb // 4) + 20

    def _acc_words_many(self, p: PoolProblem, k: Mapping[str, np.ndarray], vec: np.ndarray) -> np.ndarray:
        """`_acc_words` on arrays (forward ops)."""
        raise NotImplementedError

    def _aligned_many(self, p: PoolProblem, k: Mapping[str, np.ndarray]) -> np.ndarray:
        """`aligned_gather` on arrays."""
        algo = k.get("algo")
        if not self.backward or algo is None:
            return np.zeros(len(k["th"]), dtype=bool)
        return ((algo == "gather") | (algo == "smem")) & (k["tw"] % p.stride[1] == 0) & (k["th"] % p.stride[0] == 0)

    def _cover_many(self, p: PoolProblem, tile: np.ndarray, axis: int, part: int) -> np.ndarray:
        """`_cover_extent(p, config, axis)[part]` per tile size (computed once per distinct size)."""
        sizes, inv = np.unique(tile, return_inverse=True)
        ext = [cover_extent(p.kernel[axis], p.stride[axis], p.padding[axis], p.dilation[axis], int(t))[part]
               for t in sizes.tolist()]
        return np.array(ext, dtype=np.int64)[inv.reshape(-1)]

    def _x_footprint_many(self, p: PoolProblem, k: Mapping[str, np.ndarray]) -> np.ndarray:
        """`x_footprint` on arrays."""
        if not (self.backward and self.pool == "max" and getattr(p, "indices", "") == "recompute"
                and p.layout == "nchw"):
            return np.zeros(len(k["th"]), dtype=bool)
        tw = k["tw"]
        ok = (k["algo"] == "gather") & self._aligned_many(p, k)
        ob0, nb = self._cover_many(p, tw, 1, 0), self._cover_many(p, tw, 1, 1)
        pre = p.padding[1] - ob0 * p.stride[1]
        return ok & (pre >= 0) & (pre + tw <= (nb - 1) * p.stride[1] + p.eff_kernel[1])
