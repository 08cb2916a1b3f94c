"""The eager fast path: `torch.autograd.Function`s over the same CUDA kernels as the custom ops.

Why: an eager call of an operator with a Python autograd formula goes through the dispatcher's
Python glue (schema binding, pytree flattening, the generated autograd function, the
`setup_context` call) on every call. Measured on an H100 host (tools/torch-host-diag.py,
bench/results/logs/torch_eager_host_diag-*.log), when the ops were still `torch.library.custom_op`s:
a max pool forward with a gradient took 416 us of host time through the op against 61 us for
the plain ckgen call, and a converted training step got slower than PyTorch's although its GPU
time got faster.

So, in eager mode, `ckgen.torch.functional` (and so the modules and `convert`) call these
Functions with a `Call`: what one call signature (x's shape, strides, dtype and device, the op's
arguments) decided once - the fallback reason or None, the pooling pairs as tuples, x's memory
format, and whether ckgen's dispatcher serves each kernel the call runs. A repeated call (every
training step) then costs a dict lookup before ckgen's own per-signature fast path: no argument
checks, no `_not_served` signature, no list/tuple conversions. A kernel the dispatcher does not
serve runs the custom op's CUDA implementation (`ops.cuda_<op>`), which falls back to PyTorch
and logs it, as the custom ops do.

The custom ops stay what torch.compile traces (the Functions are used only when nothing traces:
no Dynamo, no dispatch mode such as FakeTensorMode, plain CUDA tensors), and what a double
backward goes through (`DoubleBackwardError`, as with the custom ops)."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from . import ops

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# Tests set this (with functional._ROUTE_CPU) to run the Functions on CPU tensors: the CUDA
# implementations then fall back to the PyTorch computation, so the autograd wiring is
# checked without a GPU.
_CPU_FOR_TESTS = False
_NONES = (None,) * 8
_ck: Any = None


def _ckgen() -> Any:
    global _ck
    if _ck is None:
        import ckgen

        _ck = ckgen
    return _ck


def usable(x: Tensor) -> bool:
    """True when the eager Functions may run for x: a plain CUDA tensor, outside torch.compile's
    tracing and outside any dispatch mode (FakeTensorMode, make_fx, ...)."""
    return (not torch.compiler.is_compiling() and type(x) in _PLAIN
            and (x.is_cuda or (_CPU_FOR_TESTS and x.device.type == "cpu"))
            and torch._C._len_torch_dispatch_stack() == 0)


class Call:
    """One eager call signature's decisions (made by `ckgen.torch.functional`, cached there).

    - why: None when ckgen's ops take the call, else the reason PyTorch's op runs;
    - op-specific fields: groups, activation and fix_params (weight or bias needs a cast to x's
      dtype or a contiguous copy); or kernel, stride, padding, dilation (int
      pairs as tuples), ceil_mode, count_include_pad, divisor_override;
    - fmt: x's memory format (the layout the backward's dy is given in);
    - `serves(variant, x)`: whether ckgen's dispatcher runs that kernel (asked once per variant:
      `ops._not_served`)."""

    __slots__ = ("why", "groups", "act", "fix_params", "k", "s", "p", "d", "ceil", "cip", "div", "fmt", "_served")

    def __init__(self, why: Optional[str], **fields: Any) -> None:
        self.why, self._served = why, {}
        for name in self.__slots__[1:-1]:
            setattr(self, name, fields.get(name))

    def serves(self, variant: str, x: Tensor) -> bool:
        ok = self._served.get(variant)
        if ok is None:
            ok = self._served[variant] = self._ask(variant, x) is None
        return ok

    def _ask(self, variant: str, x: Tensor) -> Optional[str]:
        if x.device.type != "cuda":  # the CPU test route: the ops' implementations fall back
            return "not a CUDA tensor"
        if variant.startswith("groupnorm"):
            return ops._not_served(variant, x, G=self.groups, activation=self.act or "none")
        pool = dict(kernel=self.k, stride=self.s, padding=self.p, ceil_mode=self.ceil)
        if variant == "maxpool2d_fwd":
            return ops._not_served(variant, x, return_indices=False, dilation=self.d, **pool)
        if variant == "maxpool2d_fwd_with_indices":
            return ops._not_served("maxpool2d_fwd", x, return_indices=True, dilation=self.d, **pool)
        if variant in ("maxpool2d_bwd stored", "maxpool2d_bwd recompute"):
            return ops._not_served("maxpool2d_bwd", x, indices=variant.split()[1], dilation=self.d, **pool)
        return ops._not_served(variant, x, count_include_pad=self.cip, divisor_override=self.div, **pool)


def _grad_in(dy: Tensor, call: Call, dtype: torch.dtype) -> Tensor:
    """The incoming gradient in x's dtype and layout (a no-op when it already is)."""
    if dy.dtype != dtype:
        dy = dy.to(dtype)
    return dy if dy.is_contiguous(memory_format=call.fmt) else dy.contiguous(memory_format=call.fmt)


def groupnorm_forward(x: Tensor, w: Optional[Tensor], b: Optional[Tensor], call: Call, eps: float):
    """(y, mean, rstd) of ckgen's GroupNorm forward (its fallback where the dispatcher cannot serve)."""
    if call.serves("groupnorm_fwd", x):
        return _ckgen().groupnorm_fwd(x, w, b, call.groups, eps=eps, activation=call.act)
    return ops.cuda_groupnorm_fwd(x, w, b, call.groups, eps, call.act or "none")


