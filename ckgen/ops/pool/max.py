"""Max pooling: MaxPool2dFwd (optional int64 indices) and MaxPool2dBwd (stored indices or the
argmax recomputed from x)."""
from __future__ import annotations

from typing import Any, ClassVar, Mapping

import numpy as np

from ...types import DTYPES, Config, Launch, Support, Target, Tolerance
from ..numeric import from_storage, round_to, to_storage
from .base import _STORAGE_BITS, _cdiv, _PoolOp
from .bwd import _PoolBwd
from .problem import MaxPoolBwdProblem, MaxPoolFwdProblem, PoolProblem, maxpool2d_bwd_reference, maxpool2d_reference, tie_heavy

# max pool backward: a sum of the few dy of overlapping windows in fp32, rounded once
_MAXBWD_TOL = {"fp32": Tolerance(1e-6, 2e-6), "fp16": Tolerance(1e-5, 1e-3), "bf16": Tolerance(1e-5, 8e-3)}
SMEM_MAX = 48 * 1024  # dynamic shared memory a block may use without opting in (CUDA and HIP)


class MaxPool2dFwd(_PoolOp):
    name: ClassVar[str] = "maxpool2d_fwd"
    tune_options: ClassVar[tuple[str, ...]] = (*_PoolOp.tune_options, "dilation", "return_indices")
    template: ClassVar[str] = "maxpool2d_fwd.cu.j2"
    problem_cls: ClassVar[type] = MaxPoolFwdProblem
    pool: ClassVar[str] = "max"
    backward: ClassVar[bool] = False

    def _extra_defaults(self, case: Mapping[str, Any]) -> dict[str, Any]:
        return {"return_indices": case.get("return_indices", False)}

    def _extra_cli(self, args: Any) -> dict[str, Any]:
        return {"return_indices": bool(getattr(args, "return_indices", False))}

    def _name_flags(self, p: MaxPoolFwdProblem) -> str:
        return "_idx" if p.return_indices else ""

    def _context_flags(self, p: MaxPoolFwdProblem) -> dict[str, Any]:
        return {"return_indices": p.return_indices}

    def _acc_words(self, p: MaxPoolFwdProblem, config: Config) -> int:
        th, tw = self.tile(config)
        vec = self.vec_elems(p, config)
        if p.layout == "nhwc" and not p.return_indices and config["vec_bytes"] >= 4:
            vec = config["vec_bytes"] // 4  # the running max stays in packed storage words
        return th * tw * vec * (2 if p.return_indices else 1)  # with indices: a max and an index each

    def _acc_words_many(self, p: MaxPoolFwdProblem, k: Mapping[str, np.ndarray], vec: np.ndarray) -> np.ndarray:
        vb = k["vec_bytes"]
        v = vec if p.layout == "nhwc" else 1
        if p.layout == "nhwc" and not p.return_indices:
            v = np.where(vb >= 4, vb // 4, v)
        return k["th"] * k["tw"] * v * (2 if p.return_indices else 1)

    def min_bytes(self, p: MaxPoolFwdProblem) -> int:
        item = DTYPES[p.dtype]["itemsize"]
        return p.numel * item + p.out_numel * (item + (8 if p.return_indices else 0))

    def make_inputs(self, p: PoolProblem, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"x": tie_heavy(p, rng)}

    def reference(self, p: MaxPoolFwdProblem, inputs: Mapping[str, np.ndarray], eps: float = 0.0) -> dict[str, np.ndarray]:
        y, idx = maxpool2d_reference(p, inputs["x"])
        return {"y": y, "indices": idx} if p.return_indices else {"y": y}

    def tolerance(self, dtype: str, output: str) -> Tolerance:
        return Tolerance(0.0, 0.0)  # max pooling selects; it never rounds

    def output_buffers(self, p: MaxPoolFwdProblem) -> dict[str, tuple[int, Any]]:
        out = {"y": (p.out_numel, _STORAGE_BITS[p.dtype])}
        if p.return_indices:
            out["indices"] = (p.out_numel, np.int64)
        return out

    def unpack_outputs(self, p: MaxPoolFwdProblem, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {"y": self._logical(p, from_storage(raw["y"], p.dtype), p.OH, p.OW)}
        if "indices" in raw:
            out["indices"] = self._logical(p, raw["indices"], p.OH, p.OW)
        return out


    # ---- plug-in hooks: benchmark ----
    def _explain_extra(self, p: MaxPoolFwdProblem) -> dict[str, Any]:
        return {"dilation": p.dilation, "return_indices": p.return_indices}

    def bench_callables(self, p: MaxPoolFwdProblem, device: str = "cuda", call: Any = None) -> tuple[Any, Any, str]:
        """ckgen.maxpool2d_fwd against F.max_pool2d (with indices if the problem has them)."""
        import torch.nn.functional as F


        x, _, _ = self._bench_x(p, device)
        k, s, pad, d, ceil = self._bench_args(p)
        ri = bool(p.return_indices)
        return (lambda: call(x, k, s, pad, d, ceil, return_indices=ri)), \
            (lambda: F.max_pool2d(x, k, s, pad, d, ceil_mode=ceil, return_indices=ri)), "F.max_pool2d"


class MaxPool2dBwd(_PoolBwd):
    name: ClassVar[str] = "maxpool2d_bwd"
    tune_options: ClassVar[tuple[str, ...]] = (*_PoolOp.tune_options, "dilation", "indices")
    template: ClassVar[str] = "maxpool2d_bwd.cu.j2"
    problem_cls: ClassVar[type] = MaxPoolBwdProblem
    pool: ClassVar[str] = "max"

    def _extra_defaults(self, case: Mapping[str, Any]) -> dict[str, Any]:
        return {"indices": case.get("indices", "stored")}

    def _extra_cli(self, args: Any) -> dict[str, Any]:
        return {"indices": getattr(args, "indices", None) or "stored"}

    # ---- plug-in hooks: benchmark, sanitizer ----
    sanitize_extra: ClassVar[tuple[dict[str, Any], ...]] = ({"indices": "stored"}, {"indices": "recompute"})

    def _explain_extra(self, p: MaxPoolBwdProblem) -> dict[str, Any]:
        return {"dilation": p.dilation, "indices": p.indices}

    def bench_callables(self, p: MaxPoolBwdProblem, device: str = "cuda", call: Any = None) -> tuple[Any, Any, str]:
        """ckgen.maxpool2d_bwd (stored indices or recomputed) against aten's
        max_pool2d_with_indices_backward."""
        import torch
        import torch.nn.functional as F


        aten = torch.ops.aten
        x, dt, fmt = self._bench_x(p, device)
        k, s, pad, d, ceil = self._bench_args(p)
        y, idx = F.max_pool2d(x, k, s, pad, d, ceil_mode=ceil, return_indices=True)
        dy = torch.randn(y.shape, device=device).to(dt).contiguous(memory_format=fmt)
        ind = idx if p.indices == "stored" else None
        return (lambda: call(dy, x, k, s, pad, d, ceil, indices=ind)), \
            (lambda: aten.max_pool2d_with_indices_backward(dy, x, k, s, pad, d, ceil, idx)), \
            "max_pool2d_with_indices_backward"

    def _name_flags(self, p: MaxPoolBwdProblem) -> str:
        return "_idx" if p.indices == "stored" else "_recompute"

    def _context_flags(self, p: MaxPoolBwdProblem) -> dict[str, Any]:
        return {"indices": p.indices}

    # ---- algo=smem (indices=None, NCHW): a block's covering outputs in shared memory ----
    def _validate_more(self, p: PoolProblem, config: Config, target: Target) -> Support:
        ok = super()._validate_more(p, config, target)
        if not ok or config["algo"] != "smem":
            return ok
        if getattr(p, "indices", "") != "recompute" or p.layout != "nchw":
            return Support.no("algo=smem: max pool backward with indices=None (recompute), NCHW only")
        if not self.aligned_gather(p, config):
            return Support.no(f"algo=smem: th={config['th']} and tw={config['tw']} must be multiples of "
                              f"the stride {p.stride[0]}x{p.stride[1]}")
        rv = self.row_vec_elems(p, config)
        if rv > 1 and rv % p.stride[1]:
            return Support.no(f"algo=smem: a row vector of {rv} elements is not a whole "
                              f"number of strides {p.stride[1]} (its outputs: a phase-1 strip)")
        smem = self.smem_bytes(p, config)
        if smem > SMEM_MAX:
            return Support.no(f"algo=smem: {smem} bytes of shared memory for a block's outputs exceed {SMEM_MAX}")
        return ok

    def smem_strip(self, p: PoolProblem, config: Config) -> int:
        """algo=smem: adjacent outputs per phase-1 strip (the template's OWT): a row vector's worth
        of input columns."""
        return max(1, self.row_vec_elems(p, config) // p.stride[1])

    def smem_rows(self, p: PoolProblem, config: Config) -> int:
        """algo=smem: dx rows per block (the template's ck_smem_rows): whole th-row tiles, about
        threads x tw x block_rows elements, at least one tile, at most the plane."""
        th, tw = self.tile(config)
        work = config["threads"] * tw * config["block_rows"]
        return max(1, min(work // p.W, _cdiv(p.H, th))) * th

    def _smem_out_rows(self, p: PoolProblem, config: Config) -> int:
        """algo=smem: at most how many output rows have windows that touch one block's bh dx rows:
        pend(r0 + bh - 1) - pstart(r0) <= (bh - 1 + effective kernel) // stride + 1, and <= OH."""
        bh, ek, s = self.smem_rows(p, config), p.eff_kernel[0], p.stride[0]
        return min(p.OH, (bh - 1 + ek) // s + 1)

    def smem_bytes(self, p: PoolProblem, config: Config) -> int:
        """algo=smem: dynamic shared memory per block, dy (fp32) and the argmax (int) of its outputs."""
        return self._smem_out_rows(p, config) * p.OW * 8

    def _blocks(self, p: PoolProblem, config: Config) -> int:
        if config.as_dict().get("algo") == "smem":
            return p.N * p.C * _cdiv(p.H, self.smem_rows(p, config))
        return super()._blocks(p, config)

    def _regs_needed(self, p: PoolProblem, config: Config) -> int:
        regs = super()._regs_needed(p, config)
        if config["algo"] == "smem":  # plus the phase-1 strip's x, KH rows x FC columns
            regs += p.kernel[0] * ((self.smem_strip(p, config) - 1) * p.stride[1] + p.eff_kernel[1])
        return regs

    def _regs_needed_many(self, p: PoolProblem, k: Mapping[str, np.ndarray], vec: np.ndarray) -> np.ndarray:
        regs = super()._regs_needed_many(p, k, vec)
        strip = np.maximum(1, (vec if p.layout == "nchw" else 1) // p.stride[1])  # smem_strip
        return regs + np.where(k["algo"] == "smem", p.kernel[0] * ((strip - 1) * p.stride[1] + p.eff_kernel[1]), 0)

    def launches(self, p: PoolProblem, config: Config, target: Target) -> tuple[Launch, ...]:
        main = super().launches(p, config, target)
        if config["algo"] == "smem":
            return (Launch(main[0].kernel, main[0].grid, main[0].block, self.smem_bytes(p, config)),)
        return main

    def render_context(self, p: PoolProblem, config: Config, target: Target) -> dict[str, Any]:
        ctx = super().render_context(p, config, target)
        if config["algo"] == "smem":
            ctx["owt"] = self.smem_strip(p, config)
        return ctx

    def min_bytes(self, p: MaxPoolBwdProblem) -> int:
        item = DTYPES[p.dtype]["itemsize"]
        if p.indices == "stored":
            return p.out_numel * (item + 8) + p.numel * item
        return p.out_numel * item + 2 * p.numel * item  # dy + x (re-read for the argmax) + dx

    def make_inputs(self, p: MaxPoolBwdProblem, rng: np.random.Generator) -> dict[str, np.ndarray]:
        x = tie_heavy(p, rng)
        dy = round_to(rng.standard_normal((p.N, p.C, p.OH, p.OW)), p.dtype)
        dy[dy == 0] = 0.5
        out = {"x": x, "dy": dy}
        if p.indices == "stored":
            out["indices"] = maxpool2d_reference(p, x)[1]
        return out

    def reference(self, p: MaxPoolBwdProblem, inputs: Mapping[str, np.ndarray], eps: float = 0.0) -> dict[str, np.ndarray]:
        idx = inputs["indices"] if p.indices == "stored" else maxpool2d_reference(p, inputs["x"])[1]
        return {"dx": maxpool2d_bwd_reference(p, inputs["dy"], idx)}

    def tolerance(self, dtype: str, output: str) -> Tolerance:
        return _MAXBWD_TOL[dtype]

    def problem_tolerance(self, p: MaxPoolBwdProblem, output: str) -> Tolerance:
        """An input element gets the sum of the dy of every window whose argmax it is (tie-heavy
        inputs make that common), summed in fp32: for fp32 the rounding error grows with the
        number of windows that can cover one element (`windows_per_element`), as GroupNorm's dgamma/dbeta do with their
        count. (fp16/bf16 round the fp32 sum once: their rtol dominates.) Found by the
        detection grid: 16x512x20x20 k5 s1 fp32 NHWC, 25 windows, failed every config at 1.1x
        the fixed tolerance."""
        t = self.tolerance(p.dtype, output)
        if p.dtype != "fp32":
            return t
        return Tolerance(t.atol + 2e-6 * (p.windows_per_element - 1), t.rtol)

    def pack_inputs(self, p: MaxPoolBwdProblem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {"dy": to_storage(self._plane_major(p, inputs["dy"]), p.dtype)}
        if p.indices == "stored":
            out["indices"] = self._plane_major(p, np.asarray(inputs["indices"], dtype=np.int64))
        else:
            out["x"] = to_storage(self._plane_major(p, inputs["x"]), p.dtype)
        return out
