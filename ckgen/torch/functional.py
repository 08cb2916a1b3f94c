"""Differentiable functions with nn.functional's signatures, running ckgen's custom ops where
ckgen covers the call and PyTorch's op otherwise (logged once with the reason).

    y = group_norm(x, num_groups, weight, bias, eps, activation=None | "swish")  # F.group_norm (+ F.silu)
    y = max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode, return_indices, indices="stored")
    y = avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)

ckgen covers 4-D (N, C, H, W) CUDA tensors of float32, float16 or bfloat16 that are
NCHW-contiguous or channels-last (the output keeps that layout). Anything else - CPU tensors,
3-D (unbatched or (N, C, L)) inputs, other dtypes, other strides, empty tensors, pooling
arguments PyTorch rejects - runs nn.functional's op, which also raises PyTorch's own errors.

In eager mode (nothing tracing, plain CUDA tensors) the calls go through the autograd Functions
of `ckgen.torch.eager`, which run the custom ops' CUDA implementations without the custom op's
per-call glue (hundreds of microseconds of host time a call with autograd); the kernels,
fallbacks and results are the same.

Everything here is traceable by torch.compile(fullgraph=True): the choice depends only on what
Dynamo guards on (device, dtype, rank, strides, requires_grad). Under torch.compile the fallback
is not logged (it is decided once, at trace time); a problem ckgen's dispatcher cannot serve
falls back inside the custom op, at run time, logged in eager and compiled runs alike.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import eager, ops
from .ops import note_fallback

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Tests set this to route CPU tensors through the custom ops (their CPU kernels are PyTorch's
# computation), so the module -> op -> autograd wiring is exercised without a GPU.
_ROUTE_CPU = False


def _fallback(op: str, reason: str) -> None:
    if not torch.compiler.is_compiling():
        note_fallback(op, reason)


def _tensor_why_not(x: Tensor) -> Optional[str]:
    """Why ckgen's ops cannot take x (None: they can)."""
    if x.device.type != "cuda" and not (_ROUTE_CPU and x.device.type == "cpu"):
        return f"a {x.device.type.upper()} tensor (ckgen runs on CUDA GPUs)"
    if x.dim() != 4:
        return f"a {x.dim()}-D input (ckgen covers 4-D (N, C, H, W) tensors)"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} (ckgen covers float32, float16 and bfloat16)"
    if x.numel() == 0:
        return "an empty input"
    if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
        return "an input that is neither NCHW-contiguous nor channels-last"
    return None


