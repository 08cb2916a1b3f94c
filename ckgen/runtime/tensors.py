"""Device tensors from CuPy arrays and torch CUDA tensors, zero-copy, with argument checks
that name the argument and the fix. NumPy and CuPy have no bfloat16: wrap a uint16 CuPy
array with `ckgen.bfloat16(a)` or pass a torch tensor."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

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
            if obj.is_meta:  # shapes only (torch.compile's fake tensors run the fake kernels, not this)
                raise TypeError(f"{arg}: a meta tensor (a shape and dtype, no data); ckgen computes on the "
                                f"data of a torch CUDA tensor: create {arg} on the GPU (device='cuda')")
            where = "a CPU torch tensor" if obj.device.type == "cpu" else f"a torch tensor on {obj.device}"
            raise TypeError(f"{arg}: {where}; move it to the GPU with {arg}.cuda()")
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
        from .target import require_cupy

        cupy = require_cupy("reads other frameworks' device arrays")
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


_STORAGE = {"fp32": "float32", "fp16": "float16", "bf16": "uint16", "int64": "int64"}
_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "int64": 8}


def _strides(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Element strides of a new `shape` tensor in `layout` ('nchw', 'nhwc' or 'flat')."""
    if layout == "nhwc":
        N, C, H, W = shape
        return (H * W * C, 1, W * C, C)
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def workspace_allocator(ref: DeviceTensor, nbytes: int) -> Callable[[], tuple[Any, int]]:
    """A function returning (a new scratch buffer of `nbytes`, its pointer) from the caller's
    allocator: torch's caching allocator for torch inputs (so CUDA-graph capture puts it in
    the graph's pool), CuPy's memory pool otherwise."""
    if ref.kind == "torch":
        import torch

        dev, empty, u8 = ref.obj.device, torch.empty, torch.uint8

        def torch_ws() -> tuple[Any, int]:
            t = empty((nbytes,), dtype=u8, device=dev)
            return t, t.data_ptr()

        return torch_ws
    import cupy

    alloc = cupy.cuda.alloc

    def cupy_ws() -> tuple[Any, int]:
        mem = alloc(nbytes)
        return mem, mem.ptr

    return cupy_ws


def current_stream_fn(ref: DeviceTensor) -> Callable[[], int]:
    """A function returning the raw stream to launch on: torch's current stream on `ref`'s
    device for torch inputs, else CuPy's current stream."""
    if ref.kind == "torch":
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        index = ref.device
        if raw is not None:
            return lambda: raw(index)
        current = torch.cuda.current_stream
        return lambda: current(index).cuda_stream
    import cupy

    get = cupy.cuda.get_current_stream
    return lambda: get().ptr


# ---------------------------------------------------------------------------------------------
# The fast path: a tensor argument's signature and pointer, without building a DeviceTensor.
# ---------------------------------------------------------------------------------------------
class Slow(Exception):
    """An argument the fast path does not read (None is read); the full checks must look at it."""


class _NoTorch:  # isinstance(x, _NoTorch) is never true: torch is not imported
    pass


_torch_tensor: type = _NoTorch
_cupy_ndarray: type = _NoTorch


def _refresh_types() -> None:
    global _torch_tensor, _cupy_ndarray
    torch = sys.modules.get("torch")
    if torch is not None:
        _torch_tensor = torch.Tensor
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        _cupy_ndarray = cupy.ndarray


def sig(t: Any) -> tuple[Any, int]:
    """(signature, device pointer) of a tensor argument: the signature holds everything the
    argument checks read (framework, shape, strides, dtype, device), so two arguments with equal
    signatures pass or fail the checks alike. None -> (None, 0). Raises Slow for anything else
    (host arrays, __cuda_array_interface__ objects, ...): the full checks handle those."""
    if t is None:
        return None, 0
    if isinstance(t, _torch_tensor):
        return (t.shape, t.stride(), t.dtype, t.device), t.data_ptr()
    tp = type(t)
    if tp is _cupy_ndarray:
        d = t.data
        return (t.shape, t.strides, t.dtype, d.device_id), d.ptr
    if tp is bfloat16:
        a = t.data
        if type(a) is _cupy_ndarray:
            d = a.data
            return ("bf16", a.shape, a.strides, a.dtype, d.device_id), d.ptr
    if _torch_tensor is _NoTorch or _cupy_ndarray is _NoTorch:
        _refresh_types()
        if isinstance(t, (_torch_tensor, _cupy_ndarray)):
            return sig(t)
    raise Slow


#: alignment class (largest power of two <= 16 dividing a pointer) by the pointer's low 4 bits
ALIGN = tuple(16 if r == 0 else (r & -r) for r in range(16))
