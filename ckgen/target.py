"""The current device as a Target, and its properties. CuPy is imported lazily."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .types import Target


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
        runtime = "ROCm" if getattr(cupy.cuda.runtime, "is_hip", False) else "CUDA"
        return f"the {runtime} runtime says {e}" if "Runtime" in type(e).__name__ else f"{e.__class__.__name__}: {e}"
    return None if n > 0 else "no CUDA or ROCm device is visible"


@lru_cache(maxsize=None)
def device_info(device_id: int | None = None) -> DeviceInfo:
    why = gpu_status()
    if why:
        raise NoGPUError(f"no usable GPU ({why})")
    import cupy

    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    if cupy.cuda.runtime.is_hip:
        arch = props.get("gcnArchName", b"")
        arch = (arch.decode() if isinstance(arch, bytes) else arch).split(":")[0]
    else:
        arch = f"sm_{props['major']}{props['minor']}"
    try:
        target = Target.named(arch)
    except ValueError:  # a device property ckgen cannot read as an arch: no kernel could be built for it
        raise NoGPUError(f"no usable GPU ({name} reports arch {arch!r}, which is not an arch name ckgen knows)") from None
    return DeviceInfo(target, name, int(props["multiProcessorCount"]), int(props["l2CacheSize"]))


def current_target() -> Target:
    return device_info(None).target


# SMs (CUs) per arch where no device is at hand (the cost model's parallelism terms, tuning
# records, CI): the flagship part of each arch (an H100 SXM for sm_90). Others: DEFAULT_SMS.
NUM_SMS = {"sm_80": 108, "sm_86": 84, "sm_89": 128, "sm_90": 132, "sm_90a": 132, "sm_100": 148,
           "sm_120": 170, "gfx90a": 104, "gfx942": 304, "gfx1100": 96}
DEFAULT_SMS = 108


@lru_cache(maxsize=None)
def coresident_sms(target: Target) -> int:
    """The SMs a grid whose blocks wait for each other (GroupNorm fwd merge=grid) may count on for
    `target`: the fewest of the visible devices of that arch (an H100 PCIe has 114, an SXM 132),
    else, with no such device (offline studies, CI), the arch's flagship part (NUM_SMS)."""
    counts = []
    if gpu_status() is None:
        import cupy

        for d in range(cupy.cuda.runtime.getDeviceCount()):
            info = device_info(d)
            if info.target == target:
                counts.append(info.num_sms)
    return min(counts) if counts else NUM_SMS.get(target.arch, DEFAULT_SMS)
