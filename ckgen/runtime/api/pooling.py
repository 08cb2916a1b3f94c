"""Public pooling ops: maxpool2d_fwd / _bwd and avgpool2d_fwd / _bwd, with PyTorch's semantics
(F.max_pool2d / F.avg_pool2d and their gradients).

Inputs are CuPy arrays (bf16 as `ckgen.bfloat16(uint16_array)`) or torch CUDA tensors, NCHW or
channels-last; outputs keep the input's layout and framework. Indices are int64, flat h*W + w
within each (n, c) plane. Every argument is checked before anything is launched; a bad one
raises ValueError/TypeError whose message starts with the argument's name. See `ckgen.runtime.api`
for the fast path."""
from __future__ import annotations

from typing import Any

from ...ops import get_op
from ..dispatch import Output, dispatcher, plan_for, remember
from ..tensors import ALIGN, Slow, check_like, sig

_CALLS = dispatcher().calls


def _ip(v: Any) -> Any:
    """A pooling size as the fast path takes it (an int or a tuple of two ints), else Slow."""
    t = type(v)
    if t is int or (t is tuple and len(v) == 2 and type(v[0]) is int and type(v[1]) is int):
        return v
    raise Slow


def _sp(v: Any) -> Any:
    return None if v is None else _ip(v)


def _b(v: Any) -> bool:
    if type(v) is bool:
        return v
    raise Slow


def _flag(v: Any, arg: str) -> bool:
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise TypeError(f"{arg}: expected a bool, got {v!r}")


def _stride(stride: Any) -> Any:
    return None if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0) else stride


def _check_like(t: Any, arg: str, shape: tuple[int, ...], xt: Any, layout: str) -> None:
    check_like(t, arg, shape, xt, layout, what=f"the pooling output for x {xt.shape}")


