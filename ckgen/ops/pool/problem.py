"""Pooling problems (the DB key, PyTorch's output size, argument checks), the float64 references
and the random inputs the verifier draws."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...types import DTYPES, INT32_MAX, LAYOUTS, KernelLimitError, short_repr
from ..numeric import round_to
from ..spec import Problem, check_choice, check_flag, check_int

Pair = tuple[int, int]


def _covering_taps(k: int, s: int, pad: int, d: int, t: int) -> tuple[int, int, int]:
    """(i0, step, count): the taps i in [0, k) whose window position is input t, those with
    (t + pad - i*d) % s == 0, are i0 + j*step for j < count. In closed form, not a loop over the
    window (a legal kernel has up to 2^31 taps): with g = gcd(d, s), i*d = t + pad (mod s) has
    solutions iff g divides t + pad, and they are i0 + j*(s/g), i0 = (t+pad)/g * (d/g)^-1 mod s/g."""
    a, g = t + pad, math.gcd(d, s)
    if a % g:
        return 0, 1, 0
    m = s // g
    i0 = (a // g) * pow(d // g, -1, m) % m if m > 1 else 0
    return i0, m, (0 if i0 >= k else (k - 1 - i0) // m + 1)


def covering_span(k: int, s: int, pad: int, d: int, t: int) -> tuple[int, int] | None:
    """(first, last) of `covering(k, s, pad, d, t)`, None if it is empty; O(1)."""
    i0, m, n = _covering_taps(k, s, pad, d, t)
    if not n:
        return None
    return (t + pad - (i0 + (n - 1) * m) * d) // s, (t + pad - i0 * d) // s


def covering(k: int, s: int, pad: int, d: int, t: int) -> list[int]:
    """Along one axis, the outputs whose windows cover input position t (kernel k, stride s,
    padding pad, dilation d), as (t + pad - i*d) // s, ascending; border clipping ignored.
    Consecutive ones are d / gcd(d, s) apart (`_covering_taps`)."""
    span = covering_span(k, s, pad, d, t)
    if span is None:
        return []
    return list(range(span[0], span[1] + 1, d // math.gcd(d, s)))


def _pair(v: Any, arg: str, *, allow_zero: bool = False) -> Pair:
    """int or (int, int) -> (int, int), each in [0 or 1, 2^31-1] (a kernel's `constexpr int`);
    ValueError naming `arg` otherwise. NumPy integers are ints."""
    vals = (v, v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else v
    if isinstance(vals, (str, bytes, dict)):
        raise ValueError(f"{arg}: expected an int or a pair of ints, got {short_repr(v)}")
    try:
        a, b = vals
    except (TypeError, ValueError):
        raise ValueError(f"{arg}: expected an int or a pair of ints, got {short_repr(v)}") from None
    out = []
    for x in (a, b):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise ValueError(f"{arg}: expected an int or a pair of ints, got {short_repr(v)}")
        if x < 0 or (x == 0 and not allow_zero):
            raise ValueError(f"{arg}: must be {'>= 0' if allow_zero else 'positive'}, got {short_repr(v)}")
        if x > INT32_MAX:
            raise ValueError(f"{arg}: {int(x)} exceeds {INT32_MAX} (2^31-1: a 32-bit int in the kernel)")
        out.append(int(x))
    return out[0], out[1]


def pool_output_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """PyTorch's pooling_output_shape (may return < 1; the caller rejects that)."""
    eff = d * (k - 1) + 1
    out = (size + 2 * p - eff + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1  # the last window would start in the right padding
    return out


def canonical_stride(H: int, W: int, k: Pair, s: Pair, p: Pair, d: Pair, ceil_mode: bool) -> Pair:
    """The stride a pooling problem is keyed and compiled with: along an axis with one output, a
    stride below the effective kernel is raised to it. The only window there starts at -padding
    whatever the stride, and PyTorch's output size stays 1: floor((size + 2p - ek) / s) = 0 for
    the given s implies it for any larger one, and ceil_mode's extra window (when it exists) starts
    at s' >= s >= size + p, in the right padding, so it is dropped again."""
    out = list(s)
    for axis, size in ((0, H), (1, W)):
        ek = (k[axis] - 1) * d[axis] + 1
        if s[axis] < ek and pool_output_size(size, k[axis], s[axis], p[axis], d[axis], ceil_mode) == 1:
            out[axis] = ek
    return out[0], out[1]


@dataclass(frozen=True)
class PoolProblem(Problem):
    """What picks a pooling instance (the DB key): shape, dtype, layout and pooling params."""

    N: int
    C: int
    H: int
    W: int
    dtype: str
    layout: str
    kernel: Pair
    stride: Pair
    padding: Pair = (0, 0)
    dilation: Pair = (1, 1)
    ceil_mode: bool = False

    def __post_init__(self) -> None:
        # N, C, H, W, OH, OW are int32 kernel arguments; kernel, stride, padding and dilation
        # become `constexpr int`s, and every window coordinate a kernel computes is an int.
        for f in ("N", "C", "H", "W"):
            object.__setattr__(self, f, check_int(f, getattr(self, f)))
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("layout", self.layout, LAYOUTS)
        k = _pair(self.kernel, "kernel_size")
        s = _pair(self.stride, "stride")
        p = _pair(self.padding, "padding", allow_zero=True)
        d = _pair(self.dilation, "dilation")
        object.__setattr__(self, "kernel", k)
        object.__setattr__(self, "stride", s)
        object.__setattr__(self, "padding", p)
        object.__setattr__(self, "dilation", d)
        object.__setattr__(self, "ceil_mode", check_flag("ceil_mode", self.ceil_mode))
        if p[0] > k[0] // 2 or p[1] > k[1] // 2:
            raise ValueError(f"padding: {p} must be at most half the kernel size {k} (PyTorch's rule)")
        for axis, size in ((0, self.H), (1, self.W)):
            ek = (k[axis] - 1) * d[axis] + 1
            if ek > INT32_MAX:
                raise ValueError(f"{'dilation' if d[axis] > 1 else 'kernel_size'}: the effective kernel "
                                 f"(kernel_size-1)*dilation+1 = {ek} exceeds {INT32_MAX} (2^31-1)")
            # The furthest window coordinate: the input plus both paddings, a stride (ceil_mode's
            # last window) and a window. Blame the largest part.
            parts = {"H" if axis == 0 else "W": size, "padding": 2 * p[axis], "stride": s[axis],
                     "dilation" if d[axis] > 1 else "kernel_size": ek}
            if sum(parts.values()) > INT32_MAX:
                worst = max(parts, key=parts.get)
                raise KernelLimitError(f"{worst}: window coordinates reach {sum(parts.values())} along "
                                 f"{'H' if axis == 0 else 'W'} (size {size} + 2*padding {2 * p[axis]} + stride "
                                 f"{s[axis]} + effective kernel {ek}), beyond {INT32_MAX} (2^31-1, int in the kernel)")
        if self.OH < 1 or self.OW < 1:
            raise ValueError(f"kernel_size: output size {self.OH}x{self.OW} is too small for input "
                             f"{self.H}x{self.W} (kernel {k}, stride {s}, padding {p}, dilation {d})")
        # The kernels index an (n, c) plane, of x and of y, with 32-bit ints: no config can run a
        # larger one, so it is an argument error here, not "no config of the tuning space".
        big = "H" if self.H >= self.W else "W"
        if self.H * self.W >= 2**31:
            raise KernelLimitError(f"{big}: an (n, c) plane of H x W = {self.H} x {self.W} = {self.H * self.W} elements "
                             "is 2^31 or more; the kernels index a plane with 32-bit ints")
        if self.OH * self.OW >= 2**31:
            raise KernelLimitError(f"{big}: the output plane of OH x OW = {self.OH} x {self.OW} = {self.OH * self.OW} "
                             f"elements (input {self.H} x {self.W}, padding {p}) is 2^31 or more; the kernels "
                             "index a plane with 32-bit ints")
        # One output along an axis: the stride there never moves a window, so it is set to the
        # effective kernel when smaller (the same output, values and indices; see
        # `canonical_stride`). A global pool written with stride 1 (`nn.AvgPool2d(7, stride=1)` on
        # 7x7) is then the stride-7 problem: its DB entry, and kernels without overlapping windows.
        object.__setattr__(self, "stride", canonical_stride(self.H, self.W, k, s, p, d, self.ceil_mode))
        for derived in ("OH", "OW", "eff_kernel"):
            self.__dict__.pop(derived, None)

    # ---- derived sizes ----
    # Remembered per problem (not fields: eq, hash and the key stay the fields'): validate and
    # the cost model read them for every config of an unseen problem's pick. __post_init__
    # forgets what it read before the stride took its canonical value.
    @functools.cached_property
    def OH(self) -> int:
        return pool_output_size(self.H, self.kernel[0], self.stride[0], self.padding[0], self.dilation[0], self.ceil_mode)

    @functools.cached_property
    def OW(self) -> int:
        return pool_output_size(self.W, self.kernel[1], self.stride[1], self.padding[1], self.dilation[1], self.ceil_mode)

    @functools.cached_property
    def eff_kernel(self) -> Pair:
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilation))  # type: ignore[return-value]

    @property
    def overlap(self) -> bool:
        """Do neighbouring windows share input elements? (stride < effective kernel)"""
        ek = self.eff_kernel
        return self.stride[0] < ek[0] or self.stride[1] < ek[1]

    @property
    def windows_per_element(self) -> int:
        """The most windows one input element lies in (away from the borders): per axis, the
        largest `covering` over one stride period, ceil(k / (s / gcd(d, s))): the taps covering
        a position are every (s / gcd)-th from the first, and the first is tap 0 where
        t + pad is a multiple of s (`_covering_taps`)."""
        n = 1
        for k, s, d in zip(self.kernel, self.stride, self.dilation):
            n *= -(-k // (s // math.gcd(d, s)))
        return n

    @property
    def numel(self) -> int:
        return self.N * self.C * self.H * self.W

    @property
    def out_numel(self) -> int:
        return self.N * self.C * self.OH * self.OW

    def pool_key(self) -> str:
        k, s, p, d = self.kernel, self.stride, self.padding, self.dilation
        return (f"k={k[0]}x{k[1]},s={s[0]}x{s[1]},p={p[0]}x{p[1]},d={d[0]}x{d[1]},ceil={int(self.ceil_mode)}")

    def extra_key(self) -> str:
        return ""

    def key(self) -> str:
        return (f"N={self.N},C={self.C},H={self.H},W={self.W},{self.pool_key()},"
                f"dtype={self.dtype},layout={self.layout}{self.extra_key()}")

    def same_pooling(self, other: "PoolProblem") -> bool:
        return type(self) is type(other) and self.pool_key() == other.pool_key() and \
            self.extra_key() == other.extra_key()

    @classmethod
    def from_key(cls, key: str) -> "PoolProblem":
        try:
            kv = dict(part.split("=", 1) for part in key.split(","))

            def pair(name: str) -> Pair:
                a, b = kv.pop(name).split("x")
                return int(a), int(b)

            base = dict(N=int(kv.pop("N")), C=int(kv.pop("C")), H=int(kv.pop("H")), W=int(kv.pop("W")),
                        kernel=pair("k"), stride=pair("s"), padding=pair("p"), dilation=pair("d"),
                        ceil_mode=int(kv.pop("ceil")), dtype=kv.pop("dtype"), layout=kv.pop("layout"))
            return cls(**base, **cls.extra_from_key(kv))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"problem key {short_repr(key)} is malformed: {e}") from None

    @classmethod
    def extra_from_key(cls, kv: dict[str, str]) -> dict[str, Any]:
        if kv:
            raise ValueError(f"unknown fields {sorted(kv)}")
        return {}


