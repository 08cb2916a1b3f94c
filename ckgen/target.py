"""The current device as a Target, and its properties. CuPy is imported lazily."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .types import Target


class NoGPUError(RuntimeError):
    """No usable GPU (CuPy missing, no driver, or no device)."""


@dataclass(frozen=True)
class DeviceInfo:
    target: Target
    name: str
    num_sms: int
    l2_bytes: int


def gpu_status() -> str | None:
    """None when a GPU is usable, else one line saying why not."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        return f"CuPy is not importable ({e.__class__.__name__}: {e}); install ckgen[cuda13] or ckgen[cuda12]"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"no usable CUDA/ROCm device ({e.__class__.__name__}: {e})"
    return None if n > 0 else "no CUDA/ROCm device found"


@lru_cache(maxsize=None)
def device_info(device_id: int | None = None) -> DeviceInfo:
    why = gpu_status()
    if why:
        raise NoGPUError(why)
    import cupy

    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    if cupy.cuda.runtime.is_hip:
        arch = props.get("gcnArchName", b"gfx000")
        arch = (arch.decode() if isinstance(arch, bytes) else arch).split(":")[0]
    else:
        arch = f"sm_{props['major']}{props['minor']}"
    return DeviceInfo(Target.named(arch), name, int(props["multiProcessorCount"]), int(props["l2CacheSize"]))


def current_target() -> Target:
    return device_info(None).target