def _index_tensor(obj: Any, shape: tuple[int, ...], xt: Any, layout: str) -> int:
    """The user's int64 indices, checked like dy -> their device pointer."""
    from ..tensors import DeviceTensor, _is_torch

    arg = "indices"
    if _is_torch(obj):
        if not obj.is_cuda:
            raise TypeError(f"{arg}: a CPU torch tensor; move it to the GPU with {arg}.cuda()")
        if str(obj.dtype) != "torch.int64":
            raise TypeError(f"{arg}: dtype {obj.dtype}; expected torch.int64 (as returned by maxpool2d_fwd)")
        t = DeviceTensor(obj, "torch", obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), xt.dtype,
                         obj.device.index or 0)
    elif type(obj).__module__.split(".")[0] == "cupy":
        if str(obj.dtype) != "int64":
            raise TypeError(f"{arg}: dtype {obj.dtype}; expected int64 (as returned by maxpool2d_fwd)")
        t = DeviceTensor(obj, "cupy", obj.data.ptr, tuple(obj.shape), tuple(s // 8 for s in obj.strides), xt.dtype,
                         obj.device.id)
    else:
        raise TypeError(f"{arg}: expected an int64 CuPy array or torch CUDA tensor, got {type(obj).__name__}")
    _check_like(t, arg, shape, xt, layout)
    return t.ptr


def _problem(op_name: str, x: Any, kernel_size: Any, stride: Any, padding: Any, ceil_mode: Any, **extra: Any):
    from ..tensors import as_device_tensor, layout_of

    xt = as_device_tensor(x, "x")
    layout = layout_of(xt, "x")
    N, C, H, W = xt.shape
    op = get_op(op_name)
    if kernel_size is None:
        raise ValueError("kernel_size: required (an int or a pair of ints)")
    problem = op.parse_problem(N=N, C=C, H=H, W=W, dtype=xt.dtype, layout=layout, kernel=kernel_size,
                               stride=_stride(stride), padding=padding, ceil_mode=_flag(ceil_mode, "ceil_mode"),
                               **extra)
    return op, problem, xt


def _avg_extra(count_include_pad: Any, divisor_override: Any) -> dict[str, Any]:
    if divisor_override is not None and (isinstance(divisor_override, bool) or not isinstance(divisor_override, int)
                                         or divisor_override < 1):
        raise ValueError(f"divisor_override: expected None or a positive int, got {divisor_override!r}")
    return {"count_include_pad": _flag(count_include_pad, "count_include_pad"),
            "divisor_override": divisor_override or 0}


def _out(p: Any) -> tuple[int, int, int, int]:
    return (p.N, p.C, p.OH, p.OW)


# ---------------------------------------------------------------------------------------------
# max pooling
# ---------------------------------------------------------------------------------------------
def _plan_max_fwd(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                  ceil_mode: Any = False, return_indices: Any = False):
    try:
        kx, px = sig(x)
        key = ("maxpool2d_fwd", kx, _ip(kernel_size), _sp(stride), _ip(padding), _ip(dilation), _b(ceil_mode),
               _b(return_indices), ALIGN[px & 15])
        plan = _CALLS.get(key)
        if plan is not None:
            return plan, (px,)
    except Slow:
        key = None
    ri = _flag(return_indices, "return_indices")
    op, p, xt = _problem("maxpool2d_fwd", x, kernel_size, stride, padding, ceil_mode, dilation=dilation,
                         return_indices=ri)
    outs = [Output("y", _out(p), p.layout, p.dtype)]
    if ri:
        outs.append(Output("indices", _out(p), p.layout, "int64"))
    plan = plan_for(op, p, xt, {"x": xt.ptr}, outs, ("x",))
    remember(key, plan)
    return plan, (xt.ptr,)


def maxpool2d_fwd(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                  ceil_mode: bool = False, return_indices: bool = False) -> Any:
    """y = F.max_pool2d(x, ...); with return_indices=True, (y, indices int64)."""
    plan, ins = _plan_max_fwd(x, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
    out = plan.run(ins, 0.0, x)
    return (out[0], out[1]) if len(out) == 2 else out[0]


def _plan_max_bwd(dy: Any, x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                  ceil_mode: Any = False, indices: Any = None):
    try:
        kd, pd = sig(dy)
        kx, px = sig(x)
        ki, pi = sig(indices)
        key = ("maxpool2d_bwd", kd, kx, ki, _ip(kernel_size), _sp(stride), _ip(padding), _ip(dilation),
               _b(ceil_mode), ALIGN[(pd | px | pi) & 15])
        plan = _CALLS.get(key)
        if plan is not None:
            return plan, (px, pd, pi)
    except Slow:
        key = None
    from ..tensors import as_device_tensor

    op, p, xt = _problem("maxpool2d_bwd", x, kernel_size, stride, padding, ceil_mode, dilation=dilation,
                         indices="recompute" if indices is None else "stored")
    dyt = as_device_tensor(dy, "dy")
    _check_like(dyt, "dy", _out(p), xt, p.layout)
    ins = {"x": xt.ptr, "dy": dyt.ptr,
           "indices": _index_tensor(indices, _out(p), xt, p.layout) if indices is not None else 0}
    plan = plan_for(op, p, xt, ins, [Output("dx", xt.shape, p.layout, p.dtype)], ("x", "dy", "indices"))
    remember(key, plan)
    return plan, tuple(ins.values())


def maxpool2d_bwd(dy: Any, x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                  ceil_mode: bool = False, indices: Any = None) -> Any:
    """dx, the gradient of max_pool2d(x, ...) given dy: each dy goes to its window's argmax
    (`indices` from maxpool2d_fwd, or recomputed from x when None); overlaps accumulate."""
    plan, ins = _plan_max_bwd(dy, x, kernel_size, stride, padding, dilation, ceil_mode, indices)
    return plan.run(ins, 0.0, x)[0]


# ---------------------------------------------------------------------------------------------
# average pooling
# ---------------------------------------------------------------------------------------------
def _avg_key(kernel_size: Any, stride: Any, padding: Any, ceil_mode: Any, count_include_pad: Any,
             divisor_override: Any) -> tuple:
    if not (divisor_override is None or type(divisor_override) is int):
        raise Slow
    return (_ip(kernel_size), _sp(stride), _ip(padding), _b(ceil_mode), _b(count_include_pad), divisor_override)


def _plan_avg_fwd(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: Any = False,
                  count_include_pad: Any = True, divisor_override: Any = None):
    try:
        kx, px = sig(x)
        key = ("avgpool2d_fwd", kx, _avg_key(kernel_size, stride, padding, ceil_mode, count_include_pad,
                                             divisor_override), ALIGN[px & 15])
        plan = _CALLS.get(key)
        if plan is not None:
            return plan, (px,)
    except Slow:
        key = None
    op, p, xt = _problem("avgpool2d_fwd", x, kernel_size, stride, padding, ceil_mode,
                         **_avg_extra(count_include_pad, divisor_override))
    plan = plan_for(op, p, xt, {"x": xt.ptr}, [Output("y", _out(p), p.layout, p.dtype)], ("x",))
    remember(key, plan)
    return plan, (xt.ptr,)


def avgpool2d_fwd(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                  count_include_pad: bool = True, divisor_override: int | None = None) -> Any:
    """y = F.avg_pool2d(x, ...)."""
    plan, ins = _plan_avg_fwd(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    return plan.run(ins, 0.0, x)[0]


def _plan_avg_bwd(dy: Any, x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: Any = False,
                  count_include_pad: Any = True, divisor_override: Any = None):
    try:
        kd, pd = sig(dy)
        kx, _ = sig(x)
        key = ("avgpool2d_bwd", kd, kx, _avg_key(kernel_size, stride, padding, ceil_mode, count_include_pad,
                                                 divisor_override), ALIGN[pd & 15])
        plan = _CALLS.get(key)
        if plan is not None:
            return plan, (pd,)
    except Slow:
        key = None
    from ..tensors import as_device_tensor

    op, p, xt = _problem("avgpool2d_bwd", x, kernel_size, stride, padding, ceil_mode,
                         **_avg_extra(count_include_pad, divisor_override))
    dyt = as_device_tensor(dy, "dy")
    _check_like(dyt, "dy", _out(p), xt, p.layout)
    plan = plan_for(op, p, xt, {"dy": dyt.ptr}, [Output("dx", xt.shape, p.layout, p.dtype)], ("dy",))
    remember(key, plan)
    return plan, (dyt.ptr,)


def avgpool2d_bwd(dy: Any, x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                  count_include_pad: bool = True, divisor_override: int | None = None) -> Any:
    """dx, the gradient of avg_pool2d(x, ...) given dy (x gives the shape, layout and dtype)."""
    plan, ins = _plan_avg_bwd(dy, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    return plan.run(ins, 0.0, x)[0]


planners = {"maxpool2d_fwd": _plan_max_fwd, "maxpool2d_bwd": _plan_max_bwd, "avgpool2d_fwd": _plan_avg_fwd,
            "avgpool2d_bwd": _plan_avg_bwd}

__all__ = ["avgpool2d_bwd", "avgpool2d_fwd", "maxpool2d_bwd", "maxpool2d_fwd"]
