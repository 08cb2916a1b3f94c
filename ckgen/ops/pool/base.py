"""What the four pooling OpSpecs share (`_PoolOp`): problems from the space and the CLI, layouts,
validation, launch geometry, naming, packing. The backward ops' common part is `bwd._PoolBwd`."""
from __future__ import annotations

import functools
import math
from typing import Any, ClassVar, Mapping

import numpy as np

from ...space import load_space
from ...types import DTYPES, INT32_MAX, Config, Launch, Support, Target
from ..numeric import to_storage
from ..spec import OpSpec, full_shapes, layered_validate, problem_of
from .hooks import PoolHooks
from .problem import PoolProblem, cover_extent, covering
from .vector import VectorChecks

_U32 = 2**32
_I32 = 2**31


def _regs_per_thread(config: Config) -> int:
    return min(255, 65536 // (config["threads"] * config["min_blocks"]))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_STORAGE_BITS = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}




@functools.lru_cache(maxsize=8192)
def _pool_problem_from_key(cls: type, key: str) -> Any:
    """`cls.from_key(key)`, remembered (the problems are frozen): a records file names a few
    hundred problems over tens of thousands of records, each key parsed again otherwise."""
    return cls.from_key(key)

class _PoolOp(VectorChecks, PoolHooks, OpSpec):
    """What the four pooling ops share: problems, layouts, packing, launch shape, naming."""

    name: ClassVar[str]
    template: ClassVar[str]
    problem_cls: ClassVar[type]
    pool: ClassVar[str]  # "max" | "avg"
    backward: ClassVar[bool]
    tune_options: ClassVar[tuple[str, ...]] = ("kernel", "stride", "padding", "ceil_mode")

    @property
    def space(self):
        return load_space(self.name)

    # ---- problems ----
    def parse_problem(self, **kw: Any) -> PoolProblem:
        kw = dict(kw)
        if "kernel_size" in kw:
            kw["kernel"] = kw.pop("kernel_size")
        if kw.get("stride") is None and "kernel" in kw:
            kw["stride"] = kw["kernel"]
        if "divisor_override" in kw and kw["divisor_override"] is None:
            kw["divisor_override"] = 0
        return problem_of(self.problem_cls, kw, self.name, {"kernel_size": "kernel"}, filled=("stride",))

    def problem_from_key(self, key: str) -> PoolProblem:
        return _pool_problem_from_key(self.problem_cls, key)

    def _extra_defaults(self, case: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def problems_of(self, dp: Any, dtypes: list[str] | None = None, layouts: list[str] | None = None,
                    activations: list[str] | None = None) -> list[PoolProblem]:
        """The YAML's cases (shape N, C, H, W; or C, H, W x `batches`) x dtypes x layouts
        (activations do not apply to pooling)."""
        out = []
        for case in dp["cases"]:
            for N, C, H, W in full_shapes(dp, case["shape"], 4):
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
                and p.layout == "nchw" and config.as_dict().get("algo") == "gather" and self.aligned_gather(p, config)):
            return False
        ob0 = self._cover_extent(p, config, 1)[0]
        pre = p.padding[1] - ob0 * p.stride[1]  # the tile's first column in the footprint
        return pre >= 0 and pre + self.tile(config)[1] <= self._x_footprint_dims(p, config)[1]

    def cover_counts(self, p: PoolProblem, config: Config) -> tuple[int, int]:
        """(NA, NB): the outputs along H and W that cover an aligned gather tile (the template's)."""
        return self._cover_extent(p, config, 0)[1], self._cover_extent(p, config, 1)[1]

    def _x_footprint_dims(self, p: PoolProblem, config: Config) -> tuple[int, int]:
        """(rows, columns) of x under the windows of an aligned gather tile's covering outputs
        (the template's XR x XC)."""
        na, nb = self.cover_counts(p, config)
        return (na - 1) * p.stride[0] + p.eff_kernel[0], (nb - 1) * p.stride[1] + p.eff_kernel[1]

    def aligned_gather(self, p: PoolProblem, config: Config) -> bool:
        """Backward gather with a tile that starts at multiples of the stride: which outputs cover
        which tile element is then known at compile time (the fast gather; the smem algo always)."""
        th, tw = self.tile(config)
        return self.backward and config.as_dict().get("algo") in ("gather", "smem") and \
            tw % p.stride[1] == 0 and th % p.stride[0] == 0

    def _cover_extent(self, p: PoolProblem, config: Config, axis: int) -> tuple[int, int]:
        """`_cover_span` of `_cover(p, config, axis)` without listing the covering outputs: per
        tile position O(1) (`covering_span`), not O(kernel size) (a tall window made every
        validate call walk it)."""
        return cover_extent(p.kernel[axis], p.stride[axis], p.padding[axis], p.dilation[axis],
                             self.tile(config)[axis])

    def _cover(self, p: PoolProblem, config: Config, axis: int) -> list[list[int]]:
        """Aligned gather, per tile position t along `axis` (0: H, 1: W): the outputs whose
        windows cover it, as offsets from tile_start / stride, ascending (PyTorch's order)."""
        k, s, pad, d = p.kernel[axis], p.stride[axis], p.padding[axis], p.dilation[axis]
        return [covering(k, s, pad, d, t) for t in range(self.tile(config)[axis])]

    def tile(self, config: Config) -> tuple[int, int]:
        """(rows, cols) of the positions one thread computes: outputs (forward) or inputs (gather)."""
        return config["th"], config["tw"]

    def _footprint_dims(self, p: PoolProblem, config: Config) -> tuple[int, int]:
        """(FR, FC): input rows and columns a thread's TH x TW output tile reads (forward)."""
        th, tw = self.tile(config)
        ek = p.eff_kernel
        return (th - 1) * p.stride[0] + ek[0], (tw - 1) * p.stride[1] + ek[1]

    def _footprint(self, p: PoolProblem, config: Config) -> int:
        fr, fc = self._footprint_dims(p, config)
        return fr * fc

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

    def model_family(self) -> str:
        """Max and average pooling of one direction share their winners as candidates."""
        return "pool2d_bwd" if self.backward else "pool2d_fwd"

    def main_blocks(self, p: Any, config: Config, target: Target) -> int:
        return self._blocks(p, config)  # the main launch's grid is (_blocks, 1, 1)

    def _blocks(self, p: PoolProblem, config: Config) -> int:
        """Blocks of the main kernel: threads / block (block_rows = 1), or planes x block rows x
        block columns (each block BR tile rows x threads / (C/VEC * BR) tile columns)."""
        br, t = config.as_dict().get("block_rows", 1), config["threads"]
        if br == 1:
            return _cdiv(self._work_items(p, config), t)
        planes, nrow, ncol, cvec = self._tiles(p, config)
        return planes * _cdiv(nrow, br) * _cdiv(ncol, t // (cvec * br))

    def _regs_needed(self, p: PoolProblem, config: Config) -> int:
        """Registers per thread the kernel needs not to spill (`validate` checks it against the
        launch bounds' budget). Forward ops: accumulators plus the loaded input (`_fwd_regs`)."""
        return self._fwd_regs(p, config, self._acc_words(p, config))

    def spill_prone(self, p: PoolProblem) -> bool:
        """The NHWC forward: `_fwd_regs` is a fitted bound, configs near it can still spill
        (docs/architecture.md, Pooling forward kernel: Registers)."""
        return not self.backward and p.layout == "nhwc"

    def _acc_words(self, p: PoolProblem, config: Config) -> int:
        """Forward: registers of a thread's accumulators (its TH x TW outputs)."""
        raise NotImplementedError

    def regs_used(self, p: PoolProblem, config: Config) -> int:
        """Registers per thread the compiler is expected to allocate, for occupancy (the cost
        model): what the code wants, up to the launch bounds' budget. The NHWC forward wants
        every footprint row's loads in flight (all unrolled): `_fwd_regs` with all FR rows and
        24 spare; over the 3,442 recorded NHWC forward instances, min(budget, that) is within
        0.79-1.40x of ptxas's count (5th-95th percentile, median 1.00). Elsewhere `_regs_needed`."""
        if self.backward or p.layout == "nchw":
            want = self._regs_needed(p, config)
        else:
            want = self._fwd_regs(p, config, self._acc_words(p, config), rows=None, spare=24)
        return min(_regs_per_thread(config), want)

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

    def _fwd_regs(self, p: PoolProblem, config: Config, acc: int, rows: int | None = 3, spare: int = 20) -> int:
        """Forward: registers per thread not to spill, for `acc` accumulator words plus the loaded
        input. NCHW holds one footprint row of elements. NHWC loads a footprint row's FC input
        vectors (vec_bytes / 4 words each) before its taps, and NVRTC keeps about `rows` = 3 rows
        of those loads in flight (the kernel is fully unrolled; None: all FR rows). Calibrated on
        3,442 recorded NHWC forward instances compiled for sm_90 at their own launch bounds
        (tests/data/pool-spill-sm90-nvrtc.jsonl.gz, tools/pool-spill-study.py): of the 439
        that spill, this admits 135 (the old "2 vectors" row admitted all 439), and it rejects
        no recorded winner."""
        fr, fc = self._footprint_dims(p, config)
        if p.layout == "nchw":
            return acc + fc + p.padding[1] + 24
        in_flight = fr if rows is None else min(fr, rows)
        return acc + in_flight * fc * max(1, config["vec_bytes"] // 4) + spare

    def problem_class(self, p: PoolProblem) -> tuple:
        """dtype, layout, the pooling parameters and options, and gcd(the vector axis' length, the
        lcm of the space's vec_bytes): W in NCHW, C in NHWC, which decides whether a vector of any
        width divides it (its elements divide its bytes)."""
        along = p.W if p.layout == "nchw" else p.C
        divisors = math.gcd(along, math.lcm(*self.space.params["vec_bytes"]))
        return p.dtype, p.layout, p.pool_key(), p.extra_key(), divisors

    def class_check(self, p: PoolProblem, config: Config, target: Target) -> Support:
        """What the class alone rules out (`OpSpec.class_check`): vectors, warps, the unrolled
        footprint, registers."""
        item = DTYPES[p.dtype]["itemsize"]
        vb, threads = config["vec_bytes"], config["threads"]
        if vb % item:
            return Support.no(f"vec_bytes={vb} is not a whole number of {p.dtype} elements")
        vec = vb // item
        if threads % target.warp_size:
            return Support.no(f"threads={threads} is not a multiple of the warp size {target.warp_size}")
        th, tw = self.tile(config)
        if p.layout == "nchw" and vec != 1:
            if self.backward and not (self.x_footprint(p, config) or config["algo"] == "smem"):
                return Support.no(f"vec_bytes={vb}: the NCHW backward reads single {p.dtype} elements "
                                  f"(vec_bytes={item}) except for indices=None with a stride-aligned gather "
                                  "(x rows as vectors); vectors run along C in NHWC")
            if self.backward and config["algo"] != "smem" and tw % vec:
                return Support.no(f"vec_bytes={vb}: a vector of {vec} elements does not divide tw={tw}")
            if p.W % vec:
                return Support.no(f"vec_bytes={vb}: a vector of {vec} elements along W does not divide W={p.W}")
            if not self.backward and (tw * p.stride[1]) % vec:
                return Support.no(f"vec_bytes={vb}: a thread's input span tw*stride={tw * p.stride[1]} is not "
                                  f"a whole number of {vec}-element vectors")
        if p.layout == "nhwc" and p.C % vec:
            return Support.no(f"vector of {vec} channels does not divide C={p.C}")
        if (th > 1 or tw > 1) and self._footprint(p, config) > 256:
            return Support.no(f"a {th}x{tw} tile reads {self._footprint(p, config)} window positions; "
                              "over 256 the unrolled code grows too large")
        regs = self._regs_needed(p, config)
        if regs > _regs_per_thread(config):
            return Support.no(f"about {regs} registers per thread exceed the budget of {_regs_per_thread(config)} "
                              f"at {threads} threads x {config['min_blocks']} blocks/SM")
        return Support.yes()

    def validate(self, p: PoolProblem, config: Config, target: Target) -> Support:
        return layered_validate(self, p, config, target)

    def shape_check(self, p: PoolProblem, config: Config, target: Target) -> Support:
        """validate's checks of the problem's sizes (`OpSpec.shape_check`)."""
        threads = config["threads"]
        th, tw = self.tile(config)
        rows, cols = (p.H, p.W) if self.backward else (p.OH, p.OW)
        if tw > 1 and tw > cols:
            return Support.no(f"tw={tw} positions per thread exceed the width {cols}")
        if th > 1 and th > rows:
            return Support.no(f"th={th} positions per thread exceed the height {rows}")
        reach = self._coord_reach(p, config)
        if reach > INT32_MAX:
            return Support.no(f"a {th}x{tw} tile's window coordinates reach {reach}, beyond 2^31-1 (int in the kernel)")
        items = self._work_items(p, config)
        if items >= _U32:
            return Support.no(f"{items} threads exceed the 32-bit thread index; use a larger tile or vector")
        br = config.as_dict().get("block_rows", 1)
        if br > 1 and config.as_dict().get("algo") != "smem":  # smem: block_rows scales a block's rows
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
    def pack_inputs(self, p: PoolProblem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The forward ops read x alone (the backward ops override this)."""
        return {"x": to_storage(self._plane_major(p, inputs["x"]), p.dtype)}

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

    def _shape_distance(self, a: PoolProblem, b: PoolProblem) -> float:
        d = abs(math.log(a.numel / b.numel)) + abs(math.log(a.H * a.W / (b.H * b.W)))
        d += abs(math.log(a.C / b.C)) + abs(math.log(a.N / b.N))
        return d + 4.0 * (a.layout != b.layout) + 2.0 * (a.dtype != b.dtype)

    def distance(self, a: PoolProblem, b: PoolProblem) -> float:
        # other pooling params: another kernel entirely, its winner a last resort
        return self._shape_distance(a, b) + (0.0 if a.same_pooling(b) else 100.0)

    def related_distance(self, a: PoolProblem, b: PoolProblem) -> float:
        # another window or stride: another kernel, but the same knobs mostly cost the same
        return self._shape_distance(a, b) + (0.0 if a.same_pooling(b) else 1.5)

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


def _cover_span(cover: list[list[int]]) -> tuple[int, int]:
    """(first offset, count) of the outputs a tile's cover lists name (at least one)."""
    offs = [o for lst in cover for o in lst]
    return (min(offs), max(offs) - min(offs) + 1) if offs else (0, 1)
