"""Average pooling: AvgPool2dFwd and AvgPool2dBwd (count_include_pad, divisor_override)."""
from __future__ import annotations

from typing import Any, ClassVar, Mapping

import numpy as np

from ...types import DTYPES, Config, Tolerance
from ..numeric import from_storage, to_storage
from .base import _STORAGE_BITS, _PoolOp
from .bwd import _PoolBwd
from .problem import AvgPoolProblem, PoolProblem, avgpool2d_bwd_reference, avgpool2d_reference, smooth_random

# fp32 accumulation, then one rounding to the dtype (the reference is exact float64)
_AVG_TOL = {"fp32": Tolerance(1e-5, 1e-5), "fp16": Tolerance(1e-4, 1e-3), "bf16": Tolerance(1e-3, 8e-3)}


class AvgPool2dFwd(_PoolOp):
    name: ClassVar[str] = "avgpool2d_fwd"
    tune_options: ClassVar[tuple[str, ...]] = (*_PoolOp.tune_options, "count_include_pad", "divisor_override")
    template: ClassVar[str] = "avgpool2d_fwd.cu.j2"
    problem_cls: ClassVar[type] = AvgPoolProblem
    pool: ClassVar[str] = "avg"
    backward: ClassVar[bool] = False

    def _extra_defaults(self, case: Mapping[str, Any]) -> dict[str, Any]:
        return {"count_include_pad": case.get("count_include_pad", True),
                "divisor_override": case.get("divisor_override", 0)}

    def _extra_cli(self, args: Any) -> dict[str, Any]:
        cip = getattr(args, "count_include_pad", None)
        return {"count_include_pad": True if cip is None else bool(cip),
                "divisor_override": getattr(args, "divisor_override", None) or 0}

    def _name_flags(self, p: AvgPoolProblem) -> str:
        return ("" if p.count_include_pad else "_nopad") + (f"_div{p.divisor_override}" if p.divisor_override else "")

    def _context_flags(self, p: AvgPoolProblem) -> dict[str, Any]:
        return {"count_include_pad": p.count_include_pad, "divisor_override": p.divisor_override}

    def _acc_words(self, p: AvgPoolProblem, config: Config) -> int:
        th, tw = self.tile(config)
        return th * tw * self.vec_elems(p, config)  # fp32 sums

    def _acc_words_many(self, p: AvgPoolProblem, k: Mapping[str, np.ndarray], vec: np.ndarray) -> np.ndarray:
        return k["th"] * k["tw"] * (vec if p.layout == "nhwc" else 1)

    def min_bytes(self, p: AvgPoolProblem) -> int:
        item = DTYPES[p.dtype]["itemsize"]
        return (p.numel + p.out_numel) * item

    def make_inputs(self, p: PoolProblem, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"x": smooth_random(p, rng)}

    def reference(self, p: AvgPoolProblem, inputs: Mapping[str, np.ndarray], eps: float = 0.0) -> dict[str, np.ndarray]:
        return {"y": avgpool2d_reference(p, inputs["x"])}

    def tolerance(self, dtype: str, output: str) -> Tolerance:
        return _AVG_TOL[dtype]

    def output_buffers(self, p: AvgPoolProblem) -> dict[str, tuple[int, Any]]:
        return {"y": (p.out_numel, _STORAGE_BITS[p.dtype])}

    def unpack_outputs(self, p: AvgPoolProblem, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": self._logical(p, from_storage(raw["y"], p.dtype), p.OH, p.OW)}


    # ---- plug-in hooks: benchmark ----
    def _explain_extra(self, p: AvgPoolProblem) -> dict[str, Any]:
        return {"count_include_pad": p.count_include_pad, "divisor_override": p.divisor_override or None}

    def bench_callables(self, p: AvgPoolProblem, device: str = "cuda", call: Any = None) -> tuple[Any, Any, str]:
        """ckgen.avgpool2d_fwd against F.avg_pool2d."""
        import torch.nn.functional as F


        x, _, _ = self._bench_x(p, device)
        k, s, pad, _, ceil = self._bench_args(p)
        cip, dv = bool(p.count_include_pad), (p.divisor_override or None)
        return (lambda: call(x, k, s, pad, ceil, cip, dv)), \
            (lambda: F.avg_pool2d(x, k, s, pad, ceil, cip, dv)), "F.avg_pool2d"


class AvgPool2dBwd(_PoolBwd):
    name: ClassVar[str] = "avgpool2d_bwd"
    tune_options: ClassVar[tuple[str, ...]] = AvgPool2dFwd.tune_options
    template: ClassVar[str] = "avgpool2d_bwd.cu.j2"
    problem_cls: ClassVar[type] = AvgPoolProblem
    pool: ClassVar[str] = "avg"

    _extra_defaults = AvgPool2dFwd._extra_defaults
    _extra_cli = AvgPool2dFwd._extra_cli
    _name_flags = AvgPool2dFwd._name_flags
    _context_flags = AvgPool2dFwd._context_flags
    _explain_extra = AvgPool2dFwd._explain_extra

    def bench_callables(self, p: AvgPoolProblem, device: str = "cuda", call: Any = None) -> tuple[Any, Any, str]:
        """ckgen.avgpool2d_bwd against aten's avg_pool2d_backward."""
        import torch
        import torch.nn.functional as F


        aten = torch.ops.aten
        x, dt, fmt = self._bench_x(p, device)
        k, s, pad, _, ceil = self._bench_args(p)
        cip, dv = bool(p.count_include_pad), (p.divisor_override or None)
        y = F.avg_pool2d(x, k, s, pad, ceil, cip, dv)
        dy = torch.randn(y.shape, device=device).to(dt).contiguous(memory_format=fmt)
        return (lambda: call(dy, x, k, s, pad, ceil, cip, dv)), \
            (lambda: aten.avg_pool2d_backward(dy, x, k, s, pad, ceil, cip, dv)), "avg_pool2d_backward"

    def min_bytes(self, p: AvgPoolProblem) -> int:
        return (p.out_numel + p.numel) * DTYPES[p.dtype]["itemsize"]

    def make_inputs(self, p: AvgPoolProblem, rng: np.random.Generator) -> dict[str, np.ndarray]:
        dy = smooth_random(p, rng, (p.N, p.C, p.OH, p.OW))
        return {"x": smooth_random(p, rng), "dy": dy}

    def reference(self, p: AvgPoolProblem, inputs: Mapping[str, np.ndarray], eps: float = 0.0) -> dict[str, np.ndarray]:
        return {"dx": avgpool2d_bwd_reference(p, inputs["dy"])}

    def tolerance(self, dtype: str, output: str) -> Tolerance:
        return _AVG_TOL[dtype]

    def pack_inputs(self, p: AvgPoolProblem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"dy": to_storage(self._plane_major(p, inputs["dy"]), p.dtype)}
