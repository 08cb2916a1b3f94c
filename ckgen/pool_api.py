"""Public pooling ops: maxpool2d_fwd / _bwd and avgpool2d_fwd / _bwd, with PyTorch's semantics
(F.max_pool2d / F.avg_pool2d and their gradients).

Inputs are CuPy arrays (bf16 as `ckgen.bfloat16(uint16_array)`) or torch CUDA tensors, NCHW or
channels-last; outputs keep the input's layout and framework. Indices are int64, flat h*W + w
within each (n, c) plane. Every argument is checked before anything is launched; a bad one
raises ValueError/TypeError whose message starts with the argument's name."""
from __future__ import annotations

from typing import Any

from .dispatch import launch
from .ops import get_op
from .tensors import check_like


def _flag(v: Any, arg: str) -> bool:
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise TypeError(f"{arg}: expected a bool, got {v!r}")


def _stride(stride: Any) -> Any:
    return None if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0) else stride


def _check_like(t: Any, arg: str, shape: tuple[int, ...], xt: Any, layout: str) -> None:
    check_like(t, arg, shape, xt, layout, what=f"the pooling output for x {xt.shape}")


def _index_tensor(obj: Any, shape: tuple[int, ...], xt: Any, layout: str) -> tuple[Any, int]:
    """The user's int64 indices: (kept object, device pointer), checked like dy."""
    from .tensors import DeviceTensor, _is_torch

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
    return obj, t.ptr


def _empty_index(xt: Any, shape: tuple[int, int, int, int], layout: str) -> Any:
    if xt.kind == "torch":
        import torch

        fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
        return torch.empty(shape, dtype=torch.int64, device=xt.obj.device, memory_format=fmt)
    import cupy

    N, C, H, W = shape
    with cupy.cuda.Device(xt.device):
        return cupy.empty((N, H, W, C), "int64").transpose(0, 3, 1, 2) if layout == "nhwc" \
            else cupy.empty(shape, "int64")


def _problem(op_name: str, x: Any, kernel_size: Any, stride: Any, padding: Any, ceil_mode: Any, **extra: Any):
    from .tensors import as_device_tensor, layout_of

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


def maxpool2d_fwd(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                  ceil_mode: bool = False, return_indices: bool = False) -> Any:
    """y = F.max_pool2d(x, ...); with return_indices=True, (y, indices int64)."""
    import cupy

    from .tensors import data_ptr, empty_like_layout

    ri = _flag(return_indices, "return_indices")
    op, p, xt = _problem("maxpool2d_fwd", x, kernel_size, stride, padding, ceil_mode, dilation=dilation,
                         return_indices=ri)
    out_shape = (p.N, p.C, p.OH, p.OW)
    with cupy.cuda.Device(xt.device):
        y = empty_like_layout(xt, out_shape, p.layout)
        idx = _empty_index(xt, out_shape, p.layout) if ri else None
    ptrs = {"x": xt.ptr, "y": data_ptr(y)}
    if idx is not None:
        ptrs["indices"] = data_ptr(idx)
    launch(op, p, xt, ptrs)
    return (y, idx) if ri else y


def maxpool2d_bwd(dy: Any, x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                  ceil_mode: bool = False, indices: Any = None) -> Any:
    """dx, the gradient of max_pool2d(x, ...) given dy: each dy goes to its window's argmax
    (`indices` from maxpool2d_fwd, or recomputed from x when None); overlaps accumulate."""
    import cupy

    from .tensors import as_device_tensor, data_ptr, empty_like_layout

    op, p, xt = _problem("maxpool2d_bwd", x, kernel_size, stride, padding, ceil_mode, dilation=dilation,
                         indices="recompute" if indices is None else "stored")
    out_shape = (p.N, p.C, p.OH, p.OW)
    dyt = as_device_tensor(dy, "dy")
    _check_like(dyt, "dy", out_shape, xt, p.layout)
    ptrs = {"x": xt.ptr, "dy": dyt.ptr}
    keep = None
    if indices is not None:
        keep, ptrs["indices"] = _index_tensor(indices, out_shape, xt, p.layout)
    with cupy.cuda.Device(xt.device):
        dx = empty_like_layout(xt, xt.shape, p.layout)
    ptrs["dx"] = data_ptr(dx)
    launch(op, p, xt, ptrs)
    del keep
    return dx


def avgpool2d_fwd(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                  count_include_pad: bool = True, divisor_override: int | None = None) -> Any:
    """y = F.avg_pool2d(x, ...)."""
    import cupy

    from .tensors import data_ptr, empty_like_layout

    op, p, xt = _problem("avgpool2d_fwd", x, kernel_size, stride, padding, ceil_mode,
                         **_avg_extra(count_include_pad, divisor_override))
    with cupy.cuda.Device(xt.device):
        y = empty_like_layout(xt, (p.N, p.C, p.OH, p.OW), p.layout)
    launch(op, p, xt, {"x": xt.ptr, "y": data_ptr(y)})
    return y


def avgpool2d_bwd(dy: Any, x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                  count_include_pad: bool = True, divisor_override: int | None = None) -> Any:
    """dx, the gradient of avg_pool2d(x, ...) given dy (x gives the shape, layout and dtype)."""
    import cupy

    from .tensors import as_device_tensor, data_ptr, empty_like_layout

    op, p, xt = _problem("avgpool2d_bwd", x, kernel_size, stride, padding, ceil_mode,
                         **_avg_extra(count_include_pad, divisor_override))
    dyt = as_device_tensor(dy, "dy")
    _check_like(dyt, "dy", (p.N, p.C, p.OH, p.OW), xt, p.layout)
    with cupy.cuda.Device(xt.device):
        dx = empty_like_layout(xt, xt.shape, p.layout)
    launch(op, p, xt, {"dy": dyt.ptr, "dx": data_ptr(dx)})
    return dx


__all__ = ["avgpool2d_bwd", "avgpool2d_fwd", "maxpool2d_bwd", "maxpool2d_fwd"]