class GroupNormFn(torch.autograd.Function):
    """y = GroupNorm(x) (+ swish); mean and rstd stay inside (the backward's inputs)."""

    @staticmethod
    def forward(ctx, x: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor], call: Call, eps: float) -> Tensor:
        y, mean, rstd = groupnorm_forward(x, gamma, beta, call, eps)
        ctx.call = call
        ctx.stats = (mean, rstd)  # made here, never seen outside: no version check needed
        ctx.save_for_backward(x, gamma, beta if call.act else None)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, gamma, beta = ctx.saved_tensors
        mean, rstd = ctx.stats
        call = ctx.call
        need_x, need_g, need_b = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph=True: through the ops, whose backward raises DoubleBackwardError
            grads = ops.gn_grads(dy, x, gamma, beta, mean, rstd, call.groups, call.act or "none",
                                 need_x, need_g, need_b)
            return (*grads, None, None)
        dy = _grad_in(dy, call, x.dtype)
        dx = dgamma = dbeta = None
        G, act = call.groups, call.act
        if need_x and (need_g or need_b):
            if call.serves("groupnorm_bwd", x):
                dx, dgamma, dbeta = _ckgen().groupnorm_bwd(dy, x, mean, rstd, gamma, G, beta, activation=act)
            else:
                dx, dgamma, dbeta = ops.cuda_groupnorm_bwd(dy, x, mean, rstd, gamma, G, beta, act or "none")
        elif need_x:
            if call.serves("groupnorm_bwd_data", x):
                dx = _ckgen().groupnorm_bwd_data(dy, x, mean, rstd, gamma, G, beta, activation=act)
            else:
                dx = ops.cuda_groupnorm_bwd_data(dy, x, mean, rstd, gamma, G, beta, act or "none")
        elif need_g or need_b:
            if call.serves("groupnorm_bwd_gamma_beta", x):
                dgamma, dbeta = _ckgen().groupnorm_bwd_gamma_beta(dy, x, mean, rstd, G, gamma, beta, activation=act)
            else:
                dgamma, dbeta = ops.cuda_groupnorm_bwd_gamma_beta(dy, x, mean, rstd, G, gamma, beta, act or "none")
        return dx, dgamma if need_g else None, dbeta if need_b else None, None, None


def maxpool_forward(x: Tensor, call: Call, store: bool):
    """y (store=False) or (y, indices) of ckgen's max pool forward."""
    if store:
        if call.serves("maxpool2d_fwd_with_indices", x):
            return _ckgen().maxpool2d_fwd(x, call.k, call.s, call.p, call.d, call.ceil, True)
        return ops.cuda_maxpool2d_fwd_with_indices(x, list(call.k), list(call.s), list(call.p), list(call.d),
                                                   call.ceil)
    if call.serves("maxpool2d_fwd", x):
        return _ckgen().maxpool2d_fwd(x, call.k, call.s, call.p, call.d, call.ceil)
    return ops.cuda_maxpool2d_fwd(x, list(call.k), list(call.s), list(call.p), list(call.d), call.ceil)


class MaxPoolFn(torch.autograd.Function):
    """y = max_pool2d(x); with store=True the forward also writes int64 indices (kept for the
    backward, not returned), else the backward recomputes the argmax from x."""

    @staticmethod
    def forward(ctx, x: Tensor, call: Call, store: bool) -> Tensor:
        if store:
            y, idx = maxpool_forward(x, call, True)
        else:
            y, idx = maxpool_forward(x, call, False), None
        ctx.call, ctx.indices = call, idx
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        (x,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        call, idx = ctx.call, ctx.indices
        dy = _grad_in(dy, call, x.dtype)
        if torch.is_grad_enabled():  # create_graph=True: the op raises DoubleBackwardError on the next backward
            return ops.maxpool2d_bwd(dy, x, list(call.k), list(call.s), list(call.p), list(call.d), call.ceil,
                                     idx), None, None
        if call.serves("maxpool2d_bwd recompute" if idx is None else "maxpool2d_bwd stored", x):
            return _ckgen().maxpool2d_bwd(dy, x, call.k, call.s, call.p, call.d, call.ceil, idx), None, None
        return ops.cuda_maxpool2d_bwd(dy, x, list(call.k), list(call.s), list(call.p), list(call.d), call.ceil,
                                      idx), None, None


def avgpool_forward(x: Tensor, call: Call) -> Tensor:
    if call.serves("avgpool2d_fwd", x):
        return _ckgen().avgpool2d_fwd(x, call.k, call.s, call.p, call.ceil, call.cip, call.div)
    return ops.cuda_avgpool2d_fwd(x, list(call.k), list(call.s), list(call.p), call.ceil, call.cip, call.div)


class AvgPoolFn(torch.autograd.Function):
    """y = avg_pool2d(x); the backward needs only x's shape, dtype, device and layout."""

    @staticmethod
    def forward(ctx, x: Tensor, call: Call) -> Tensor:
        ctx.call = call
        ctx.x_meta = ops.avg_x_meta(x)
        return avgpool_forward(x, call)

    @staticmethod
    def backward(ctx, dy: Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        call = ctx.call
        params = (list(call.k), list(call.s), list(call.p), call.ceil, call.cip, call.div)
        if torch.is_grad_enabled():  # create_graph=True: through the op (DoubleBackwardError next)
            return ops.avg_dx(dy, ctx.x_meta, params), None
        shape, dtype, device, fmt = ctx.x_meta
        x_like = torch.empty(shape, dtype=dtype, device=device, memory_format=fmt)  # never read
        dy = _grad_in(dy, call, dtype)
        if call.serves("avgpool2d_bwd", x_like):
            return _ckgen().avgpool2d_bwd(dy, x_like, call.k, call.s, call.p, call.ceil, call.cip, call.div), None
        return ops.cuda_avgpool2d_bwd(dy, x_like, *params), None


__all__ = ["AvgPoolFn", "Call", "GroupNormFn", "MaxPoolFn", "usable"]
