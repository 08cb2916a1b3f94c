"""The eager fast path: `torch.autograd.Function`s over the same CUDA kernels as the custom ops.

Why: an eager call of an operator with a Python autograd formula goes through the dispatcher's
Python glue (schema binding, pytree flattening, the generated autograd function, the
`setup_context` call) on every call. Measured with tools/torch-host-diag.py through a
`torch.library.custom_op`: a max pool forward with a gradient took 416 us of host time through
the op against 61 us for the plain ckgen call, enough to make a converted training step slower
than PyTorch's although its GPU time was faster.

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

from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

import ckgen

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


def _maxpool_fwd_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode):
    return ckgen.maxpool2d_fwd(x, kernel_size, stride, padding, dilation, ceil_mode, True)


class Kernel(NamedTuple):
    """One kernel an eager Function runs, under its variant name (`Call.kernel`'s key):
    - op: the ckgen op the dispatcher is asked about;
    - run: ckgen's function (it takes the custom op's arguments);
    - fallback: the custom op whose CUDA implementation (`ops.cuda_<fallback>`) runs where the
      dispatcher does not serve the call;
    - fields: the problem fields of the call beyond x's (`ops._not_served`'s keywords)."""

    op: str
    run: Callable
    fallback: str
    fields: Callable[["Call"], dict]


# every kernel the Functions below run; the per-op entries sit with their Functions
KERNELS: dict[str, Kernel] = {}


class Call:
    """One eager call signature's decisions (made by `ckgen.torch.functional`, cached there).

    - why: None when ckgen's ops take the call, else the reason PyTorch's op runs;
    - op-specific fields: groups, act ("none" or "swish") and fix_params (weight or bias needs a
      cast to x's dtype or a contiguous copy); or kernel, stride, padding, dilation (int pairs as
      tuples), ceil_mode, count_include_pad, divisor_override;
    - fmt: x's memory format (the layout the backward's dy is given in);
    - `kernel(name, x)`: the function that runs op `name` for this call."""

    __slots__ = ("why", "groups", "act", "fix_params", "k", "s", "p", "d", "ceil", "cip", "div", "fmt", "_served")

    def __init__(self, why: Optional[str], **fields: Any) -> None:
        self.why, self._served = why, {}
        for name in self.__slots__[1:-1]:
            setattr(self, name, fields.get(name))

    def kernel(self, name: str, x: Tensor, variant: Optional[str] = None) -> Callable:
        """ckgen's function for the kernel `variant` (default `name`; a key of KERNELS) when
        ckgen's dispatcher serves this call (asked once per variant: `ops._not_served`), else the
        custom op's CUDA implementation, which falls back to PyTorch and logs it. Both take the
        custom op's arguments (the pooling pairs may be tuples)."""
        key = variant or name
        ok = self._served.get(key)
        if ok is None:
            ok = self._served[key] = self._ask(key, x) is None
        k = KERNELS[key]
        return k.run if ok else getattr(ops, "cuda_" + k.fallback)

    def _ask(self, variant: str, x: Tensor) -> Optional[str]:
        if x.device.type != "cuda":  # the CPU test route: the ops' implementations fall back
            return "not a CUDA tensor"
        k = KERNELS[variant]
        return ops._not_served(k.op, x, **k.fields(self))


def _gn_fields(call: Call) -> dict:
    return dict(G=call.groups, activation=call.act)


def _pool_fields(call: Call) -> dict:
    return dict(kernel=call.k, stride=call.s, padding=call.p, ceil_mode=call.ceil)


def _max_fields(**extra: Any) -> Callable[[Call], dict]:
    return lambda call: dict(**extra, dilation=call.d, **_pool_fields(call))


def _avg_fields(call: Call) -> dict:
    return dict(count_include_pad=call.cip, divisor_override=call.div, **_pool_fields(call))


KERNELS.update({name: Kernel(name, getattr(ckgen, name), name, _gn_fields) for name in (
    "groupnorm_fwd", "groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta")})