@dataclass(frozen=True)
class MaxPoolFwdProblem(PoolProblem):
    return_indices: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "return_indices", check_flag("return_indices", self.return_indices))

    def extra_key(self) -> str:
        return f",idx={int(self.return_indices)}"

    @classmethod
    def extra_from_key(cls, kv: dict[str, str]) -> dict[str, Any]:
        ri = int(kv.pop("idx"))
        super().extra_from_key(kv)
        return {"return_indices": ri}


@dataclass(frozen=True)
class MaxPoolBwdProblem(PoolProblem):
    indices: str = "stored"  # "stored": read the forward's int64 indices; "recompute": argmax from x

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("indices", self.indices, ("stored", "recompute"), "'stored', 'recompute'")

    def extra_key(self) -> str:
        return f",indices={self.indices}"

    @classmethod
    def extra_from_key(cls, kv: dict[str, str]) -> dict[str, Any]:
        ind = kv.pop("indices")
        super().extra_from_key(kv)
        return {"indices": ind}


@dataclass(frozen=True)
class AvgPoolProblem(PoolProblem):
    count_include_pad: bool = True
    divisor_override: int = 0  # 0: none

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dilation != (1, 1):
            raise ValueError(f"dilation: average pooling has no dilation, got {self.dilation}")
        dv = self.divisor_override
        if isinstance(dv, bool) or not isinstance(dv, (int, np.integer)) or dv < 0:
            raise ValueError(f"divisor_override: expected None or a positive int, got {short_repr(dv)}")
        if dv > INT32_MAX:  # `constexpr int DIVISOR`: 2**32 became 0, i.e. no override
            raise ValueError(f"divisor_override: {int(dv)} exceeds {INT32_MAX} (2^31-1: a 32-bit int in the kernel)")
        object.__setattr__(self, "divisor_override", int(dv))
        object.__setattr__(self, "count_include_pad", check_flag("count_include_pad", self.count_include_pad))
        kh, kw = self.kernel
        if kh * kw > INT32_MAX:  # the window's area is the divisor, an int in the kernel
            raise ValueError(f"kernel_size: the window area {kh}x{kw} = {kh * kw} exceeds {INT32_MAX} "
                             "(2^31-1: the divisor is a 32-bit int in the kernel)")

    def extra_key(self) -> str:
        return f",cip={int(self.count_include_pad)},div={self.divisor_override}"

    @classmethod
    def extra_from_key(cls, kv: dict[str, str]) -> dict[str, Any]:
        cip, div = int(kv.pop("cip")), int(kv.pop("div"))
        super().extra_from_key(kv)
        return {"count_include_pad": cip, "divisor_override": div}