def _needs_grad(*ts: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _int_pair(v, arg: str) -> Optional[tuple[int, int]]:
    """nn's int-or-tuple argument -> (a, b); None if it is not one (PyTorch then raises)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v, v
    if isinstance(v, (tuple, list)) and len(v) in (1, 2) and all(isinstance(e, int) and not isinstance(e, bool)
                                                                for e in v):
        return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])
    return None


# ---------------------------------------------------------------------------------------------
# GroupNorm
# ---------------------------------------------------------------------------------------------
def group_norm_why_not(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor],
                       activation: Optional[str] = None) -> Optional[str]:
    """None when ckgen runs this GroupNorm, else the reason it does not."""
    why = _tensor_why_not(x)
    if why:
        return why
    if activation not in (None, "none", "swish"):
        return f"activation {activation!r} (ckgen fuses 'swish' only)"
    C = x.shape[1]
    if not isinstance(num_groups, int) or num_groups < 1 or C % num_groups:
        return f"C={C} not divisible by num_groups={num_groups}"
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.shape[0] != C or t.device != x.device):
            return f"{name} of shape {tuple(t.shape)} on {t.device} for an input of {C} channels on {x.device}"
    return None


_CALLS: dict = {}


def _cached(key: Callable[[], tuple], make: Callable[[], "eager.Call"]) -> "eager.Call":
    """`make()` (a call's checks, as an `eager.Call`), answered from a cache under `key()` (x's
    shape, strides, dtype and device and everything else the checks read, as given): a repeated
    eager call (every training step) skips the checks. An unhashable argument (a list) is checked
    every call; under torch.compile the checks are traced as they are (Dynamo guards on what they
    read)."""
    if torch.compiler.is_compiling():
        return make()
    k = key()
    try:
        hit = _CALLS.get(k)
    except TypeError:
        return make()
    if hit is None:
        if len(_CALLS) > 4096:
            _CALLS.clear()
        hit = _CALLS[k] = make()
    return hit


def _param_sig(t: Optional[Tensor]) -> Any:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _one_value_per_group(x: Tensor, num_groups: int) -> None:
    """ValueError where F.group_norm raises one: the whole batch holds one value per group (its
    statistics are of that one value: the output would be beta). PyTorch's test and message."""
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1 or x.dim() < 2 \
            or x.shape[1] % num_groups:
        return  # another error, which the fallback to F.group_norm raises as PyTorch does
    size = [x.shape[0] * x.shape[1] // num_groups, num_groups, *x.shape[2:]]
    values = 1
    for n in [size[0], *size[2:]]:
        values *= n
    if values == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {size}")


def _gn_call(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor],
             activation: Optional[str]) -> eager.Call:
    """The checks of a GroupNorm call (`_cached`: keyed by x's and the parameters' shapes,
    strides, dtypes and devices, num_groups and activation)."""

    def make() -> eager.Call:
        _one_value_per_group(x, num_groups)
        why = group_norm_why_not(x, num_groups, weight, bias, activation)
        fix = any(t is not None and (t.dtype != x.dtype or not t.is_contiguous()) for t in (weight, bias))
        return eager.Call(why, groups=num_groups, act="swish" if activation == "swish" else "none", fix_params=fix,
                          fmt=None if why else ops.memory_format_of(x))

    return _cached(lambda: ("gn", x.shape, x.stride(), x.dtype, x.device, num_groups, activation,
                            _param_sig(weight), _param_sig(bias), _ROUTE_CPU), make)


def group_norm(x: Tensor, num_groups: int, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5, activation: Optional[str] = None) -> Tensor:
    """F.group_norm(x, num_groups, weight, bias, eps), then F.silu with activation="swish".

    weight/bias of another dtype than x (fp32 parameters with a bf16 input, as under autocast)
    are cast to x's dtype, and the output has x's dtype; the kernels compute the statistics in
    float32 either way. (nn.GroupNorm under autocast computes and returns float32.)

    A 3-D (N, C, L) input runs as its 4-D (N, C, L, 1) view (the same groups and statistics):
    attention blocks normalize their (N, C, H*W) tokens so (diffusers' Attention.group_norm on
    hidden_states.transpose(1, 2), a channels-last view)."""
    if x.dim() == 3:
        return group_norm(x.unsqueeze(-1), num_groups, weight, bias, eps, activation).squeeze(-1)
    call = _gn_call(x, num_groups, weight, bias, activation)
    if call.why is not None:
        _fallback("group_norm" if activation in (None, "none") else "group_norm+silu", call.why)
        y = F.group_norm(x, num_groups, weight, bias, eps)
        return F.silu(y) if activation == "swish" else y
    w, b = weight, bias
    if call.fix_params:
        w = w if w is None or w.dtype == x.dtype else w.to(x.dtype)
        b = b if b is None or b.dtype == x.dtype else b.to(x.dtype)
        if w is not None and not w.is_contiguous():
            w = w.contiguous()
        if b is not None and not b.is_contiguous():
            b = b.contiguous()
    if eager.usable(x):  # eager: the kernels without the custom op's per-call glue (ckgen/torch/eager.py)
        if _needs_grad(x, w, b):
            return eager.GroupNormFn.apply(x, w, b, call, float(eps))
        return eager.groupnorm_forward(x, w, b, call, float(eps))[0]
    y, _, _ = torch.ops.ckgen.groupnorm_fwd(x, w, b, num_groups, float(eps), call.act)
    return y


# ---------------------------------------------------------------------------------------------
# Pooling
# ---------------------------------------------------------------------------------------------
def _pool_args_why_not(x: Tensor, k, s, p, d, ceil_mode: bool) -> Optional[str]:
    if k is None or s is None or p is None or d is None:
        return "pooling arguments that are not ints or pairs of ints"
    if min(k) < 1 or min(s) < 1 or min(d) < 1 or min(p) < 0:
        return f"kernel_size {k}, stride {s}, padding {p}, dilation {d} (PyTorch rejects them)"
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:
        return f"padding {p} over half the kernel {k} (PyTorch rejects it)"
    from .ops import pool_out_size

    H, W = x.shape[2], x.shape[3]
    if pool_out_size(H, k[0], s[0], p[0], d[0], ceil_mode) < 1 or pool_out_size(W, k[1], s[1], p[1], d[1],
                                                                                 ceil_mode) < 1:
        return f"an output size < 1 for input {H}x{W} (PyTorch rejects it)"
    return None


def _pool_call(kind: str, x: Tensor, kernel_size, stride, padding, dilation, ceil_mode, count_include_pad=True,
               divisor_override=None) -> eager.Call:
    """The checks of a pooling call and its arguments as int pairs (an `eager.Call`; why is None
    when ckgen's ops take it), `_cached` by x's shape, strides, dtype and device and the
    arguments as given."""

    def make() -> eager.Call:
        why = _tensor_why_not(x)
        k = _int_pair(kernel_size, "kernel_size")
        s = k if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0) \
            else _int_pair(stride, "stride")
        p, d = _int_pair(padding, "padding"), _int_pair(dilation, "dilation")
        if why is None:
            why = _pool_args_why_not(x, k, s, p, d, bool(ceil_mode))
        if why is None and divisor_override is not None and (
                not isinstance(divisor_override, int) or isinstance(divisor_override, bool) or divisor_override < 1):
            why = f"divisor_override={divisor_override!r} (PyTorch rejects it)"
        return eager.Call(why, k=k, s=s, p=p, d=d, ceil=bool(ceil_mode), cip=bool(count_include_pad),
                          div=divisor_override, fmt=None if why else ops.memory_format_of(x))

    return _cached(lambda: (kind, x.shape, x.stride(), x.dtype, x.device, kernel_size, stride, padding, dilation,
                            ceil_mode, count_include_pad, divisor_override, _ROUTE_CPU), make)


