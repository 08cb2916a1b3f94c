"""The value types every layer uses: Config, Support, Target, Launch, Tolerance, the dtype and
layout tables. The bottom of the house: this module imports nothing else of ckgen, so spaces,
ops, codegen, the DB and the dispatcher all build on it without import cycles.

Nothing here imports CuPy.
"""
from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass, field
from typing import Any, Mapping

DTYPES: dict[str, dict[str, Any]] = {
    # itemsize and the C storage type the kernels load (bf16 travels as uint16 bits)
    "fp32": {"itemsize": 4, "storage": "float"},
    "fp16": {"itemsize": 2, "storage": "unsigned short"},
    "bf16": {"itemsize": 2, "storage": "unsigned short"},
}
LAYOUTS = ("nchw", "nhwc")
# Arch names, whole: they name folders (`ckgen generate` writes generated/<arch>/), so nothing
# else (a path separator, "..") may pass; and only names of the form a GPU has, so a typo
# (sm_9, gfxfff) is an error rather than a target nothing can run: NVIDIA sm_<major><minor>[a],
# major 1-99 without a leading zero (sm_10 ... sm_90a, sm_100, sm_120); AMD gfx<major><minor>
# <stepping>, major 6-19 in decimal, minor a digit, stepping a hex digit (gfx803, gfx90a, gfx942,
# gfx1100).
_CUDA_ARCH = re.compile(r"sm_([1-9][0-9]?[0-9])a?")
_HIP_ARCH = re.compile(r"gfx(?:[6-9]|1[0-9])[0-9][0-9a-f]")


INT32_MAX = 2**31 - 1  # every integer a template or a kernel argument holds is a 32-bit int


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxtuple = 2, 60, 60, 4, 4


def short_repr(v: Any) -> str:
    """A bounded repr of v, at most 80 characters: an error message never renders (or spends
    time on) a whole large value."""
    try:
        text = _REPR.repr(v)
    except Exception:  # noqa: BLE001 - a repr that fails still gets a name
        text = f"<{type(v).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def printable(value: Any) -> str:
    """`value` as text a terminal shows rather than obeys: every character that is not printable
    (ESC sequences, newlines and carriage returns, C1 codes, bidi overrides, line separators) as
    its backslash escape. DB strings come from other machines (`db pull`, `db merge`)."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class KernelLimitError(ValueError):
    """A problem PyTorch can compute but ckgen's kernels cannot index (32-bit plane or window
    coordinates): an argument error for ckgen's own API, and a reason to run PyTorch's op in
    ckgen.torch."""


@dataclass(frozen=True)
class Support:
    """Whether a config can run a problem; `reason` says why not."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> "Support":
        return _YES if cls is Support else cls(True)  # immutable: one is enough

    @classmethod
    def no(cls, reason: str) -> "Support":
        return cls(False, reason)

    def __bool__(self) -> bool:
        return self.ok


_YES = Support(True)


@dataclass(frozen=True)
class Config:
    """A point of a tuning space: sorted (name, value) pairs, hashable and printable."""

    items: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> "Config":
        return cls(tuple(sorted(values.items())))

    # The lookup dict, key and hash are remembered on the object (not fields: eq and repr stay
    # the items'); an unseen problem's pick hashes and reads its thousands of configs many times.
    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            object.__setattr__(self, "_hash", hash(self.items))
            return self._hash

    def __getstate__(self) -> dict[str, Any]:
        return {"items": self.items}  # not the memos: a str's hash differs from process to process

    def __getitem__(self, name: str) -> Any:
        # A dict of the items, built on the first lookup (not a field: eq, hash and repr stay the
        # items'): validate and the cost model read a config's knobs by name thousands of times
        # per unseen problem, and a scan of the items cost a microsecond each.
        try:
            return self._map[name]
        except AttributeError:
            object.__setattr__(self, "_map", dict(self.items))
            return self._map[name]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.items)

    def replace(self, **changes: Any) -> "Config":
        d = self.as_dict()
        d.update(changes)
        return Config.of(d)

    def key(self) -> str:
        try:  # built once per config (the cost model breaks its ranking's ties with it)
            return self._key
        except AttributeError:
            object.__setattr__(self, "_key", ",".join(f"{k}={v}" for k, v in self.items))
            return self._key