# ---------------------------------------------------------------------------------------------
# float64 references (vectorised over N, C and the output positions; loops over kernel taps)
# ---------------------------------------------------------------------------------------------
def _taps(p: PoolProblem):
    """Per kernel tap (i, j), in window order: the input rows/cols of every output position and
    whether they are inside the input. Yields (hi (OH,), hin (OH,), wi (OW,), win (OW,))."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = p.kernel, p.stride, p.padding, p.dilation
    oh, ow = np.arange(p.OH), np.arange(p.OW)
    for i in range(kh):
        hi = oh * sh - ph + i * dh
        for j in range(kw):
            wi = ow * sw - pw + j * dw
            yield hi, (hi >= 0) & (hi < p.H), wi, (wi >= 0) & (wi < p.W)


def maxpool2d_reference(p: PoolProblem, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """y (float64) and indices (int64), both (N, C, OH, OW)."""
    x = np.asarray(x, dtype=np.float64)
    shape = (p.N, p.C, p.OH, p.OW)
    best = np.full(shape, -np.inf)
    idx = np.full(shape, -1, dtype=np.int64)
    for hi, hin, wi, win in _taps(p):
        inb = hin[:, None] & win[None, :]
        if not inb.any():
            continue
        v = x[:, :, np.clip(hi, 0, p.H - 1)[:, None], np.clip(wi, 0, p.W - 1)[None, :]]
        with np.errstate(invalid="ignore"):
            upd = inb & ((v > best) | np.isnan(v) | (idx < 0))
        best = np.where(upd, v, best)
        idx = np.where(upd, (hi[:, None] * p.W + wi[None, :]), idx)
    return best, idx


def avgpool2d_divisor(p: AvgPoolProblem) -> np.ndarray:
    """(OH, OW) divisors, exactly as PyTorch computes them."""
    (kh, kw), (sh, sw), (ph, pw) = p.kernel, p.stride, p.padding
    hs = np.arange(p.OH) * sh - ph
    ws = np.arange(p.OW) * sw - pw
    he, we = np.minimum(hs + kh, p.H + ph), np.minimum(ws + kw, p.W + pw)
    pool = (he - hs)[:, None] * (we - ws)[None, :]
    cnt = (np.minimum(he, p.H) - np.maximum(hs, 0))[:, None] * (np.minimum(we, p.W) - np.maximum(ws, 0))[None, :]
    if p.divisor_override:
        return np.full((p.OH, p.OW), float(p.divisor_override))
    return (pool if p.count_include_pad else cnt).astype(np.float64)


def avgpool2d_reference(p: AvgPoolProblem, x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    acc = np.zeros((p.N, p.C, p.OH, p.OW))
    for hi, hin, wi, win in _taps(p):
        inb = hin[:, None] & win[None, :]
        if inb.any():
            v = x[:, :, np.clip(hi, 0, p.H - 1)[:, None], np.clip(wi, 0, p.W - 1)[None, :]]
            acc += np.where(inb, v, 0.0)
    return acc / avgpool2d_divisor(p)


def maxpool2d_bwd_reference(p: PoolProblem, dy: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """dx: every dy goes to its window's argmax; overlapping windows accumulate."""
    dy = np.asarray(dy, dtype=np.float64)
    plane = (np.arange(p.N * p.C, dtype=np.int64) * (p.H * p.W)).reshape(p.N, p.C, 1, 1)
    idx = np.asarray(indices, dtype=np.int64)
    keep = ((idx >= 0) & (idx < p.H * p.W)).ravel()  # -1: a window with no input element (dilation)
    flat = (idx + plane).ravel()[keep]
    dx = np.bincount(flat, weights=dy.ravel()[keep], minlength=p.numel)
    return dx.reshape(p.N, p.C, p.H, p.W)


