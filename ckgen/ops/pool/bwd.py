"""The pooling backward ops' common part (`_PoolBwd`): the algo in the name, scatter's workspace
and its zero/convert launches, the gather's register estimate and cover lists, dx's packing."""
from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping

import numpy as np

from ...types import DTYPES, Config, Launch, Support, Target
from ..numeric import from_storage
from .base import _STORAGE_BITS, _cdiv, _cover_span, _PoolOp
from .problem import PoolProblem


class _PoolBwd(_PoolOp):
    backward: ClassVar[bool] = True

    def _name_algo(self, c: Config) -> str:
        return f"_{c['algo']}"

    def _scatter_to_ws(self, p: PoolProblem) -> bool:
        """Scatter with overlapping windows in 16-bit: fp32 atomics on a workspace, then convert."""
        return p.overlap and p.dtype != "fp32"

    def _validate_more(self, p: PoolProblem, config: Config, target: Target) -> Support:
        if config["algo"] == "scatter" and p.numel >= 2**40:
            return Support.no("scatter's zero/convert loops take at most 2^40 elements")
        return Support.yes()

    def _regs_needed(self, p: PoolProblem, config: Config) -> int:
        th, tw = self.tile(config)
        vec = self.vec_elems(p, config)
        if self.aligned_gather(p, config):
            na, nb = self.cover_counts(p, config)
            xfoot = math.prod(self._x_footprint_dims(p, config)) if self.x_footprint(p, config) else 0
            return na * nb * vec * (2 if self.pool == "max" else 1) + 2 * tw * vec + 32 + xfoot
        return th * tw * vec + 4 * vec + 32

    def _regs_needed_many(self, p: PoolProblem, k: Mapping[str, np.ndarray], vec: np.ndarray) -> np.ndarray:
        """`_regs_needed` on arrays."""
        th, tw = k["th"], k["tw"]
        v = vec if p.layout == "nhwc" else 1  # vec_elems
        na, nb = self._cover_many(p, th, 0, 1), self._cover_many(p, tw, 1, 1)
        ek = p.eff_kernel
        xfoot = np.where(self._x_footprint_many(p, k),
                         ((na - 1) * p.stride[0] + ek[0]) * ((nb - 1) * p.stride[1] + ek[1]), 0)
        aligned = na * nb * v * (2 if self.pool == "max" else 1) + 2 * tw * v + 32 + xfoot
        return np.where(self._aligned_many(p, k), aligned, th * tw * v + 4 * v + 32)

    # ---- the cost model's hooks (`OpSpec.model_*`) ----
    def model_vec_bytes(self, p: PoolProblem, config: Config) -> int:
        """NHWC: vec_bytes of channels. NCHW: rows of x as vectors only where the covering
        outputs' x footprint is read (`x_footprint`), else one element at a time."""
        if p.layout != "nchw":
            return config["vec_bytes"]
        return DTYPES[p.dtype]["itemsize"] * (self.row_vec_elems(p, config) if self.x_footprint(p, config) else 1)

    def model_scatter(self, p: PoolProblem, config: Config) -> bool:
        return config.as_dict().get("algo") == "scatter"

    def model_reread_bytes(self, p: PoolProblem, config: Config) -> float:
        """Max backward recomputing the argmax (gather): a thread's th x tw inputs are covered by
        up to na x nb outputs, each of whose argmax is recomputed from x (`recompute_reads`). The
        overlap is read again (L1/L2) and recomputed: a th=1 tile reads ~2-3x the x a th>=2 tile
        does (the ResNet-stem sweeps: 2x slower)."""
        if getattr(p, "indices", "") != "recompute" or config.as_dict().get("algo") != "gather":
            return 0
        th, tw = self.tile(config)
        x_bytes = p.N * p.C * p.H * p.W * DTYPES[p.dtype]["itemsize"]
        return x_bytes * max(0.0, self.recompute_reads(p, config) / (th * tw) - 1.0)

    def recompute_reads(self, p: PoolProblem, config: Config) -> int:
        """x elements a thread reads to recompute the argmax of the outputs covering its th x tw
        tile: the x footprint under their windows (NCHW aligned tiles, XR x XC), else each
        covering output's window (aligned), else the windows of the tile's cover span."""
        if self.x_footprint(p, config):
            xr, xc = self._x_footprint_dims(p, config)
            return xr * xc
        if self.aligned_gather(p, config):
            na, nb = self.cover_counts(p, config)
            return na * nb * p.kernel[0] * p.kernel[1]
        th, tw = self.tile(config)
        (ekh, ekw), (sh, sw) = p.eff_kernel, p.stride
        return -(-(th + ekh - 1) // sh) * -(-(tw + ekw - 1) // sw) * p.kernel[0] * p.kernel[1]

    def launches(self, p: PoolProblem, config: Config, target: Target) -> tuple[Launch, ...]:
        main = super().launches(p, config, target)
        if config["algo"] != "scatter":
            return main
        name, t = main[0].kernel, config["threads"]
        fill = (min(_cdiv(_cdiv(p.numel * 4, 16), t), 65536), 1, 1)  # grid-stride loops
        if self._scatter_to_ws(p):
            return (Launch(f"{name}_zero", fill, (t, 1, 1)), main[0], Launch(f"{name}_convert", fill, (t, 1, 1)))
        return (Launch(f"{name}_zero", fill, (t, 1, 1)), main[0])

    def workspace_bytes(self, p: PoolProblem, config: Config) -> int:
        return p.numel * 4 if config["algo"] == "scatter" and self._scatter_to_ws(p) else 0

    def render_context(self, p: PoolProblem, config: Config, target: Target) -> dict[str, Any]:
        ctx = super().render_context(p, config, target)
        ctx["scatter_ws"] = self._scatter_to_ws(p)
        if self.aligned_gather(p, config):
            ch, cw = self._cover(p, config, 0), self._cover(p, config, 1)
            (h0, hn), (w0, wn) = _cover_span(ch), _cover_span(cw)
            ctx.update(aligned=True, cover_h=ch, cover_w=cw, cover_h0=h0, cover_hn=hn, cover_w0=w0, cover_wn=wn,
                       xfoot=self.x_footprint(p, config))
        return ctx

    def output_buffers(self, p: PoolProblem) -> dict[str, tuple[int, Any]]:
        return {"dx": (p.numel, _STORAGE_BITS[p.dtype])}

    def unpack_outputs(self, p: PoolProblem, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"dx": self._logical(p, from_storage(raw["dx"], p.dtype), p.H, p.W)}
