"""The eager fast path: `torch.autograd.Function`s over the same CUDA kernels as the custom ops.

Why: an eager call of an operator with a Python autograd formula goes through the dispatcher's
Python glue (schema binding, pytree flattening, the generated autograd function, the
`setup_context` call) on every call. Measured on an H100 host (tools/torch-host-diag.py,
bench/results/logs/torch_eager_host_diag-*.log), when the ops were still `torch.library.custom_op`s:
a max pool forward with a gradient took 416 us of host time through the op against 61 us for
the plain ckgen call, and a converted training step got slower than PyTorch's although its GPU
time got faster.

So, in eager mode, `ckgen.torch.functional` (and so the modules and `convert`) call these
Functions: forward and backward call the custom ops' own CUDA implementations
(`ops.cuda_<op>`) directly: the same kernels, fallbacks and logs, without the glue. The custom
ops stay what torch.compile traces (the Functions are used only when nothing traces: no
Dynamo, no dispatch mode such as FakeTensorMode, plain CUDA tensors), and what a double
backward goes through (`DoubleBackwardError`, as with the custom ops)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import ops

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# Tests set this (with functional._ROUTE_CPU) to run the Functions on CPU tensors: the CUDA
# implementations then fall back to the PyTorch computation, so the autograd wiring is
# checked without a GPU.
_CPU_FOR_TESTS = False


def usable(x: Tensor) -> bool:
    """True when the eager Functions may run for x: a plain CUDA tensor, outside torch.compile's
    tracing and outside any dispatch mode (FakeTensorMode, make_fx, ...)."""
    return (not torch.compiler.is_compiling() and type(x) in _PLAIN
            and (x.is_cuda or (_CPU_FOR_TESTS and x.device.type == "cpu"))
            and torch._C._len_torch_dispatch_stack() == 0)


class GroupNormFn(torch.autograd.Function):
    """y = GroupNorm(x) (+ swish); mean and rstd stay inside (the backward's inputs)."""

    @staticmethod
    def forward(ctx, x: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor], groups: int, eps: float,
                activation: str) -> Tensor:
        y, mean, rstd = ops.cuda_groupnorm_fwd(x, gamma, beta, groups, eps, activation)
        ctx.groups, ctx.activation = groups, activation
        ctx.stats = (mean, rstd)  # made here, never seen outside: no version check needed
        ctx.save_for_backward(x, gamma, beta if activation == "swish" else None)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, gamma, beta = ctx.saved_tensors
        mean, rstd = ctx.stats
        # create_graph=True goes through the ops, whose backward raises DoubleBackwardError
        grads = ops.gn_grads(dy, x, gamma, beta, mean, rstd, ctx.groups, ctx.activation, *ctx.needs_input_grad[:3],
                             direct=not torch.is_grad_enabled())
        return (*grads, None, None, None)


class MaxPoolFn(torch.autograd.Function):
    """y = max_pool2d(x); with store=True the forward also writes int64 indices (kept for the
    backward, not returned), else the backward recomputes the argmax from x."""

    @staticmethod
    def forward(ctx, x: Tensor, k: list, s: list, p: list, d: list, ceil_mode: bool, store: bool) -> Tensor:
        if store:
            y, idx = ops.cuda_maxpool2d_fwd_with_indices(x, k, s, p, d, ceil_mode)
        else:
            y, idx = ops.cuda_maxpool2d_fwd(x, k, s, p, d, ceil_mode), None
        ctx.params = (k, s, p, d, ceil_mode)
        ctx.indices = idx
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        (x,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None
        bwd = ops.maxpool2d_bwd if torch.is_grad_enabled() else ops.cuda_maxpool2d_bwd
        return bwd(ops.grad_like(dy, x, x.dtype), x, *ctx.params, ctx.indices), None, None, None, None, None, None


class AvgPoolFn(torch.autograd.Function):
    """y = avg_pool2d(x); the backward needs only x's shape, dtype, device and layout."""

    @staticmethod
    def forward(ctx, x: Tensor, k: list, s: list, p: list, ceil_mode: bool, count_include_pad: bool,
                divisor_override: Optional[int]) -> Tensor:
        ctx.params = (k, s, p, ceil_mode, count_include_pad, divisor_override)
        ctx.x_meta = ops.avg_x_meta(x)
        return ops.cuda_avgpool2d_fwd(x, k, s, p, ceil_mode, count_include_pad, divisor_override)

    @staticmethod
    def backward(ctx, dy: Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None
        return ops.avg_dx(dy, ctx.x_meta, ctx.params, direct=not torch.is_grad_enabled()), None, None, None, None, \
            None, None


__all__ = ["AvgPoolFn", "GroupNormFn", "MaxPoolFn", "usable"]
