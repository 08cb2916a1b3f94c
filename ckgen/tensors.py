"""Device tensors from CuPy arrays and torch CUDA tensors, zero-copy, with argument checks
that name the argument and the fix. NumPy and CuPy have no bfloat16: wrap a uint16 CuPy
array with `ckgen.bfloat16(a)` or pass a torch tensor."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

_TORCH_DTYPES = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}
_NP_DTYPES = {"float32": "fp32", "float16": "fp16"}


@dataclass(frozen=True)
class bfloat16:  # noqa: N801 - reads like a dtype at the call site: ckgen.bfloat16(a)
    """A uint16 CuPy array whose bits are bfloat16 values."""

    data: Any

    def __post_init__(self) -> None:
        if str(getattr(self.data, "dtype", "")) != "uint16":
            raise TypeError("bfloat16: expected a uint16 CuPy array holding bfloat16 bits")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)


@dataclass(frozen=True)
class DeviceTensor:
    obj: Any  # what the user passed (kept alive while we use its memory)
    kind: str  # "torch" | "cupy"
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str
    device: int


def _is_torch(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_device_tensor(obj: Any, arg: str) -> DeviceTensor:
    if _is_torch(obj):
        if not obj.is_cuda:
            raise TypeError(f"{arg}: a CPU torch tensor; move it to the GPU with {arg}.cuda()")
        dt = _TORCH_DTYPES.get(str(obj.dtype))
        if dt is None:
            raise TypeError(f"{arg}: dtype {obj.dtype} is not supported; use float32, float16 or bfloat16")
        return DeviceTensor(obj, "torch", obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), dt,
                            obj.device.index or 0)
    if isinstance(obj, bfloat16):
        a = obj.data
        return DeviceTensor(obj, "cupy", a.data.ptr, tuple(a.shape),
                            tuple(s // a.itemsize for s in a.strides), "bf16", a.device.id)
    mod = type(obj).__module__.split(".")[0]
    if mod == "numpy" or (hasattr(obj, "__array_interface__") and not hasattr(obj, "__cuda_array_interface__")):
        raise TypeError(f"{arg}: a host array; pass a CuPy array (cupy.asarray({arg})) or a torch CUDA tensor")
    if mod == "cupy":
        a = obj
    elif hasattr(obj, "__cuda_array_interface__") or hasattr(obj, "__dlpack__"):
        import cupy

        a = cupy.asarray(obj) if hasattr(obj, "__cuda_array_interface__") else cupy.from_dlpack(obj)
    else:
        raise TypeError(f"{arg}: expected a CuPy array or torch CUDA tensor, got {type(obj).__name__}")
    dt = _NP_DTYPES.get(str(a.dtype))
    if dt is None:
        raise TypeError(f"{arg}: dtype {a.dtype} is not supported; use float32 or float16 "
                        f"(bfloat16: pass a torch tensor or ckgen.bfloat16(uint16_array))")
    return DeviceTensor(obj, "cupy", a.data.ptr, tuple(a.shape), tuple(s // a.itemsize for s in a.strides),
                        dt, a.device.id)


def in_layout(shape: tuple[int, ...], strides: tuple[int, ...], layout: str) -> bool:
    """Are (N, C, H, W) `strides` those of `layout` ('nchw' or 'nhwc'; size-1 dims are free)?"""
    N, C, H, W = shape
    want = (H * W * C, 1, W * C, C) if layout == "nhwc" else (C * H * W, H * W, W, 1)
    return all(size == 1 or s == w for size, s, w in zip(shape, strides, want))


def layout_of(t: DeviceTensor, arg: str) -> str:
    """'nchw' or 'nhwc' from the strides of a logical (N, C, H, W) tensor."""
    if len(t.shape) != 4:
        raise ValueError(f"{arg}: expected a 4-D (N, C, H, W) tensor, got shape {t.shape}")
    if 0 in t.shape:
        raise ValueError(f"{arg}: empty tensor of shape {t.shape}")
    for layout in ("nchw", "nhwc"):
        if in_layout(t.shape, t.strides, layout):
            return layout
    raise ValueError(f"{arg}: strides {t.strides} are neither NCHW-contiguous nor channels-last; "
                     f"call .contiguous() or .contiguous(memory_format=torch.channels_last)")


def check_like(t: DeviceTensor, arg: str, shape: tuple[int, ...], ref: DeviceTensor, layout: str,
               what: str = "x's shape") -> None:
    """`t` must have `shape` (`what` says where it comes from), `ref`'s dtype and device, and
    the memory `layout` (ref's)."""
    if len(t.shape) != 4:
        raise ValueError(f"{arg}: expected a 4-D (N, C, H, W) tensor, got shape {t.shape}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{arg}: expected shape {tuple(shape)} ({what}), got {t.shape}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{arg}: dtype {t.dtype} differs from x's {ref.dtype}; cast it to x's dtype")
    if t.device != ref.device:
        raise ValueError(f"{arg}: on device {t.device} but x is on device {ref.device}")
    if not in_layout(tuple(t.shape), tuple(t.strides), layout):
        fix = ".contiguous(memory_format=torch.channels_last)" if layout == "nhwc" else ".contiguous()"
        raise ValueError(f"{arg}: strides {t.strides} are not x's {layout.upper()} layout; call {fix}")


def check_vector(t: DeviceTensor | None, arg: str, length: int, dtype: str, device: int) -> None:
    if t is None:
        return
    if t.shape != (length,):
        raise ValueError(f"{arg}: expected shape ({length},), got {t.shape}")
    if t.dtype != dtype:
        raise TypeError(f"{arg}: dtype {t.dtype} differs from x's {dtype}; cast it to x's dtype")
    if length > 1 and t.strides != (1,):
        raise ValueError(f"{arg}: must be contiguous, got strides {t.strides}")
    if t.device != device:
        raise ValueError(f"{arg}: on device {t.device} but x is on device {device}")


def alignment(*ptrs: int) -> int:
    """Largest power of two (<= 16) dividing every pointer."""
    a = 16
    for p in ptrs:
        if p:
            while p % a:
                a //= 2
    return a


def empty_like_layout(ref: DeviceTensor, shape: tuple[int, int, int, int], layout: str) -> Any:
    """A new tensor of logical shape `shape` in `layout`, same framework/dtype/device as `ref`."""
    N, C, H, W = shape
    if ref.kind == "torch":
        import torch

        fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
        return torch.empty(shape, dtype=ref.obj.dtype, device=ref.obj.device, memory_format=fmt)
    import cupy

    with cupy.cuda.Device(ref.device):
        np_dtype = {"fp32": "float32", "fp16": "float16", "bf16": "uint16"}[ref.dtype]
        a = cupy.empty((N, H, W, C), np_dtype).transpose(0, 3, 1, 2) if layout == "nhwc" \
            else cupy.empty(shape, np_dtype)
    return bfloat16(a) if ref.dtype == "bf16" else a


def empty_vector(ref: DeviceTensor, length: int) -> Any:
    """A new contiguous (length,) vector of `ref`'s framework, dtype and device."""
    if ref.kind == "torch":
        import torch

        return torch.empty((length,), dtype=ref.obj.dtype, device=ref.obj.device)
    import cupy

    with cupy.cuda.Device(ref.device):
        a = cupy.empty((length,), {"fp32": "float32", "fp16": "float16", "bf16": "uint16"}[ref.dtype])
    return bfloat16(a) if ref.dtype == "bf16" else a


def empty_f32(ref: DeviceTensor, shape: tuple[int, ...]) -> Any:
    if ref.kind == "torch":
        import torch

        return torch.empty(shape, dtype=torch.float32, device=ref.obj.device)
    import cupy

    with cupy.cuda.Device(ref.device):
        return cupy.empty(shape, "float32")


def data_ptr(obj: Any) -> int:
    if _is_torch(obj):
        return obj.data_ptr()
    if isinstance(obj, bfloat16):
        return obj.data.data.ptr
    return obj.data.ptr


def stream_for(t: DeviceTensor) -> Any:
    """The stream to launch on: torch's current stream for torch inputs, else CuPy's."""
    import cupy

    if t.kind == "torch":
        import warnings

        import torch

        ts = torch.cuda.current_stream(t.obj.device)
        try:
            return cupy.cuda.Stream.from_external(ts)  # CuPy 14: the CUDA stream protocol
        except Exception:  # older CuPy or torch without __cuda_stream__
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return cupy.cuda.ExternalStream(ts.cuda_stream, t.device)
    return cupy.cuda.get_current_stream()