@dataclass(frozen=True)
class Target:
    """What a kernel is built for. CUDA/HIP differences are data here, not branches."""

    vendor: str  # "cuda" | "hip"
    arch: str  # "sm_90", "gfx942", ...
    warp_size: int = 32
    clusters: bool = False  # thread-block clusters with distributed shared memory (sm_90+)
    #: SMs (CUs) a grid whose blocks wait for each other may count on: the fewest of the visible
    #: devices of the arch for the target of a GPU at hand (`ckgen.runtime.target`), else 0: the
    #: arch's flagship part (`coresident_sms`). Not part of the target's identity.
    sms: int = field(default=0, compare=False, repr=False)

    @classmethod
    def named(cls, arch: str) -> "Target":
        """The target of an arch name: `sm_<major><minor>[a]` (NVIDIA) or `gfx<major><minor><stepping>`
        (AMD); ValueError for any other name (see _CUDA_ARCH, _HIP_ARCH)."""
        cuda = _CUDA_ARCH.fullmatch(arch) if isinstance(arch, str) else None
        if cuda:
            return cls("cuda", arch, 32, int(cuda.group(1)) >= 90)
        if isinstance(arch, str) and _HIP_ARCH.fullmatch(arch):
            # wave64 on GCN and CDNA (a one-digit major: gfx8xx, gfx9xx), wave32 on RDNA (gfx10xx and later)
            return cls("hip", arch, 64 if len(arch) == len("gfx9xx") else 32, False)
        raise ValueError(f"target: unknown arch {short_repr(arch)}; use sm_<major><minor>[a] (NVIDIA, e.g. sm_90, "
                         "sm_100) or gfx<major><minor><stepping> (AMD, e.g. gfx90a, gfx942, gfx1100)")


# The archs ckgen's kernels are for (data, not branches). NVIDIA from sm_80: the templates use
# max.NaN, cvt.rn.bf16x2.f32 and other sm_80 instructions, so an older arch fails to compile.
# AMD: the archs whose HIP builds CI checks (tools/hip-toolchain); another is untried (add it here
# once `ckgen generate --target` builds it).
MIN_CUDA_ARCH = 80
HIP_ARCHS = ("gfx90a", "gfx942", "gfx1100")


def unsupported(target: Target) -> str | None:
    """Why ckgen's kernels do not serve `target` (None: they do)."""
    if target.vendor == "cuda":
        digits = "".join(ch for ch in target.arch if ch.isdigit())
        if int(digits) < MIN_CUDA_ARCH:
            return (f"ckgen's kernels need sm_{MIN_CUDA_ARCH} or later (they use its instructions); "
                    f"{target.arch} is older")
        return None
    if target.arch not in HIP_ARCHS:
        return f"ckgen's AMD kernels are built for {', '.join(HIP_ARCHS)}; {target.arch} is not one of them"
    return None


def served(arch: str) -> Target:
    """`Target.named(arch)`, for an arch ckgen's kernels serve; ValueError otherwise (an unknown
    name, or an arch they do not run on: `unsupported`)."""
    target = Target.named(arch)
    why = unsupported(target)
    if why:
        raise ValueError(f"target: {why}")
    return target


# SMs (CUs) per arch where no device is at hand (the cost model's parallelism terms, tuning
# records, CI): the flagship part of each arch (an H100 SXM for sm_90). Others: DEFAULT_SMS.
NUM_SMS = {"sm_80": 108, "sm_86": 84, "sm_89": 128, "sm_90": 132, "sm_90a": 132, "sm_100": 148,
           "sm_120": 170, "gfx90a": 104, "gfx942": 304, "gfx1100": 96}
DEFAULT_SMS = 108


def coresident_sms(target: Target) -> int:
    """The SMs a grid whose blocks wait for each other (GroupNorm fwd merge=grid) may count on for
    `target`: `target.sms` (a GPU at hand: the fewest of the visible devices of that arch; an
    H100 PCIe has 114, an SXM 132), else the arch's flagship part (NUM_SMS). A config's validity
    so depends on the Target value alone, never on a query of the machine."""
    return target.sms or NUM_SMS.get(target.arch, DEFAULT_SMS)


@dataclass(frozen=True)
class Launch:
    kernel: str  # the symbol to launch
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int = 0
    cooperative: bool = False  # every block resident at once (cuLaunchCooperativeKernel): a grid barrier


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
