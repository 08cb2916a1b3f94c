"""The pooling family's plug-in hooks (`PoolHooks`, a base of `base._PoolOp`): its `ckgen tune`
/ `ckgen explain` options, the features of its tuning records, `ckgen explain`'s fields, the
benchmark's torch inputs and the sanitizer's problems. The ops' own benchmark calls are in
max.py and avg.py."""
from __future__ import annotations

from typing import Any, ClassVar

from ..spec import OptionGroup, ProblemOption
from .problem import PoolProblem

POOL_OPTIONS = OptionGroup("pooling problem", "with --shape, for maxpool2d_* / avgpool2d_*", (
    ProblemOption("--kernel", "kernel size: K or KH,KW (required with --shape; no default)", type="ints",
                  fields=("kernel_size", "kernel")),
    ProblemOption("--stride", "stride: S or SH,SW (default: the kernel)", type="ints", fields=("stride",)),
    ProblemOption("--padding", "padding: P or PH,PW (default: 0)", type="ints", fields=("padding",)),
    ProblemOption("--dilation", "max pooling: D or DH,DW (default: 1)", type="ints", fields=("dilation",)),
    ProblemOption("--ceil-mode", "ceil instead of floor for the output size (default: floor)", action="store_true"),
    ProblemOption("--count-include-pad", "avg pooling: count the padding in the divisor (default: yes)",
                  action="bool"),
    ProblemOption("--divisor-override", "avg pooling: divide by this positive integer instead (default: none)",
                  type="positive_int", fields=("divisor_override",)),
    ProblemOption("--return-indices", "maxpool2d_fwd: also write int64 indices (default: no)", action="store_true"),
    ProblemOption("--indices", "maxpool2d_bwd: read stored int64 indices or recompute the argmax from x "
                  "(default: stored)", choices=("stored", "recompute"), fields=("indices",)),
))
# tools/sanitize_ops.py's pooling problems: a small shape with ragged tails, two geometries per
# kind (one with padding, ceil_mode and, for max, dilation)
SANITIZE_SHAPE = {"N": 2, "C": 24, "H": 13, "W": 17}
SANITIZE_GEOS = {"max": [{"kernel": 3, "stride": 2, "padding": 1},
                         {"kernel": (3, 2), "stride": (2, 1), "padding": (1, 0), "dilation": (2, 1), "ceil_mode": True}],
                 "avg": [{"kernel": 3, "stride": 2, "padding": 1},
                         {"kernel": 4, "stride": 3, "padding": 2, "ceil_mode": True, "count_include_pad": False}]}


class PoolHooks:
    """What the four pooling ops give the CLI, the records, `ckgen bench` and the sanitizer."""

    pool: ClassVar[str]  # "max" | "avg"
    backward: ClassVar[bool]

    problem_options: ClassVar[OptionGroup | None] = POOL_OPTIONS
    #: the sanitizer's problem variants beyond the geometry (e.g. max pool backward's index modes)
    sanitize_extra: ClassVar[tuple[dict[str, Any], ...]] = ({},)

    def problem_features(self, p: PoolProblem) -> dict[str, Any]:
        out = super().problem_features(p)
        out.update(planes=p.N * p.C, kernel=list(p.kernel), stride=list(p.stride), out_hw=p.OH * p.OW)
        return out

    def explain_fields(self, p: PoolProblem) -> dict[str, Any]:
        f = {k: getattr(p, k) for k in ("N", "C", "H", "W", "dtype", "layout")}
        f.update(kernel=p.kernel, stride=p.stride, padding=p.padding, ceil_mode=p.ceil_mode)
        f.update(self._explain_extra(p))
        return f

    def _explain_extra(self, p: PoolProblem) -> dict[str, Any]:
        return {}

    def sanitize_problems(self) -> list[PoolProblem]:
        """fp32, bf16 (and fp16 for the forward ops) x both layouts x SANITIZE_GEOS x `sanitize_extra`."""
        dtypes = ("fp32", "bf16") if self.backward else ("fp32", "bf16", "fp16")
        return [self.parse_problem(**SANITIZE_SHAPE, dtype=dt, layout=lay, **geo, **ex)
                for dt in dtypes for lay in ("nchw", "nhwc")
                for geo in SANITIZE_GEOS[self.pool] for ex in self.sanitize_extra]

    def _bench_x(self, p: PoolProblem, device: str) -> tuple[Any, Any, Any]:
        """x (in p's layout) as a torch tensor on `device`, its torch dtype and memory format."""
        import torch

        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[p.dtype]
        fmt = torch.channels_last if p.layout == "nhwc" else torch.contiguous_format
        x = (torch.randn(p.N, p.C, p.H, p.W, device=device) + 0.25).to(dt).contiguous(memory_format=fmt)
        return x, dt, fmt

    @staticmethod
    def _bench_args(p: PoolProblem) -> tuple[list[int], list[int], list[int], list[int], bool]:
        return list(p.kernel), list(p.stride), list(p.padding), list(p.dilation), bool(p.ceil_mode)
