"""2-D pooling ops (max and average, forward and backward), each declared once as an OpSpec.

Semantics are PyTorch's (F.max_pool2d / F.avg_pool2d and their gradients):
  - output size: floor((H + 2p - d*(k-1) - 1 (+ s-1 with ceil_mode)) / s) + 1, and with
    ceil_mode a last window that would start in the right padding is dropped;
  - max: padding acts as -inf, ties go to the first element in window order (row-major), NaN
    wins (every NaN replaces the running max, as in PyTorch's `val > max || isnan(val)`, so the
    index is that of the window's last NaN), an all -inf window returns its first in-bounds index;
    indices are int64, flat h*W + w within each (n, c) plane;
  - avg: count_include_pad counts the padding but not the ceil_mode overhang beyond it;
    divisor_override wins over both.

The pooling parameters are part of the problem key and compile-time constants of a kernel; the
shape (N, C, H, W) is a kernel argument, so one instance serves every shape it is valid for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from ..space import load_space
from ..types import DTYPES, INT32_MAX, LAYOUTS, Config, Launch, Support, Target, Tolerance, short_repr
from .numeric import from_storage, round_to, to_storage
from .spec import OpSpec, Problem, check_choice, check_flag, check_int

_U32 = 2**32
_I32 = 2**31
Pair = tuple[int, int]


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
                raise ValueError(f"{worst}: window coordinates reach {sum(parts.values())} along "
                                 f"{'H' if axis == 0 else 'W'} (size {size} + 2*padding {2 * p[axis]} + stride "
                                 f"{s[axis]} + effective kernel {ek}), beyond {INT32_MAX} (2^31-1, int in the kernel)")
        if self.OH < 1 or self.OW < 1:
            raise ValueError(f"kernel_size: output size {self.OH}x{self.OW} is too small for input "
                             f"{self.H}x{self.W} (kernel {k}, stride {s}, padding {p}, dilation {d})")

    # ---- derived sizes ----
    @property
    def OH(self) -> int:
        return pool_output_size(self.H, self.kernel[0], self.stride[0], self.padding[0], self.dilation[0], self.ceil_mode)

    @property
    def OW(self) -> int:
        return pool_output_size(self.W, self.kernel[1], self.stride[1], self.padding[1], self.dilation[1], self.ceil_mode)

    @property
    def eff_kernel(self) -> Pair:
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilation))  # type: ignore[return-value]

    @property
    def overlap(self) -> bool:
        """Do neighbouring windows share input elements? (stride < effective kernel)"""
        ek = self.eff_kernel
        return self.stride[0] < ek[0] or self.stride[1] < ek[1]

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
# The OpSpecs
# ---------------------------------------------------------------------------------------------
def _regs_per_thread(config: Config) -> int:
    return min(255, 65536 // (config["threads"] * config["min_blocks"]))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_STORAGE_BITS = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}


class _PoolOp(OpSpec):
    """What the four pooling ops share: problems, layouts, packing, launch shape, naming."""

    name: ClassVar[str]
    template: ClassVar[str]
    problem_cls: ClassVar[type]
    pool: ClassVar[str]  # "max" | "avg"
    backward: ClassVar[bool]

    @property
    def space(self):
        return load_space(self.name)

    # ---- problems ----
    def parse_problem(self, **kw: Any) -> PoolProblem:
        kw = dict(kw)
        if "kernel_size" in kw:
            kw["kernel"] = kw.pop("kernel_size")
        if kw.get("stride") is None:
            kw["stride"] = kw["kernel"]
        if "divisor_override" in kw and kw["divisor_override"] is None:
            kw["divisor_override"] = 0
        return self.problem_cls(**kw)

    def problem_from_key(self, key: str) -> PoolProblem:
        return self.problem_cls.from_key(key)

    def _extra_defaults(self, case: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def default_problems(self, dtypes: list[str] | None = None, layouts: list[str] | None = None,
                         activations: list[str] | None = None) -> list[PoolProblem]:
        """The YAML's cases x dtypes x layouts (activations do not apply to pooling)."""
        dp = self.space.default_problems
        out = []
        for case in dp["cases"]:
            N, C, H, W = case["shape"]
            for d in dtypes or dp["dtypes"]:
                for lay in layouts or dp["layouts"]:
                    out.append(self.parse_problem(
                        N=N, C=C, H=H, W=W, dtype=d, layout=lay, kernel=case["kernel"],
                        stride=case.get("stride"), padding=case.get("padding", 0),
                        dilation=case.get("dilation", 1), ceil_mode=case.get("ceil_mode", False),
                        **self._extra_defaults(case)))
        return out

    def _extra_cli(self, args: Any) -> dict[str, Any]:
        return {}

    def problems_from_cli(self, args: Any) -> list[PoolProblem]:
        if len(args.shape) != 4:
            raise ValueError(f"--shape: takes N,C,H,W (4 numbers), got {len(args.shape)}")
        if getattr(args, "kernel", None) is None:
            raise ValueError("--kernel: required with --shape for pooling ops (e.g. --kernel 3)")
        n, c, h, w = args.shape
        common = dict(N=n, C=c, H=h, W=w, kernel=args.kernel, stride=args.stride,
                      padding=args.padding if args.padding is not None else 0, ceil_mode=bool(args.ceil_mode))
        if self.pool == "max":
            common["dilation"] = args.dilation if args.dilation is not None else 1
        elif args.dilation not in (None, 1, [1], [1, 1]):
            raise ValueError(f"--dilation: {self.name} has no dilation")
        common.update(self._extra_cli(args))
        for k in ("kernel", "stride", "padding", "dilation"):
            v = common.get(k)
            if isinstance(v, list):
                common[k] = v[0] if len(v) == 1 else tuple(v)
        return [self.parse_problem(**common, dtype=d, layout=lay)
                for d in (args.dtype or ["bf16"]) for lay in (args.layout or ["nchw"])]

    # ---- configs ----
    def vec_elems(self, p: PoolProblem, config: Config) -> int:
        """Channels per vector: vec_bytes of them in NHWC, 1 in NCHW."""
        return config["vec_bytes"] // DTYPES[p.dtype]["itemsize"] if p.layout == "nhwc" else 1

    def row_vec_elems(self, p: PoolProblem, config: Config) -> int:
        """NCHW: elements per vector load along W (vec_bytes of them); 1 in NHWC."""
        return config["vec_bytes"] // DTYPES[p.dtype]["itemsize"] if p.layout == "nchw" else 1

    def x_footprint(self, p: PoolProblem, config: Config) -> bool:
        """Max backward, indices=None, NCHW, stride-aligned gather: the covering outputs' windows
        are read once into registers (rows as vectors) and every argmax comes from there."""
        if not (self.backward and self.pool == "max" and getattr(p, "indices", "") == "recompute"
                and p.layout == "nchw" and self.aligned_gather(p, config)):
            return False
        ob0 = _cover_span(self._cover(p, config, 1))[0]
        pre = p.padding[1] - ob0 * p.stride[1]  # the tile's first column in the footprint
        return pre >= 0 and pre + self.tile(config)[1] <= self._x_footprint_dims(p, config)[1]

    def _x_footprint_dims(self, p: PoolProblem, config: Config) -> tuple[int, int]:
        """(rows, columns) of x under the windows of an aligned gather tile's covering outputs
        (the template's XR x XC)."""
        (_, na), (_, nb) = _cover_span(self._cover(p, config, 0)), _cover_span(self._cover(p, config, 1))
        return (na - 1) * p.stride[0] + p.eff_kernel[0], (nb - 1) * p.stride[1] + p.eff_kernel[1]

    def aligned_gather(self, p: PoolProblem, config: Config) -> bool:
        """Backward gather with a tile that starts at multiples of the stride: which outputs cover
        which tile element is then known at compile time (the fast gather)."""
        th, tw = self.tile(config)
        return self.backward and config.as_dict().get("algo") == "gather" and \
            tw % p.stride[1] == 0 and th % p.stride[0] == 0

    def _cover(self, p: PoolProblem, config: Config, axis: int) -> list[list[int]]:
        """Aligned gather, per tile position t along `axis` (0: H, 1: W): the outputs whose
        windows cover it, as offsets from tile_start / stride, ascending (PyTorch's order)."""
        t_n = self.tile(config)[axis]
        k, s, pad, d = p.kernel[axis], p.stride[axis], p.padding[axis], p.dilation[axis]
        return [sorted({(t + pad - i * d) // s for i in range(k) if (t + pad - i * d) % s == 0})
                for t in range(t_n)]

    def tile(self, config: Config) -> tuple[int, int]:
        """(rows, cols) of the positions one thread computes: outputs (forward) or inputs (gather)."""
        return config["th"], config["tw"]

    def _footprint(self, p: PoolProblem, config: Config) -> int:
        th, tw = self.tile(config)
        ek = p.eff_kernel
        return ((th - 1) * p.stride[0] + ek[0]) * ((tw - 1) * p.stride[1] + ek[1])

    def _tiles(self, p: PoolProblem, config: Config) -> tuple[int, int, int, int]:
        """(planes, tile rows, tile columns, channel vectors) of the main kernel's decomposition."""
        th, tw = self.tile(config)
        if self.backward and config["algo"] == "scatter":
            rows, cols = p.OH, p.OW
        elif self.backward:
            rows, cols = p.H, p.W
        else:
            rows, cols = p.OH, p.OW
        if p.layout == "nhwc":
            return p.N, _cdiv(rows, th), _cdiv(cols, tw), p.C // self.vec_elems(p, config)
        return p.N * p.C, _cdiv(rows, th), _cdiv(cols, tw), 1

    def _work_items(self, p: PoolProblem, config: Config) -> int:
        """Threads of the main kernel (each: a tile of positions x one vector of channels)."""
        planes, nrow, ncol, cvec = self._tiles(p, config)
        return planes * nrow * ncol * cvec

    def _blocks(self, p: PoolProblem, config: Config) -> int:
        """Blocks of the main kernel: threads / block (block_rows = 1), or planes x block rows x
        block columns (each block BR tile rows x threads / (C/VEC * BR) tile columns)."""
        br, t = config.as_dict().get("block_rows", 1), config["threads"]
        if br == 1:
            return _cdiv(self._work_items(p, config), t)
        planes, nrow, ncol, cvec = self._tiles(p, config)
        return planes * _cdiv(nrow, br) * _cdiv(ncol, t // (cvec * br))

    def _regs_needed(self, p: PoolProblem, config: Config) -> int:
        raise NotImplementedError

    def _coord_reach(self, p: PoolProblem, config: Config) -> int:
        """The largest window coordinate a thread computes along either axis, its tile's overhang
        past the last output (forward) or input (backward) included; must fit an int."""
        reach = 0
        for axis, t in enumerate(self.tile(config)):
            size, out = (p.H, p.OH) if axis == 0 else (p.W, p.OW)
            ek, s, pad = p.eff_kernel[axis], p.stride[axis], p.padding[axis]
            if self.backward:  # input positions; a covering output's window starts at most pad before
                r = _cdiv(size, t) * t + 2 * pad + s + ek
            else:  # the last tile's last output row times the stride, plus a window
                r = (_cdiv(out, t) * t - 1) * s + ek
            reach = max(reach, r)
        return reach

    def _row_regs(self, p: PoolProblem, config: Config) -> int:
        """Forward: registers of one loaded footprint row (NCHW) or input vector (NHWC)."""
        if p.layout == "nchw":
            return (self.tile(config)[1] - 1) * p.stride[1] + p.eff_kernel[1] + p.padding[1]
        return 2 * self.vec_elems(p, config)

    def validate(self, p: PoolProblem, config: Config, target: Target) -> Support:
        in_space = self.space.check(config)
        if not in_space:
            return in_space
        item = DTYPES[p.dtype]["itemsize"]
        vb, threads = config["vec_bytes"], config["threads"]
        if vb % item:
            return Support.no(f"vec_bytes={vb} is not a whole number of {p.dtype} elements")
        vec = vb // item
        if threads % target.warp_size:
            return Support.no(f"threads={threads} is not a multiple of the warp size {target.warp_size}")
        th, tw = self.tile(config)
        if p.layout == "nchw" and vec != 1:
            if self.backward and not self.x_footprint(p, config):
                return Support.no(f"vec_bytes={vb}: the NCHW backward reads single {p.dtype} elements "
                                  f"(vec_bytes={item}) except for indices=None with a stride-aligned gather "
                                  "(x rows as vectors); vectors run along C in NHWC")
            if self.backward and tw % vec:
                return Support.no(f"vec_bytes={vb}: a vector of {vec} elements does not divide tw={tw}")
            if p.W % vec:
                return Support.no(f"vec_bytes={vb}: a vector of {vec} elements along W does not divide W={p.W}")
            if not self.backward and (tw * p.stride[1]) % vec:
                return Support.no(f"vec_bytes={vb}: a thread's input span tw*stride={tw * p.stride[1]} is not "
                                  f"a whole number of {vec}-element vectors")
        if p.layout == "nhwc" and p.C % vec:
            return Support.no(f"vector of {vec} channels does not divide C={p.C}")
        rows, cols = (p.H, p.W) if self.backward else (p.OH, p.OW)
        if tw > 1 and tw > cols:
            return Support.no(f"tw={tw} positions per thread exceed the width {cols}")
        if th > 1 and th > rows:
            return Support.no(f"th={th} positions per thread exceed the height {rows}")
        if (th > 1 or tw > 1) and self._footprint(p, config) > 256:
            return Support.no(f"a {th}x{tw} tile reads {self._footprint(p, config)} window positions; "
                              "over 256 the unrolled code grows too large")
        reach = self._coord_reach(p, config)
        if reach > INT32_MAX:
            return Support.no(f"a {th}x{tw} tile's window coordinates reach {reach}, beyond 2^31-1 (int in the kernel)")
        regs = self._regs_needed(p, config)
        if regs > _regs_per_thread(config):
            return Support.no(f"about {regs} registers per thread exceed the budget of {_regs_per_thread(config)} "
                              f"at {threads} threads x {config['min_blocks']} blocks/SM")
        if p.H * p.W >= _I32 or p.OH * p.OW >= _I32:
            return Support.no("one (n, c) plane has 2^31 elements or more (indices are int32 in the kernel)")
        items = self._work_items(p, config)
        if items >= _U32:
            return Support.no(f"{items} threads exceed the 32-bit thread index; use a larger tile or vector")
        br = config.as_dict().get("block_rows", 1)
        if br > 1:
            planes, nrow, ncol, cvec = self._tiles(p, config)
            if threads % (cvec * br):
                return Support.no(f"block_rows={br}: {cvec} channel vectors x {br} rows do not divide threads={threads}")
            if br > nrow:
                return Support.no(f"block_rows={br} exceed the {nrow} tile rows")
            if self._blocks(p, config) * threads >= _U32:
                return Support.no("block_rows: padded grid exceeds the 32-bit thread index")
        if self._blocks(p, config) >= _I32:
            return Support.no("grid too large")
        return self._validate_more(p, config, target)

    def _validate_more(self, p: PoolProblem, config: Config, target: Target) -> Support:
        return Support.yes()

    def instance_name(self, p: PoolProblem, config: Config) -> str:
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = p.kernel, p.stride, p.padding, p.dilation
        sq = kh == kw and sh == sw and ph == pw and dh == dw
        geo = (f"k{kh}s{sh}p{ph}d{dh}" if sq else f"k{kh}x{kw}s{sh}x{sw}p{ph}x{pw}d{dh}x{dw}")
        geo += "_ceil" if p.ceil_mode else ""
        c = config
        br = c.as_dict().get("block_rows", 1)
        return (f"ckgen_{self.name}_{p.dtype}_{p.layout}_{geo}{self._name_flags(p)}_t{c['threads']}"
                f"_v{c['vec_bytes']}_ow{c['tw']}_oh{c['th']}{f'_br{br}' if br > 1 else ''}"
                f"_m{c['min_blocks']}{self._name_algo(c)}")

    def _name_flags(self, p: PoolProblem) -> str:
        return ""

    def _name_algo(self, c: Config) -> str:
        return ""

    def render_context(self, p: PoolProblem, config: Config, target: Target) -> dict[str, Any]:
        d = DTYPES[p.dtype]
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = p.kernel, p.stride, p.padding, p.dilation
        ctx = dict(config.as_dict(), target=target, dtype=p.dtype, layout=p.layout, storage=d["storage"],
                   itemsize=d["itemsize"], vec=self.vec_elems(p, config), rvec=self.row_vec_elems(p, config),
                   pool=self.pool, aligned=False, xfoot=False, block_rows=config.as_dict().get("block_rows", 1),
                   kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw, dh=dh, dw=dw, overlap=p.overlap,
                   return_indices=False, indices="none", count_include_pad=True, divisor_override=0)
        ctx.update(self._context_flags(p))
        return ctx

    def _context_flags(self, p: PoolProblem) -> dict[str, Any]:
        return {}

    def launches(self, p: PoolProblem, config: Config, target: Target) -> tuple[Launch, ...]:
        name = self.instance_name(p, config)
        t = config["threads"]
        return (Launch(name, (self._blocks(p, config), 1, 1), (t, 1, 1)),)

    # ---- buffers ----
    def _plane_major(self, p: PoolProblem, a: np.ndarray) -> np.ndarray:
        """(N, C, h, w) logical -> flat in the problem's memory order."""
        return np.ascontiguousarray(a if p.layout == "nchw" else np.transpose(a, (0, 2, 3, 1))).ravel()

    def _logical(self, p: PoolProblem, flat: Any, h: int, w: int) -> Any:
        if p.layout == "nchw":
            return flat.reshape(p.N, p.C, h, w)
        return flat.reshape(p.N, h, w, p.C).transpose(0, 3, 1, 2)

    arg_names: ClassVar[tuple[str, ...]] = ("x", "y", "indices", "dy", "dx", "ws")

    def scalar_args(self, p: PoolProblem) -> tuple:
        i = np.int32
        return i(p.N), i(p.C), i(p.H), i(p.W), i(p.OH), i(p.OW)

    def distance(self, a: PoolProblem, b: PoolProblem) -> float:
        d = abs(math.log(a.numel / b.numel)) + abs(math.log(a.H * a.W / (b.H * b.W)))
        d += abs(math.log(a.C / b.C)) + abs(math.log(a.N / b.N))
        d += 4.0 * (a.layout != b.layout) + 2.0 * (a.dtype != b.dtype)
        d += 0.0 if a.same_pooling(b) else 100.0  # other pooling params: another kernel entirely
        return d

    def seed_configs(self, p: PoolProblem, target: Target, num_sms: int, count: int) -> list[Config]:
        """Valid configs a simple model likes: 16-byte vectors, 4-16 positions per thread (the
        stride-aligned gather in the backward), enough threads to fill every SM a few times,
        256-thread blocks."""
        def score(c: Config) -> float:
            items = self._work_items(p, c)
            fill = min(1.0, items / (num_sms * 2048))
            th, tw = self.tile(c)
            return (2.0 * c["vec_bytes"] / 16 + 2.0 * fill + 0.5 * (4 <= th * tw <= 16) + 0.25 * (tw >= th)
                    + 1.0 * self.aligned_gather(p, c) - 0.25 * abs(math.log2(c["threads"] / 256))
                    + 0.25 * (c.as_dict().get("algo", "gather") == "gather"))

        valid = sorted((c for c in self.space.enumerate() if self.validate(p, c, target)), key=score, reverse=True)
        return valid[:count]

    def min_bytes(self, p: PoolProblem) -> int:
        raise NotImplementedError


class MaxPool2dFwd(_PoolOp):
    name: ClassVar[str] = "maxpool2d_fwd"
    template: ClassVar[str] = "maxpool2d_fwd.cu.j2"
    problem_cls: ClassVar[type] = MaxPoolFwdProblem
    pool: ClassVar[str] = "max"
    backward: ClassVar[bool] = False

    def _extra_defaults(self, case: Mapping[str, Any]) -> dict[str, Any]:
        return {"return_indices": case.get("return_indices", False)}

    def _extra_cli(self, args: Any) -> dict[str, Any]:
        return {"return_indices": bool(getattr(args, "return_indices", False))}

    def _name_flags(self, p: MaxPoolFwdProblem) -> str:
        return "_idx" if p.return_indices else ""

    def _context_flags(self, p: MaxPoolFwdProblem) -> dict[str, Any]:
        return {"return_indices": p.return_indices}

    def _regs_needed(self, p: MaxPoolFwdProblem, config: Config) -> int:
        th, tw = self.tile(config)
        vec = self.vec_elems(p, config)
        row = self._row_regs(p, config)
        return th * tw * vec * (2 if p.return_indices else 1) + row + 24

    def min_bytes(self, p: MaxPoolFwdProblem) -> int:
        item = DTYPES[p.dtype]["itemsize"]
        return p.numel * item + p.out_numel * (item + (8 if p.return_indices else 0))

    def make_inputs(self, p: PoolProblem, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"x": tie_heavy(p, rng)}

    def reference(self, p: MaxPoolFwdProblem, inputs: Mapping[str, np.ndarray], eps: float = 0.0) -> dict[str, np.ndarray]:
        y, idx = maxpool2d_reference(p, inputs["x"])
        return {"y": y, "indices": idx} if p.return_indices else {"y": y}

    def tolerance(self, dtype: str, output: str) -> Tolerance:
        return Tolerance(0.0, 0.0)  # max pooling selects; it never rounds

    def pack_inputs(self, p: PoolProblem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"x": to_storage(self._plane_major(p, inputs["x"]), p.dtype)}

    def output_buffers(self, p: MaxPoolFwdProblem) -> dict[str, tuple[int, Any]]:
        out = {"y": (p.out_numel, _STORAGE_BITS[p.dtype])}
        if p.return_indices:
            out["indices"] = (p.out_numel, np.int64)
        return out

    def unpack_outputs(self, p: MaxPoolFwdProblem, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {"y": self._logical(p, from_storage(raw["y"], p.dtype), p.OH, p.OW)}
        if "indices" in raw:
            out["indices"] = self._logical(p, raw["indices"], p.OH, p.OW)
        return out


class AvgPool2dFwd(_PoolOp):
    name: ClassVar[str] = "avgpool2d_fwd"
    template: ClassVar[str] = "avgpool2d_fwd.cu.j2"
    problem_cls: ClassVar[type] = AvgPoolProblem
    pool: ClassVar[str] = "avg"
    backward: ClassVar[bool] = False

    def _extra_defaults(self, case: Mapping[str, Any]) -> dict[str, Any]:
        return {"count_include_pad": case.get("count_include_pad", True),
                "divisor_override": case.get("divisor_override", 0)}

    def _extra_cli(self, args: Any) -> dict[str, Any]:
        cip = getattr(args, "count_include_pad", None)
        return {"count_include_pad": True if cip is None else bool(cip),
                "divisor_override": getattr(args, "divisor_override", None) or 0}

    def _name_flags(self, p: AvgPoolProblem) -> str:
        return ("" if p.count_include_pad else "_nopad") + (f"_div{p.divisor_override}" if p.divisor_override else "")

    def _context_flags(self, p: AvgPoolProblem) -> dict[str, Any]:
        return {"count_include_pad": p.count_include_pad, "divisor_override": p.divisor_override}

    def _regs_needed(self, p: AvgPoolProblem, config: Config) -> int:
        th, tw = self.tile(config)
        vec = self.vec_elems(p, config)
        row = self._row_regs(p, config)
        return th * tw * vec + row + 24

    def min_bytes(self, p: AvgPoolProblem) -> int:
        item = DTYPES[p.dtype]["itemsize"]
        return (p.numel + p.out_numel) * item

    def make_inputs(self, p: PoolProblem, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"x": smooth_random(p, rng)}

    def reference(self, p: AvgPoolProblem, inputs: Mapping[str, np.ndarray], eps: float = 0.0) -> dict[str, np.ndarray]:
        return {"y": avgpool2d_reference(p, inputs["x"])}

    def tolerance(self, dtype: str, output: str) -> Tolerance:
        return _AVG_TOL[dtype]

    pack_inputs = MaxPool2dFwd.pack_inputs

    def output_buffers(self, p: AvgPoolProblem) -> dict[str, tuple[int, Any]]:
        return {"y": (p.out_numel, _STORAGE_BITS[p.dtype])}

    def unpack_outputs(self, p: AvgPoolProblem, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": self._logical(p, from_storage(raw["y"], p.dtype), p.OH, p.OW)}


# fp32 accumulation, then one rounding to the dtype (the reference is exact float64)
_AVG_TOL = {"fp32": Tolerance(1e-5, 1e-5), "fp16": Tolerance(1e-4, 1e-3), "bf16": Tolerance(1e-3, 8e-3)}
# max pool backward: a sum of the few dy of overlapping windows in fp32, rounded once
_MAXBWD_TOL = {"fp32": Tolerance(1e-6, 2e-6), "fp16": Tolerance(1e-5, 1e-3), "bf16": Tolerance(1e-5, 8e-3)}


class _PoolBwd(_PoolOp):
    backward: ClassVar[bool] = True

    def _name_algo(self, c: Config) -> str:
        return f"_{c['algo']}"

    def _scatter_to_ws(self, p: PoolProblem) -> bool:
        """Scatter with overlapping windows in 16-bit: fp32 atomics on a workspace, then convert."""
        return p.overlap and p.dtype != "fp32"

    def _validate_more(self, p: PoolProblem, config: Config, target: Target) -> Support:
        if config["algo"] == "scatter" and p.numel >= 2**40:
            return Support.no("scatter's zero/convert loops take at most 2^40 elements")
        return Support.yes()

    def _regs_needed(self, p: PoolProblem, config: Config) -> int:
        th, tw = self.tile(config)
        vec = self.vec_elems(p, config)
        if self.aligned_gather(p, config):
            (_, na), (_, nb) = _cover_span(self._cover(p, config, 0)), _cover_span(self._cover(p, config, 1))
            xfoot = math.prod(self._x_footprint_dims(p, config)) if self.x_footprint(p, config) else 0
            return na * nb * vec * (2 if self.pool == "max" else 1) + 2 * tw * vec + 32 + xfoot
        return th * tw * vec + 4 * vec + 32

    def launches(self, p: PoolProblem, config: Config, target: Target) -> tuple[Launch, ...]:
        main = super().launches(p, config, target)
        if config["algo"] == "gather":
            return main
        name, t = main[0].kernel, config["threads"]
        fill = (min(_cdiv(_cdiv(p.numel * 4, 16), t), 65536), 1, 1)  # grid-stride loops
        if self._scatter_to_ws(p):
            return (Launch(f"{name}_zero", fill, (t, 1, 1)), main[0], Launch(f"{name}_convert", fill, (t, 1, 1)))
        return (Launch(f"{name}_zero", fill, (t, 1, 1)), main[0])

    def workspace_bytes(self, p: PoolProblem, config: Config) -> int:
        return p.numel * 4 if config["algo"] == "scatter" and self._scatter_to_ws(p) else 0

    def render_context(self, p: PoolProblem, config: Config, target: Target) -> dict[str, Any]:
        ctx = super().render_context(p, config, target)
        ctx["scatter_ws"] = self._scatter_to_ws(p)
        if self.aligned_gather(p, config):
            ch, cw = self._cover(p, config, 0), self._cover(p, config, 1)
            (h0, hn), (w0, wn) = _cover_span(ch), _cover_span(cw)
            ctx.update(aligned=True, cover_h=ch, cover_w=cw, cover_h0=h0, cover_hn=hn, cover_w0=w0, cover_wn=wn,
                       xfoot=self.x_footprint(p, config))
        return ctx

    def output_buffers(self, p: PoolProblem) -> dict[str, tuple[int, Any]]:
        return {"dx": (p.numel, _STORAGE_BITS[p.dtype])}

    def unpack_outputs(self, p: PoolProblem, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"dx": self._logical(p, from_storage(raw["dx"], p.dtype), p.H, p.W)}


def _cover_span(cover: list[list[int]]) -> tuple[int, int]:
    """(first offset, count) of the outputs a tile's cover lists name (at least one)."""
    offs = [o for lst in cover for o in lst]
    return (min(offs), max(offs) - min(offs) + 1) if offs else (0, 1)


class MaxPool2dBwd(_PoolBwd):
    name: ClassVar[str] = "maxpool2d_bwd"
    template: ClassVar[str] = "maxpool2d_bwd.cu.j2"
    problem_cls: ClassVar[type] = MaxPoolBwdProblem
    pool: ClassVar[str] = "max"

    def _extra_defaults(self, case: Mapping[str, Any]) -> dict[str, Any]:
        return {"indices": case.get("indices", "stored")}

    def _extra_cli(self, args: Any) -> dict[str, Any]:
        return {"indices": getattr(args, "indices", None) or "stored"}

    def _name_flags(self, p: MaxPoolBwdProblem) -> str:
        return "_idx" if p.indices == "stored" else "_recompute"

    def _context_flags(self, p: MaxPoolBwdProblem) -> dict[str, Any]:
        return {"indices": p.indices}

    def min_bytes(self, p: MaxPoolBwdProblem) -> int:
        item = DTYPES[p.dtype]["itemsize"]
        if p.indices == "stored":
            return p.out_numel * (item + 8) + p.numel * item
        return p.out_numel * item + 2 * p.numel * item  # dy + x (re-read for the argmax) + dx

    def make_inputs(self, p: MaxPoolBwdProblem, rng: np.random.Generator) -> dict[str, np.ndarray]:
        x = tie_heavy(p, rng)
        dy = round_to(rng.standard_normal((p.N, p.C, p.OH, p.OW)), p.dtype)
        dy[dy == 0] = 0.5
        out = {"x": x, "dy": dy}
        if p.indices == "stored":
            out["indices"] = maxpool2d_reference(p, x)[1]
        return out

    def reference(self, p: MaxPoolBwdProblem, inputs: Mapping[str, np.ndarray], eps: float = 0.0) -> dict[str, np.ndarray]:
        idx = inputs["indices"] if p.indices == "stored" else maxpool2d_reference(p, inputs["x"])[1]
        return {"dx": maxpool2d_bwd_reference(p, inputs["dy"], idx)}

    def tolerance(self, dtype: str, output: str) -> Tolerance:
        return _MAXBWD_TOL[dtype]

    def pack_inputs(self, p: MaxPoolBwdProblem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {"dy": to_storage(self._plane_major(p, inputs["dy"]), p.dtype)}
        if p.indices == "stored":
            out["indices"] = self._plane_major(p, np.asarray(inputs["indices"], dtype=np.int64))
        else:
            out["x"] = to_storage(self._plane_major(p, inputs["x"]), p.dtype)
        return out


class AvgPool2dBwd(_PoolBwd):
    name: ClassVar[str] = "avgpool2d_bwd"
    template: ClassVar[str] = "avgpool2d_bwd.cu.j2"
    problem_cls: ClassVar[type] = AvgPoolProblem
    pool: ClassVar[str] = "avg"

    _extra_defaults = AvgPool2dFwd._extra_defaults
    _extra_cli = AvgPool2dFwd._extra_cli
    _name_flags = AvgPool2dFwd._name_flags
    _context_flags = AvgPool2dFwd._context_flags

    def min_bytes(self, p: AvgPoolProblem) -> int:
        return (p.out_numel + p.numel) * DTYPES[p.dtype]["itemsize"]

    def make_inputs(self, p: AvgPoolProblem, rng: np.random.Generator) -> dict[str, np.ndarray]:
        dy = smooth_random(p, rng, (p.N, p.C, p.OH, p.OW))
        return {"x": smooth_random(p, rng), "dy": dy}

    def reference(self, p: AvgPoolProblem, inputs: Mapping[str, np.ndarray], eps: float = 0.0) -> dict[str, np.ndarray]:
        return {"dx": avgpool2d_bwd_reference(p, inputs["dy"])}

    def tolerance(self, dtype: str, output: str) -> Tolerance:
        return _AVG_TOL[dtype]

    def pack_inputs(self, p: AvgPoolProblem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"dy": to_storage(self._plane_major(p, inputs["dy"]), p.dtype)}


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


__all__ = ["AvgPool2dBwd", "AvgPool2dFwd", "AvgPoolProblem", "MaxPool2dBwd", "MaxPool2dFwd", "MaxPoolBwdProblem",
           "MaxPoolFwdProblem", "PoolProblem", "avgpool2d_bwd_reference", "avgpool2d_divisor", "avgpool2d_reference",
           "maxpool2d_bwd_reference", "maxpool2d_reference", "pool_output_size", "tie_heavy", "smooth_random"]