def avgpool2d_bwd_reference(p: AvgPoolProblem, dy: np.ndarray) -> np.ndarray:
    g = np.asarray(dy, dtype=np.float64) / avgpool2d_divisor(p)
    (sh, sw), (ph, pw) = p.stride, p.padding
    kh, kw = p.kernel
    # a zero-padded dx wide enough for every window (ceil_mode overhang included), cropped at the end
    Hp = max(p.H + 2 * ph, (p.OH - 1) * sh + kh)
    Wp = max(p.W + 2 * pw, (p.OW - 1) * sw + kw)
    dxp = np.zeros((p.N, p.C, Hp, Wp))
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i:i + (p.OH - 1) * sh + 1:sh, j:j + (p.OW - 1) * sw + 1:sw] += g
    return dxp[:, :, ph:ph + p.H, pw:pw + p.W]


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
def tie_heavy(p: PoolProblem, rng: np.random.Generator, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Values on a coarse grid (multiples of 1/4 in [-4, 4]) with per-channel offsets: windows
    hold equal values, so first-index tie-breaking is exercised. Never all zero."""
    shape = shape or (p.N, p.C, p.H, p.W)
    chan = rng.integers(-8, 9, size=(1, shape[1], 1, 1)) / 4.0
    x = np.round(rng.uniform(-4.0, 4.0, size=shape) * 4.0) / 4.0 + chan
    x.flat[0] = 1.25  # never all zero
    return round_to(x, p.dtype)


def smooth_random(p: PoolProblem, rng: np.random.Generator, shape: tuple[int, ...] | None = None) -> np.ndarray:
    shape = shape or (p.N, p.C, p.H, p.W)
    mu = rng.normal(0.0, 0.5, size=(1, shape[1], 1, 1))
    x = mu + rng.standard_normal(shape)
    x[x == 0] = 0.5
    return round_to(x, p.dtype)


@functools.lru_cache(maxsize=4096)
def cover_extent(k: int, s: int, pad: int, d: int, tile: int) -> tuple[int, int]:
    """(first offset, count) of the outputs covering a tile of `tile` positions along an axis
    (`_PoolOp._cover_extent`); a pure function of the window, remembered."""
    spans = [sp for t in range(tile) if (sp := covering_span(k, s, pad, d, t)) is not None]
    if not spans:
        return 0, 1
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    return lo, hi - lo + 1