UNDER_COMPILE = ("inductor", "ckgen")


def check_under_compile(under_compile: str, arg: str = "under_compile") -> str:
    if under_compile not in UNDER_COMPILE:
        raise ValueError(f"{arg}: expected 'inductor' or 'ckgen', got {under_compile!r}")
    return under_compile


def max_pool2d(x: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False, indices: str = "stored", under_compile: str = "inductor"):
    """F.max_pool2d with ckgen. `indices` picks what the backward uses when x needs a gradient:
    "stored" (the forward also writes int64 indices, as PyTorch does) or "recompute" (the
    forward writes y only; the backward recomputes each window's argmax from x). With
    return_indices=True the indices are computed anyway, and the backward uses them. Without a
    gradient (inference, torch.no_grad) no indices are written unless asked for.

    `under_compile` says what a torch.compile trace gets: "inductor" (the default) traces
    PyTorch's max pool, which Inductor lowers into its own kernel, fused with the ReLU before it
    and storing int8 window offsets instead of int64 indices; "ckgen" traces ckgen's custom op.
    Measured (docs/pytorch.md, max pools under torch.compile): in compiled VGG-16 and ResNet-50 ckgen's
    pools tied Inductor's in GPU time (0.97x-1.02x) and cost 0.2-1.6 ms of host time a step. Eager
    calls run ckgen either way."""
    if indices not in ("stored", "recompute"):
        raise ValueError(f"indices: expected 'stored' or 'recompute', got {indices!r}")
    check_under_compile(under_compile)
    if under_compile == "inductor" and torch.compiler.is_compiling():
        return F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode,
                            return_indices=return_indices)
    call = _pool_call("max", x, kernel_size, stride, padding, dilation, ceil_mode)
    if call.why is not None:
        _fallback("max_pool2d", call.why)
        return F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode,
                            return_indices=return_indices)
    if not return_indices and eager.usable(x):  # eager: no custom-op glue (ckgen/torch/eager.py)
        if _needs_grad(x):
            return eager.MaxPoolFn.apply(x, call, indices == "stored")
        return eager.maxpool_forward(x, call, False)
    args = (x, list(call.k), list(call.s), list(call.p), list(call.d), call.ceil)
    if return_indices:
        return torch.ops.ckgen.maxpool2d_fwd_with_indices(*args)
    if indices == "stored" and _needs_grad(x):
        return torch.ops.ckgen.maxpool2d_fwd_with_indices(*args)[0]
    return torch.ops.ckgen.maxpool2d_fwd(*args)


def avg_pool2d(x: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: Optional[int] = None) -> Tensor:
    """F.avg_pool2d with ckgen (the backward saves nothing)."""
    call = _pool_call("avg", x, kernel_size, stride, padding, 1, ceil_mode, count_include_pad, divisor_override)
    if call.why is not None:
        _fallback("avg_pool2d", call.why)
        return F.avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    if eager.usable(x):  # eager: no custom-op glue (ckgen/torch/eager.py)
        return eager.AvgPoolFn.apply(x, call) if _needs_grad(x) else eager.avgpool_forward(x, call)
    return torch.ops.ckgen.avgpool2d_fwd(x, list(call.k), list(call.s), list(call.p), call.ceil, call.cip,
                                         call.div)


__all__ = ["UNDER_COMPILE", "avg_pool2d", "check_under_compile", "group_norm", "group_norm_why_not", "max_pool2d"]
