"""The current device as a Target, and its properties. CuPy is imported lazily."""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..types import Target


class NoGPUError(RuntimeError):
    """No usable GPU (CuPy missing, no driver, or no device)."""


#: what to install for CuPy (and NVRTC), said wherever its absence stops something
CUPY_HINT = "pip install 'ckgen[cuda13]', or 'ckgen[cuda12]' for a CUDA 12 driver"


class CuPyMissingError(ModuleNotFoundError):
    """CuPy is not installed: ckgen compiles (NVRTC) and launches through it. The message says
    what to install. A ModuleNotFoundError, so code that catches ImportError still does."""


def require_cupy(what: str = "launches its kernels") -> Any:
    """The cupy module; CuPyMissingError (saying what to install) when it is not installed."""
    try:
        import cupy
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "cupy":
            raise
        raise CuPyMissingError(f"ckgen {what} through CuPy, which is not installed: {CUPY_HINT}", name="cupy") from None
    return cupy


@dataclass(frozen=True)
class DeviceInfo:
    target: Target
    name: str
    num_sms: int
    l2_bytes: int


def gpu_status() -> str | None:
    """None when a GPU is usable, else why not, as a clause that follows "no usable GPU"."""
    try:
        import cupy
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "cupy":
            return f"CuPy is not installed; {CUPY_HINT}"
        return f"CuPy failed to import ({e.__class__.__name__}: {e})"
    except Exception as e:  # noqa: BLE001 - a CUDA library that fails to load
        return f"CuPy failed to import ({e.__class__.__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, an old driver, ...
        return runtime_problem(e, cupy.cuda.runtime)
    return None if n > 0 else "no CUDA or ROCm device is visible"


#: the NVIDIA driver's library, which the CUDA runtime loads (no file: no driver installed)
DRIVER_LIBRARY = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
_NO_DEVICE = 100  # cudaErrorNoDevice
_OLD_DRIVER = 35  # cudaErrorInsufficientDriver: also what the runtime says when there is no driver at all


def driver_library_missing() -> bool:
    """Is the NVIDIA driver's library (DRIVER_LIBRARY) impossible to load here?"""
    import ctypes

    try:
        ctypes.CDLL(DRIVER_LIBRARY)
    except OSError:
        return True
    return False


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def runtime_problem(error: Exception, runtime: Any) -> str:
    """Why the CUDA (ROCm) runtime found no device, as a clause that follows "no usable GPU": the
    real cause, not the runtime's code, which says "driver version is insufficient" when there is
    no driver at all. No driver library: no NVIDIA driver/GPU; a driver older than CuPy's runtime:
    which versions, and what to do; a driver that sees no GPU: that."""
    if getattr(runtime, "is_hip", False):
        return f"the ROCm runtime says {error}" if "Runtime" in type(error).__name__ else \
            f"{error.__class__.__name__}: {error}"
    status = getattr(error, "status", None)
    if "Runtime" not in type(error).__name__:
        return f"{error.__class__.__name__}: {error}"
    if status in (_OLD_DRIVER, _NO_DEVICE):
        if driver_library_missing():
            return f"no NVIDIA driver/GPU found: {DRIVER_LIBRARY}, the NVIDIA driver's library, is not installed"
        try:
            driver, rt = int(runtime.driverGetVersion()), int(runtime.runtimeGetVersion())
        except Exception:  # noqa: BLE001 - versions unreadable: say what the runtime said
            driver, rt = -1, -1
        if driver == 0:
            return f"no NVIDIA driver/GPU found: {DRIVER_LIBRARY} loads but reports no driver"
        if status == _OLD_DRIVER and 0 < driver < rt:
            return (f"the NVIDIA driver is too old: it supports CUDA {_cuda_version(driver)}, CuPy's runtime is "
                    f"CUDA {_cuda_version(rt)}; update the driver, or install the CuPy for it "
                    f"(pip install 'ckgen[cuda{driver // 1000}]')")
        if status == _NO_DEVICE:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            return ("no NVIDIA driver/GPU found: the NVIDIA driver"
                    + (f" (CUDA {_cuda_version(driver)})" if driver > 0 else "") + " sees no GPU"
                    + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""))
    return f"the CUDA runtime says {error}"


@lru_cache(maxsize=None)
def device_info(device_id: int | None = None) -> DeviceInfo:
    why = gpu_status()
    if why:
        raise NoGPUError(f"no usable GPU ({why})")
    import cupy

    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    arch = _arch_of(props)
    try:
        target = Target.named(arch)
    except ValueError:  # a device property ckgen cannot read as an arch: no kernel could be built for it
        raise NoGPUError(f"no usable GPU ({name} reports arch {arch!r}, which is not an arch name ckgen knows)") from None
    target = dataclasses.replace(target, sms=_arch_sms(arch))  # what a grid barrier may count on
    return DeviceInfo(target, name, int(props["multiProcessorCount"]), int(props["l2CacheSize"]))


def _arch_of(props: dict[str, Any]) -> str:
    """The arch name of a device, from its CUDA/HIP properties."""
    import cupy

    if cupy.cuda.runtime.is_hip:
        arch = props.get("gcnArchName", b"")
        return (arch.decode() if isinstance(arch, bytes) else arch).split(":")[0]
    return f"sm_{props['major']}{props['minor']}"


def current_target() -> Target:
    return device_info(None).target


@lru_cache(maxsize=None)
def _arch_sms(arch: str) -> int:
    """The fewest SMs of the visible devices of `arch` (0: none visible)."""
    import cupy

    counts = []
    for d in range(cupy.cuda.runtime.getDeviceCount()):
        props = cupy.cuda.runtime.getDeviceProperties(d)
        if _arch_of(props) == arch:
            counts.append(int(props["multiProcessorCount"]))
    return min(counts) if counts else 0