def groupnorm_forward(x: Tensor, w: Optional[Tensor], b: Optional[Tensor], call: Call, eps: float):
    """(y, mean, rstd) of ckgen's GroupNorm forward (its fallback where the dispatcher cannot serve)."""
    return call.kernel("groupnorm_fwd", x)(x, w, b, call.groups, eps, call.act)


class GroupNormFn(torch.autograd.Function):
    """y = GroupNorm(x) (+ swish); mean and rstd stay inside (the backward's inputs)."""

    @staticmethod
    def forward(ctx, x: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor], call: Call, eps: float) -> Tensor:
        y, mean, rstd = groupnorm_forward(x, gamma, beta, call, eps)
        ctx.call = call
        ctx.stats = (mean, rstd)  # made here, never seen outside: no version check needed
        ctx.save_for_backward(x, gamma, beta if call.act == "swish" else None)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, gamma, beta = ctx.saved_tensors
        mean, rstd = ctx.stats
        call = ctx.call
        # create_graph=True goes through the custom ops, whose backward raises DoubleBackwardError
        impl = None if torch.is_grad_enabled() else (lambda name: call.kernel(name, x))
        grads = ops.gn_grads(dy, x, gamma, beta, mean, rstd, call.groups, call.act, *ctx.needs_input_grad[:3],
                             impl=impl)
        return (*grads, None, None)


KERNELS.update({
    "maxpool2d_fwd": Kernel("maxpool2d_fwd", ckgen.maxpool2d_fwd, "maxpool2d_fwd", _max_fields(return_indices=False)),
    "maxpool2d_fwd_with_indices": Kernel("maxpool2d_fwd", _maxpool_fwd_with_indices, "maxpool2d_fwd_with_indices",
                                         _max_fields(return_indices=True)),
    "maxpool2d_bwd stored": Kernel("maxpool2d_bwd", ckgen.maxpool2d_bwd, "maxpool2d_bwd", _max_fields(indices="stored")),
    "maxpool2d_bwd recompute": Kernel("maxpool2d_bwd", ckgen.maxpool2d_bwd, "maxpool2d_bwd",
                                      _max_fields(indices="recompute")),
})


def maxpool_forward(x: Tensor, call: Call, store: bool):
    """y (store=False) or (y, indices) of ckgen's max pool forward."""
    return call.kernel("maxpool2d_fwd_with_indices" if store else "maxpool2d_fwd", x)(
        x, call.k, call.s, call.p, call.d, call.ceil)


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
        if torch.is_grad_enabled():  # create_graph=True: the op raises DoubleBackwardError on the next backward
            bwd = ops.maxpool2d_bwd
        else:
            bwd = call.kernel("maxpool2d_bwd", x, "maxpool2d_bwd " + ("recompute" if idx is None else "stored"))
        return bwd(ops.grad_like(dy, call.fmt, x.dtype), x, call.k, call.s, call.p, call.d, call.ceil, idx), None, None


KERNELS.update({name: Kernel(name, getattr(ckgen, name), name, _avg_fields)
                for name in ("avgpool2d_fwd", "avgpool2d_bwd")})


def avgpool_forward(x: Tensor, call: Call) -> Tensor:
    return call.kernel("avgpool2d_fwd", x)(x, call.k, call.s, call.p, call.ceil, call.cip, call.div)


class AvgPoolFn(torch.autograd.Function):
    """y = avg_pool2d(x); the backward needs only x's shape, dtype, device and layout."""

    @staticmethod
    def forward(ctx, x: Tensor, call: Call) -> Tensor:
        ctx.call = call
        ctx.x_meta = ops.avg_x_meta(x)
        ctx.bwd = call.kernel("avgpool2d_bwd", x)  # asked with x: the backward has only its shape
        return avgpool_forward(x, call)

    @staticmethod
    def backward(ctx, dy: Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        c = ctx.call
        # create_graph=True: through the custom op (DoubleBackwardError on the next backward)
        bwd = None if torch.is_grad_enabled() else ctx.bwd
        return ops.avg_dx(dy, ctx.x_meta, (c.k, c.s, c.p, c.ceil, c.cip, c.div), bwd), None


__all__ = ["AvgPoolFn", "Call", "GroupNormFn", "MaxPoolFn", "usable"]
