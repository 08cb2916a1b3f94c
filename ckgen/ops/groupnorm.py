"""GroupNorm ops, each declared once as an OpSpec."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from ..space import load_space
from ..types import (DTYPES, INT32_MAX, LAYOUTS, Config, Launch, Support, Target, Tolerance, coresident_sms,
                     short_repr)
from . import gn_vector
from .gn_limits import LEAN_MAX_CG, MAX_SERIAL_ADDS
from .numeric import from_storage, round_to, to_storage
from .spec import (OpSpec, OptionGroup, Problem, ProblemOption, check_choice, check_int, full_shapes, layered_validate,
                   problem_of)

#: the activation after the affine: swish is SiLU (x * sigmoid(x)); gelu the erf form, gelu_tanh
#: the tanh approximation (F.gelu(approximate="tanh"))
ACTIVATIONS = ("none", "swish", "relu", "gelu", "gelu_tanh")
#: what every config can run; the rest of the fusion menu (other activations, the residual, the
#: per-(n, c) bias) only slice_in=lean fuses
PLAIN_ACTIVATIONS = ("none", "swish")
#: the slice_in values that hold x in registers (read once)
HELD = ("regs", "lean")


def fusion_name(p: "GroupNormProblem") -> str:
    """What a problem fuses, for messages: 'activation=relu, residual, bias_nc'."""
    parts = [f"activation={p.activation}"] if p.activation != "none" else []
    return ", ".join(parts + [f for f in ("residual", "bias_nc") if getattr(p, f)]) or "no fusion"


def nhwc_tile(ch: int, vec: int, threads: int, split: int, hw: int, what: str,
              max_ch: int | None = None) -> tuple[Support, int, int]:
    """The NHWC block every GroupNorm kernel uses: R pixel rows x ch / vec vector columns of the
    `ch` channels it covers (`what` names them in the reasons), its share of the slice's `hw`
    pixels split over `split` blocks. Returns (verdict, R, pixels per block)."""
    if ch % vec:
        return Support.no(f"vector of {vec} does not divide {what}"), 0, 0
    if max_ch is not None and ch > max_ch:
        return Support.no(f"{what} exceed {max_ch} (shared-memory channel sums)"), 0, 0
    cols = ch // vec
    if cols > threads:
        return Support.no(f"{cols} vector columns ({what}) exceed threads={threads}"), 0, 0
    rows = threads // cols
    if rows * cols * 4 < threads * 3:
        return Support.no(f"{threads - rows * cols} of {threads} threads would idle ({cols} columns)"), 0, 0
    share = -(-hw // split)
    if split > 1 and share < rows:
        return Support.no(f"a split of {split} leaves each block fewer pixels ({share}) than rows ({rows})"), 0, 0
    return Support.yes(), rows, share


def whole_rows(config: Config) -> bool:
    """The forward's NHWC block covers whole pixel rows (every channel, every group of a sample):
    slice_in=rows (two kernels, or one with merge=grid) and slice_in=regs with merge=grid."""
    return config["slice_in"] == "rows" or config["merge"] == "grid"


def grid_barrier_fits(blocks: int, config: Config, target: Target) -> Support:
    """merge=grid: the blocks of a sample wait for each other, so every block of the grid must be
    resident at once. The launch is cooperative (the driver refuses a grid that does not fit, it
    never hangs); this check keeps such configs out of the tuner and the dispatcher: at most
    min_blocks blocks per SM (what __launch_bounds__ guarantees the registers for) on the
    fewest SMs a device of the arch has (`ckgen.types.coresident_sms`: the target's `sms`)."""
    if target.vendor != "cuda":
        return Support.no("merge=grid needs a cooperative launch (ckgen makes them on CUDA only)")
    fit = coresident_sms(target) * config["min_blocks"]
    if blocks > fit:
        return Support.no(f"merge=grid: {blocks} blocks cannot all be resident (at most {fit}: "
                          f"{coresident_sms(target)} SMs x min_blocks={config['min_blocks']})")
    return Support.yes()


@dataclass(frozen=True)
class GroupNormProblem(Problem):
    """Everything that picks a GroupNorm instance: the DB key. eps is a run-time argument."""

    N: int
    C: int
    H: int
    W: int
    G: int
    dtype: str
    layout: str
    activation: str = "none"
    residual: bool = False  # y = act(GN(x) * gamma + beta + r): r, x-shaped, added before the activation
    bias_nc: bool = False   # GN(x + b[n, c]): b, (N, C), added to x before the statistics

    def __post_init__(self) -> None:
        # N, C, G and H*W are int32 kernel arguments: each is bounded by 2^31-1.
        for f in ("N", "C", "H", "W", "G"):
            object.__setattr__(self, f, check_int(f, getattr(self, f)))
        if self.H * self.W > INT32_MAX:
            raise ValueError(f"H, W: H*W = {self.H * self.W} exceeds {INT32_MAX} (2^31-1: a 32-bit int in the kernel)")
        if self.C % self.G:
            raise ValueError(f"groups: C={self.C} is not divisible by groups={self.G}; pick G dividing C")
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("layout", self.layout, LAYOUTS)
        if self.activation is None:  # the public functions' spelling of "none" (their default)
            object.__setattr__(self, "activation", "none")
        check_choice("activation", self.activation, ACTIVATIONS,
                     "None, " + ", ".join(repr(a) for a in ACTIVATIONS[1:]))
        for f in ("residual", "bias_nc"):
            v = getattr(self, f)
            if not isinstance(v, (bool, np.bool_)) and v not in (0, 1):
                raise ValueError(f"{f}: expected a bool, got {v!r}")
            object.__setattr__(self, f, bool(v))

    @property
    def fused(self) -> bool:
        """Whether the problem asks for a fusion only slice_in=lean runs (an activation past
        swish, the residual, the per-(n, c) bias)."""
        return self.activation not in PLAIN_ACTIVATIONS or self.residual or self.bias_nc

    # Remembered per problem (not fields: eq, hash and the key stay the fields'): validate and
    # the cost model read them for every config of an unseen problem's pick.
    @functools.cached_property
    def HW(self) -> int:
        return self.H * self.W

    @functools.cached_property
    def Cg(self) -> int:
        return self.C // self.G

    @functools.cached_property
    def numel(self) -> int:
        return self.N * self.C * self.HW

    def key(self) -> str:
        return (f"N={self.N},C={self.C},H={self.H},W={self.W},G={self.G},"
                f"dtype={self.dtype},layout={self.layout},act={self.activation}"
                + (",res=1" if self.residual else "") + (",bias=1" if self.bias_nc else ""))

    @classmethod
    def from_key(cls, key: str) -> "GroupNormProblem":
        try:
            kv = dict(part.split("=", 1) for part in key.split(","))
            flags = {}
            for k, f in (("res", "residual"), ("bias", "bias_nc")):
                v = kv.get(k, "0")
                if v not in ("0", "1"):
                    raise ValueError(f"{k}={v!r} (expected 0 or 1)")
                flags[f] = v == "1"
            return cls(int(kv["N"]), int(kv["C"]), int(kv["H"]), int(kv["W"]), int(kv["G"]),
                       kv["dtype"], kv["layout"], kv.get("act", "none"), **flags)
        except (KeyError, ValueError) as e:
            raise ValueError(f"problem key {short_repr(key)} is malformed: {e}") from None


@functools.lru_cache(maxsize=8192)
def _gn_problem_from_key(key: str) -> GroupNormProblem:
    """`GroupNormProblem.from_key`, remembered (the problems are frozen): a records file names a
    few hundred problems over tens of thousands of records, and reading the shipped ones parsed
    each key again (about half of the 2-3 CPU-seconds every tuning process spends on them)."""
    return GroupNormProblem.from_key(key)


def gn_problem_class(op: OpSpec, p: GroupNormProblem) -> tuple[str, str, int, bool]:
    """A GroupNorm op's `problem_class`: dtype, layout, in NCHW gcd(H*W, the lcm of the space's
    vec_bytes), which decides whether H*W is a whole number of vectors of any width (a vector's
    elements divide its bytes; NHWC reads whole pixels: 0), and whether the problem asks for a
    fusion only slice_in=lean runs."""
    if p.layout != "nchw":
        return p.dtype, p.layout, 0, p.fused
    return p.dtype, p.layout, math.gcd(p.HW, math.lcm(*op.space.params["vec_bytes"])), p.fused


_NAMES: dict[tuple, str] = {}


def gn_instance_name(op: OpSpec, p: GroupNormProblem, config: Config, make: Any) -> str:
    """`make(p, config)` (a GroupNorm op's instance name: the dtype, layout, fusions and config
    alone), remembered: the cost model names every candidate of every unseen problem."""
    key = (op.name, p.dtype, p.layout, p.activation, p.residual, p.bias_nc, config)
    name = _NAMES.get(key)
    if name is None:
        if len(_NAMES) > 200_000:
            _NAMES.clear()
        name = _NAMES[key] = make(p, config)
    return name


def gn_run_bytes(p: "GroupNormProblem", tile: int, split: int) -> int:
    """The contiguous run of bytes a GroupNorm block reads (the cost model's `sector` term): a
    slice's share (NCHW), a tile of `tile` channels per pixel (NHWC), or, when the tile spans
    every channel, the block's pixels as one run."""
    item = DTYPES[p.dtype]["itemsize"]
    if p.layout == "nchw":
        return max(1, p.C // p.G * p.H * p.W // split) * item
    if tile < p.C:
        return tile * item
    return max(1, p.H * p.W // split) * p.C * item


def _regs_per_thread(config: Config) -> int:
    return min(255, 65536 // (config["threads"] * config["min_blocks"]))


def fwd_regs_needed(p: GroupNormProblem, config: Config) -> int:
    """The forward's registers per thread, estimated (validate's budget check and the cost model):
    regs holds x packed; rows two steps of ITEMS packed vectors (one in flight, one in use);
    reload the vectors in flight, unpacked; NHWC adds per-channel sums and shifts."""
    item = DTYPES[p.dtype]["itemsize"]
    vec = config["vec_bytes"] // item
    packed = config["items"] * vec * item // 4
    if config["slice_in"] == "lean":
        return int(gn_vector.lean_regs(p, packed, vec))
    regs = {"regs": packed, "rows": 2 * packed}.get(config["slice_in"], config["items"] * vec // 2) + 32
    return regs + (3 * vec if p.layout == "nhwc" else 0)

GN_OPTIONS = OptionGroup("GroupNorm problem", "for groupnorm_*", (
    ProblemOption("--groups", "G, dividing C (required with --shape; no default)", type="positive_int",
                  fields=("G", "groups")),
    ProblemOption("--activation", "none or swish (default: none with --shape, else the default problems' activations)",
                  choices=ACTIVATIONS, fields=("activation",), without_shape=True),
))


class GroupNormOp(OpSpec):
    """The problem side every GroupNorm op (forward and backward) shares: problem type, CLI and
    default problems, tuning space by op name, random x/gamma/beta, distance between problems."""

    tune_options: ClassVar[tuple[str, ...]] = ("groups", "activation")

    @property
    def space(self):
        return load_space(self.name)

    def parse_problem(self, **kw: Any) -> GroupNormProblem:
        return problem_of(GroupNormProblem, kw, "GroupNorm")

    def validate(self, p: GroupNormProblem, config: Config, target: Target) -> Support:
        return layered_validate(self, p, config, target)

    def problem_from_key(self, key: str) -> GroupNormProblem:
        return _gn_problem_from_key(key)

    def problems_of(self, dp: Any, dtypes: list[str] | None = None, layouts: list[str] | None = None,
                    activations: list[str] | None = None) -> list[GroupNormProblem]:
        """The YAML's shapes (N, C, H, W, G; or C, H, W, G x `batches`) x dtypes x layouts x activations."""
        return [GroupNormProblem(N, C, H, W, G, d, l, a) for shape in dp["shapes"]
                for N, C, H, W, G in full_shapes(dp, shape, 5)
                for d in dtypes or dp["dtypes"] for l in layouts or dp["layouts"]
                for a in activations or dp["activations"]]

    def problems_from_cli(self, args: Any) -> list[GroupNormProblem]:
        if len(args.shape) != 4:
            raise ValueError(f"--shape: takes N,C,H,W (4 numbers), got {len(args.shape)}")
        if args.groups is None:
            raise ValueError("--groups: required with --shape")
        n, c, h, w = args.shape
        return [self.parse_problem(N=n, C=c, H=h, W=w, G=args.groups, dtype=d, layout=l,
                                   activation=args.activation or "none")
                for d in (args.dtype or ["bf16"]) for l in (args.layout or ["nchw"])]

    def make_inputs(self, p: GroupNormProblem, rng: np.random.Generator,
                    offset: float = 0.0) -> dict[str, np.ndarray]:
        shape = (p.N, p.C, p.H, p.W)
        # Per-channel offsets and scales so groups differ; never zeros.
        chan_mu = rng.normal(0.0, 0.5, size=(1, p.C, 1, 1))
        chan_sd = rng.uniform(0.5, 2.0, size=(1, p.C, 1, 1))
        x = offset + chan_mu + chan_sd * rng.standard_normal(shape)
        out = {
            "x": round_to(x, p.dtype),
            "gamma": round_to(1.0 + 0.25 * rng.standard_normal(p.C), p.dtype),
            "beta": round_to(0.25 * rng.standard_normal(p.C), p.dtype),
        }
        # the fused inputs, drawn after the others (a plain problem's inputs stay as they were)
        if getattr(p, "residual", False):
            out["residual"] = round_to(rng.standard_normal(shape), p.dtype)
        if getattr(p, "bias_nc", False):
            out["bias"] = round_to(rng.normal(0.0, 1.0, size=(p.N, p.C)), p.dtype)
        return out

    def distance(self, a: GroupNormProblem, b: GroupNormProblem) -> float:
        d = abs(math.log(a.numel / b.numel)) + abs(math.log(a.Cg * a.HW / (b.Cg * b.HW)))
        d += abs(math.log(a.N * a.G / (b.N * b.G))) + abs(math.log(a.Cg / b.Cg))
        d += 4.0 * (a.layout != b.layout) + 2.0 * (a.dtype != b.dtype) + 0.5 * (a.activation != b.activation)
        return d + 0.5 * (a.residual != b.residual) + 0.5 * (a.bias_nc != b.bias_nc)

    # ---- plug-in hooks: CLI, records, benchmark, sanitizer ----
    problem_options: ClassVar[OptionGroup | None] = GN_OPTIONS
    #: tools/sanitize_ops.py's problem (N, C, H, W, G): ragged tails (odd H*W, C/G not a whole vector)
    sanitize_shape: ClassVar[tuple[int, int, int, int, int]] = (2, 48, 7, 9, 4)
    sanitize_dtypes: ClassVar[tuple[str, ...]] = ("fp32", "bf16")

    def problem_features(self, p: GroupNormProblem) -> dict[str, Any]:
        out = super().problem_features(p)
        out.update(G=p.G, Cg=p.C // p.G, slices=p.N * p.G, slice_elems=p.C // p.G * p.H * p.W)
        return out

    def explain_fields(self, p: GroupNormProblem) -> dict[str, Any]:
        f = {k: getattr(p, k) for k in ("N", "C", "H", "W", "dtype", "layout")}
        f.update(G=p.G, activation=p.activation)
        f.update({k: True for k in ("residual", "bias_nc") if getattr(p, k)})  # the fusions, where asked
        return f

    def sanitize_problems(self) -> list[GroupNormProblem]:
        """Each dtype x layout x activation on `sanitize_shape`."""
        N, C, H, W, G = self.sanitize_shape
        return [self.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=dt, layout=lay, activation=act)
                for dt in self.sanitize_dtypes for lay in ("nchw", "nhwc") for act in self.sanitize_activations]

    #: the activations sanitize_problems covers
    sanitize_activations: ClassVar[tuple[str, ...]] = ACTIVATIONS

    def _bench_inputs(self, p: GroupNormProblem, device: str) -> tuple[Any, Any, Any, Any]:
        """x (in p's layout), gamma, beta as torch tensors on `device`, and the torch memory format."""
        import torch

        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[p.dtype]
        fmt = torch.channels_last if p.layout == "nhwc" else torch.contiguous_format
        x = (torch.randn(p.N, p.C, p.H, p.W, device=device) + 0.25).to(dt).contiguous(memory_format=fmt)
        gamma = (1 + 0.1 * torch.randn(p.C, device=device)).to(dt)
        beta = (0.1 * torch.randn(p.C, device=device)).to(dt)
        return x, gamma, beta, fmt


class GroupNormFwd(GroupNormOp):
    name: ClassVar[str] = "groupnorm_fwd"
    template: ClassVar[str] = "groupnorm_fwd.cu.j2"

    def vec_elems(self, problem: GroupNormProblem, config: Config) -> int:
        return config["vec_bytes"] // DTYPES[problem.dtype]["itemsize"]

    def problem_class(self, p: GroupNormProblem) -> tuple[str, str, int]:
        return gn_problem_class(self, p)

    def class_check(self, p: GroupNormProblem, config: Config, target: Target) -> Support:
        """What the dtype, layout, H*W's vector divisors (NCHW) and target rule out
        (`OpSpec.class_check`)."""
        item = DTYPES[p.dtype]["itemsize"]
        vb, threads, items, cluster = config["vec_bytes"], config["threads"], config["items"], config["cluster"]
        if vb % item:
            return Support.no(f"vec_bytes={vb} is not a whole number of {p.dtype} elements")
        vec = vb // item
        if p.fused and config["slice_in"] != "lean":
            return Support.no(f"{fusion_name(p)}: only slice_in=lean fuses it")
        if threads % target.warp_size:
            return Support.no(f"threads={threads} is not a multiple of the warp size {target.warp_size}")
        if cluster > 1 and not target.clusters:
            return Support.no(f"cluster={cluster} needs thread-block clusters (sm_90+); {target.arch} has none")
        if config["slice_in"] != "lean" and fwd_regs_needed(p, config) > _regs_per_thread(config):
            return Support.no(f"{items}x{vec} values per thread exceed the register budget of "
                              f"{_regs_per_thread(config)} at {threads} threads x {config['min_blocks']} blocks/SM")
        if whole_rows(config) and p.layout != "nhwc":
            what = "merge=grid" if config["merge"] == "grid" else "slice_in=rows"
            return Support.no(f"{what} reads whole NHWC pixel rows; NCHW slices are contiguous")
        if not whole_rows(config) and p.layout == "nchw":
            if config["groups_per_block"] != 1:
                return Support.no("groups_per_block > 1 is for NHWC; NCHW slices are contiguous")
            if p.HW % vec:
                return Support.no(f"vector of {vec} does not divide H*W={p.HW}")
        return Support.yes()

    def class_check_many(self, p: GroupNormProblem, k: Mapping[str, np.ndarray], target: Target) -> np.ndarray:
        """`class_check` on arrays of knob values (`OpSpec.class_check_many`): the same tests."""
        item = DTYPES[p.dtype]["itemsize"]
        vb, threads, items, slice_in = k["vec_bytes"], k["threads"], k["items"], k["slice_in"]
        ok = (vb % item == 0) & (threads % target.warp_size == 0)
        if p.fused:
            ok &= slice_in == "lean"
        if not target.clusters:
            ok &= k["cluster"] <= 1
        vec = np.maximum(vb // item, 1)  # where vb < item, ok is already False
        packed = items * vec * item // 4  # fwd_regs_needed
        held = (slice_in == "regs") | (slice_in == "lean")
        regs = np.where(held, packed, np.where(slice_in == "rows", 2 * packed, items * vec // 2)) + 32
        regs += 3 * vec if p.layout == "nhwc" else 0
        ok &= (slice_in == "lean") | (regs <= np.minimum(255, 65536 // (threads * k["min_blocks"])))
        rows = (slice_in == "rows") | (k["merge"] == "grid")  # whole_rows
        if p.layout != "nhwc":
            ok &= ~rows
        if p.layout == "nchw":
            ok &= rows | ((k["groups_per_block"] == 1) & (p.HW % vec == 0))
        return ok

    def shape_check_many(self, p: GroupNormProblem, k: Mapping[str, np.ndarray], target: Target) -> np.ndarray | None:
        """`shape_check` on arrays of knob values `class_check` admits (ckgen/ops/gn_vector.py);
        None for a problem too large for int64 products."""
        return gn_vector.fwd_shape_check_many(p, k, target) if gn_vector.fits_int64(p) else None

    def geometry_columns(self, p: GroupNormProblem, k: Mapping[str, np.ndarray], target: Target,
                         narrow_rows: bool = True) -> dict[str, np.ndarray] | None:
        """The cost model's per-config integers on arrays of knob values (ckgen/ops/gn_vector.py)."""
        return gn_vector.fwd_geometry_columns(self, p, k, target, narrow_rows) if gn_vector.fits_int64(p) else None

    def shape_check(self, p: GroupNormProblem, config: Config, target: Target) -> Support:
        """validate's checks of the problem's sizes (`OpSpec.shape_check`)."""
        item = DTYPES[p.dtype]["itemsize"]
        vb, threads, items = config["vec_bytes"], config["threads"], config["items"]
        gpb, cluster = config["groups_per_block"], config["cluster"]
        split = cluster if config["merge"] == "cluster" else config["global_split"]
        vec = vb // item
        if p.Cg * p.HW // vec > INT32_MAX:
            return Support.no("one (n, g) slice has over 2^31 vectors; use a wider vector")
        if config["slice_in"] == "lean":  # lean's registers depend on C/G and the fusions
            if fwd_regs_needed(p, config) > _regs_per_thread(config):
                return Support.no(f"{items}x{vec} values per thread exceed the register budget of "
                                  f"{_regs_per_thread(config)} at {threads} threads x {config['min_blocks']} blocks/SM")
            if p.layout == "nchw" and p.Cg > LEAN_MAX_CG:
                return Support.no(f"slice_in=lean keeps a table of the slice's channels: C/G={p.Cg} exceeds {LEAN_MAX_CG}")
        if whole_rows(config):
            return self._validate_rows(p, config, vec, split, target)
        if p.layout == "nchw":  # class_check: H*W is a whole number of vectors
            nvec = p.Cg * p.HW // vec
            share = -(-nvec // split)
            if config["slice_in"] in HELD and share > threads * items:
                return Support.no(f"slice share of {share} vectors exceeds threads*items={threads * items}")
            serial = -(-share // threads) * vec  # values one thread adds into its accumulator (reload)
            if config["slice_in"] == "reload" and serial > MAX_SERIAL_ADDS:
                return Support.no(f"each thread would sum {serial} values serially in fp32 "
                                  f"(over {MAX_SERIAL_ADDS}: the mean loses accuracy); more threads or a split")
            if split > 1 and share < threads // 4:
                return Support.no(f"a split of {split} leaves each block {share} vectors for {threads} threads")
        else:
            if p.G % gpb:
                return Support.no(f"groups_per_block={gpb} does not divide G={p.G}")
            tile, rows, share = nhwc_tile(gpb * p.Cg, vec, threads, split, p.HW,
                                          f"the tile's {gpb * p.Cg} channels ({gpb} groups x {p.Cg})", 2048)
            if not tile:
                return tile
            if config["slice_in"] in HELD and share > rows * items:
                return Support.no(f"{share} pixels per block exceed rows*items={rows * items}")
            serial = -(-share // rows)  # pixel rows one thread adds into each channel's accumulator (reload)
            if config["slice_in"] == "reload" and serial > MAX_SERIAL_ADDS:
                return Support.no(f"each thread would sum {serial} pixels of a channel serially in fp32 "
                                  f"(over {MAX_SERIAL_ADDS}: the mean loses accuracy); more rows or a split")
        tiles = p.N * (p.G // gpb) * split
        if tiles > INT32_MAX:
            return Support.no("grid too large")
        return Support.yes()

    def _validate_rows(self, p: GroupNormProblem, config: Config, vec: int, split: int, target: Target) -> Support:
        """Blocks of whole NHWC pixel rows (all C channels), SPLIT blocks per sample: slice_in=rows,
        and slice_in=regs with merge=grid (each thread holds its rows of the share)."""
        threads = config["threads"]  # NHWC: class_check refused NCHW
        tile, rows, share = nhwc_tile(p.C, vec, threads, split, p.HW, f"the row's C={p.C} channels", 2048)
        if not tile:
            return tile
        serial = -(-share // rows)
        if config["slice_in"] == "regs" and serial > config["items"]:
            return Support.no(f"x held: {share} pixels per block exceed rows*items={rows * config['items']}")
        if serial > MAX_SERIAL_ADDS:
            return Support.no(f"each thread would sum {serial} pixels of a channel serially in fp32 "
                              f"(over {MAX_SERIAL_ADDS}: the mean loses accuracy); more rows or a split")
        if p.N * split > INT32_MAX:
            return Support.no("grid too large")
        if config["merge"] == "grid":
            return grid_barrier_fits(p.N * split, config, target)
        return Support.yes()

    def seed_configs(self, p: GroupNormProblem, target: Target, num_sms: int, count: int) -> list[Config]:
        """The valid configs a simple model likes best: wide vectors, x read once (regs), enough
        blocks to fill every SM, several blocks per SM, few registers."""
        def score(c: Config) -> float:
            blocks = self.launches(p, c, target)[-1].grid[0]
            per_sm = max(1, min(c["min_blocks"], 2048 // c["threads"]))
            fill = min(1.0, blocks / (num_sms * per_sm))
            waves = blocks / (num_sms * per_sm)
            tail = (math.ceil(waves) - waves) / math.ceil(waves) if waves > 1 else 0.0
            step = c["threads"] * c["items"] * c["vec_bytes"]  # bytes a block loads per step
            return (2.0 * c["vec_bytes"] / 16 + 2.0 * fill - tail + (16 << 10 <= step <= 128 << 10)
                    + 0.5 * (c["threads"] * c["min_blocks"] >= 1024))

        valid = sorted((c for c in self.space.enumerate() if self.validate(p, c, target)), key=score, reverse=True)
        return self.families_first(valid, count)  # diverse: the best of each family first

    def seed_family(self, config: Config) -> tuple[str, int, str]:
        """x held in registers, reloaded or in whole rows; the cluster size; the merge (cluster, global or grid)."""
        return (config["slice_in"], config["cluster"], config["merge"])

    def instance_name(self, p: GroupNormProblem, config: Config) -> str:
        return gn_instance_name(self, p, config, self._instance_name)

    def _instance_name(self, p: GroupNormProblem, config: Config) -> str:
        c = config
        act = "" if p.activation == "none" else f"_{p.activation}"
        act += ("_res" if p.residual else "") + ("_bias" if p.bias_nc else "")
        return (f"ckgen_groupnorm_fwd_{p.dtype}_{p.layout}{act}_t{c['threads']}_v{c['vec_bytes']}"
                f"_i{c['items']}_g{c['groups_per_block']}_c{c['cluster']}_{c['slice_in']}_m{c['min_blocks']}"
                + {"global": f"_gs{c['global_split']}", "grid": f"_gb{c['global_split']}"}.get(c["merge"], ""))

    def render_context(self, p: GroupNormProblem, config: Config, target: Target) -> dict[str, Any]:
        d = DTYPES[p.dtype]
        return dict(config.as_dict(), target=target, dtype=p.dtype, layout=p.layout,
                    activation=p.activation, residual=p.residual, bias_nc=p.bias_nc,
                    storage=d["storage"], itemsize=d["itemsize"], vec=self.vec_elems(p, config))

    # ---- the cost model's hooks (`OpSpec.model_*`) ----
    def regs_used(self, p: GroupNormProblem, config: Config) -> int:
        return fwd_regs_needed(p, config)

    def model_split(self, p: GroupNormProblem, config: Config) -> int:
        d = config.as_dict()
        return d["cluster"] if d["merge"] == "cluster" else d["global_split"]

    def model_run_bytes(self, p: GroupNormProblem, config: Config) -> int:
        d = config.as_dict()
        tile = p.C if whole_rows(config) else d["groups_per_block"] * p.C // p.G
        return gn_run_bytes(p, tile, self.model_split(p, config))

    def model_reread_bytes(self, p: GroupNormProblem, config: Config) -> int:
        """slice_in=reload and rows read x a second time."""
        if config["slice_in"] in ("reload", "rows"):
            return p.N * p.C * p.H * p.W * DTYPES[p.dtype]["itemsize"]
        return 0

    def model_slices_per_block(self, p: GroupNormProblem, config: Config) -> int:
        if p.layout != "nhwc":
            return 1
        return p.G if whole_rows(config) else config["groups_per_block"]

    def chain_steps(self, p: GroupNormProblem, config: Config, narrow_rows: bool = True) -> int:
        """A block whose x is held (slice_in=regs) loads it in one step; a streaming pass takes
        one step per ITEMS vectors a thread has in flight (NCHW: threads x ITEMS vectors of the
        share per step; NHWC: R pixel rows x ITEMS), and reload / rows stream twice (the sums,
        then y). Exact where every block's share is whole channels (tests/test_costmodel_chain.py)."""
        d = config.as_dict()
        item = DTYPES[p.dtype]["itemsize"]
        vec = max(1, d["vec_bytes"] // item)
        threads, items = d["threads"], d["items"]
        Cg, HW = p.C // p.G, p.H * p.W
        split = d["cluster"] if d["merge"] == "cluster" else d["global_split"]
        held = d["slice_in"] in HELD
        if p.layout == "nchw":
            per_step, share = threads * items, -(-(Cg * HW // vec) // split)
        else:
            ch = p.C if whole_rows(config) else d["groups_per_block"] * Cg
            _, rows, share = nhwc_tile(ch, vec, threads, split, HW, "")
            per_step = rows * items
        return 1 if held else 2 * -(-share // max(1, per_step))

    def main_blocks(self, p: Any, config: Config, target: Target) -> int:
        return self._blocks(p, config)  # the main launch's grid is (_blocks, 1, 1)

    def _blocks(self, p: GroupNormProblem, config: Config) -> int:
        split = config["cluster"] if config["merge"] == "cluster" else config["global_split"]
        if whole_rows(config):
            return p.N * split  # a block covers every group
        return p.N * (p.G // config["groups_per_block"]) * split

    def launches(self, p: GroupNormProblem, config: Config, target: Target) -> tuple[Launch, ...]:
        name = self.instance_name(p, config)
        grid, block = (self._blocks(p, config), 1, 1), (config["threads"], 1, 1)
        if config["merge"] == "global":
            return (Launch(f"{name}_stats", grid, block), Launch(name, grid, block))
        return (Launch(name, grid, block, cooperative=config["merge"] == "grid"),)

    def workspace_bytes(self, p: GroupNormProblem, config: Config) -> int:
        # merge=global: (count, mean, M2) per block and group; rows: (sum, sum of squares) of every
        # group; merge=grid: the rows partials, then one barrier counter per sample
        if config["merge"] == "cluster":
            return 0
        rows = whole_rows(config)
        partials = self._blocks(p, config) * (p.G if rows else config["groups_per_block"]) * (2 if rows else 3) * 4
        return partials + (4 * p.N if config["merge"] == "grid" else 0)

    def workspace_zeroed(self, p: GroupNormProblem, config: Config) -> tuple[int, int]:
        if config["merge"] != "grid":
            return 0, 0
        return self._blocks(p, config) * p.G * 2 * 4, 4 * p.N  # the barrier counters

    def min_bytes(self, p: GroupNormProblem) -> int:
        # read x once, write y once; the residual is read once more (the bias is negligible)
        return (3 if p.residual else 2) * p.numel * DTYPES[p.dtype]["itemsize"]

    def reference(self, p: GroupNormProblem, inputs: Mapping[str, np.ndarray],
                  eps: float = 1e-5) -> dict[str, np.ndarray]:
        return groupnorm_fwd_reference(inputs["x"], inputs.get("gamma"), inputs.get("beta"),
                                       p.G, eps, p.activation, inputs.get("residual"), inputs.get("bias"))

    def tolerance(self, dtype: str, output: str) -> Tolerance:
        if output == "y":
            return {"fp32": Tolerance(1e-4, 1e-4), "fp16": Tolerance(4e-3, 4e-3),
                    "bf16": Tolerance(3e-2, 1.6e-2)}[dtype]
        if output == "mean":
            return Tolerance(1e-4, 1e-5)
        return Tolerance(0.0, 2e-3)  # rstd

    def pack_inputs(self, p: GroupNormProblem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"] if p.layout == "nchw" else np.transpose(inputs["x"], (0, 2, 3, 1))
        packed = {"x": to_storage(np.ascontiguousarray(x), p.dtype).ravel()}
        if inputs.get("residual") is not None:
            r = inputs["residual"] if p.layout == "nchw" else np.transpose(inputs["residual"], (0, 2, 3, 1))
            packed["res"] = to_storage(np.ascontiguousarray(r), p.dtype).ravel()
        if inputs.get("bias") is not None:
            packed["bias"] = to_storage(np.ascontiguousarray(inputs["bias"]), p.dtype).ravel()
        for k in ("gamma", "beta"):
            if inputs.get(k) is not None:
                packed[k] = to_storage(inputs[k], p.dtype)
        return packed

    def output_buffers(self, p: GroupNormProblem) -> dict[str, tuple[int, Any]]:
        bits = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}[p.dtype]
        return {"y": (p.numel, bits), "mean": (p.N * p.G, np.float32), "rstd": (p.N * p.G, np.float32)}

    def unpack_outputs(self, p: GroupNormProblem, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        y = from_storage(raw["y"], p.dtype)
        y = y.reshape(p.N, p.C, p.H, p.W) if p.layout == "nchw" else \
            y.reshape(p.N, p.H, p.W, p.C).transpose(0, 3, 1, 2)
        return {"y": y, "mean": raw["mean"].astype(np.float64).reshape(p.N, p.G),
                "rstd": raw["rstd"].astype(np.float64).reshape(p.N, p.G)}

    arg_names: ClassVar[tuple[str, ...]] = ("x", "gamma", "beta", "y", "mean", "rstd", "ws")
    takes_eps: ClassVar[bool] = True
    tail_arg_names: ClassVar[tuple[str, ...]] = ("res", "bias")  # the fused inputs (slice_in=lean)

    def scalar_args(self, p: GroupNormProblem) -> tuple:
        return np.int32(p.C), np.int32(p.HW), np.int32(p.G)

    # ---- plug-in hooks: benchmark, sanitizer ----
    sanitize_dtypes: ClassVar[tuple[str, ...]] = ("fp32", "bf16", "fp16")

    def bench_callables(self, p: GroupNormProblem, device: str = "cuda", call: Any = None) -> tuple[Any, Any, str]:
        """ckgen.groupnorm_fwd against F.group_norm (+ F.silu for swish)."""
        import torch.nn.functional as F


        x, gamma, beta, _ = self._bench_inputs(p, device)
        G, swish = p.G, p.activation == "swish"
        act = "swish" if swish else None

        def eager():
            y = F.group_norm(x, G, gamma, beta, 1e-5)
            return F.silu(y) if swish else y

        return (lambda: call(x, gamma, beta, G, activation=act)), eager, \
            "F.group_norm" + (" + F.silu" if swish else "")



def _erf(x: np.ndarray) -> np.ndarray:
    """erf in float64 to ~1e-7 (Abramowitz & Stegun 7.1.26), vectorized: far below the kernels'
    fp32 tolerance, and numpy has no erf of its own."""
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return s * (1.0 - poly * np.exp(-a * a))


def activation_reference(y: np.ndarray, activation: str) -> np.ndarray:
    """float64 activation of the fusion menu (`ACTIVATIONS`)."""
    if activation == "swish":
        return y / (1.0 + np.exp(-y))
    if activation == "relu":
        return np.where(y < 0, 0.0, y)
    if activation == "gelu":
        return 0.5 * y * (1.0 + _erf(y / np.sqrt(2.0)))
    if activation == "gelu_tanh":
        return 0.5 * y * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (y + 0.044715 * y ** 3)))
    return y


def groupnorm_fwd_reference(x: np.ndarray, gamma: np.ndarray | None, beta: np.ndarray | None,
                            groups: int, eps: float = 1e-5, activation: str = "none",
                            residual: np.ndarray | None = None,
                            bias: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """float64 act(GroupNorm(x + bias[n, c]) + residual): y, mean (N, G), rstd (N, G) of
    x + bias. Population variance."""
    x = np.asarray(x, dtype=np.float64)
    N, C, H, W = x.shape
    if bias is not None:
        x = x + np.asarray(bias, dtype=np.float64).reshape(N, C, 1, 1)
    xg = x.reshape(N, groups, -1)
    mean = xg.mean(axis=2)
    var = ((xg - mean[..., None]) ** 2).mean(axis=2)
    rstd = 1.0 / np.sqrt(var + eps)
    y = ((xg - mean[..., None]) * rstd[..., None]).reshape(N, C, H, W)
    if gamma is not None:
        y = y * np.asarray(gamma, dtype=np.float64).reshape(1, C, 1, 1)
    if beta is not None:
        y = y + np.asarray(beta, dtype=np.float64).reshape(1, C, 1, 1)
    if residual is not None:
        y = y + np.asarray(residual, dtype=np.float64)
    return {"y": activation_reference(y, activation), "mean": mean, "rstd": rstd}


def groupnorm_bwd_reference(dy: np.ndarray, x: np.ndarray, mean: np.ndarray, rstd: np.ndarray,
                            gamma: np.ndarray | None, groups: int, beta: np.ndarray | None = None,
                            activation: str = "none") -> dict[str, np.ndarray]:
    """float64 gradients of groupnorm_fwd_reference w.r.t. x, gamma, beta, given the upstream
    gradient dy and the forward's mean/rstd (N, G). With activation='swish', dy is the gradient
    of swish(y) and the pre-activation y is recomputed from x, mean, rstd, gamma, beta."""
    x = np.asarray(x, dtype=np.float64)
    dy = np.asarray(dy, dtype=np.float64)
    N, C, H, W = x.shape
    g = np.ones(C) if gamma is None else np.asarray(gamma, dtype=np.float64)
    b = np.zeros(C) if beta is None else np.asarray(beta, dtype=np.float64)
    m = np.asarray(mean, dtype=np.float64).reshape(N, groups, 1)
    r = np.asarray(rstd, dtype=np.float64).reshape(N, groups, 1)
    xhat = ((x.reshape(N, groups, -1) - m) * r).reshape(N, C, H, W)
    if activation == "swish":
        y = xhat * g.reshape(1, C, 1, 1) + b.reshape(1, C, 1, 1)
        s = 1.0 / (1.0 + np.exp(-y))
        dy = dy * s * (1.0 + y * (1.0 - s))  # d/dy [y * sigmoid(y)]
    dbeta = dy.sum(axis=(0, 2, 3))
    dgamma = (dy * xhat).sum(axis=(0, 2, 3))
    dxhat = (dy * g.reshape(1, C, 1, 1)).reshape(N, groups, -1)
    xh = xhat.reshape(N, groups, -1)
    dx = r * (dxhat - dxhat.mean(axis=2, keepdims=True) - xh * (dxhat * xh).mean(axis=2, keepdims=True))
    return {"dx": dx.reshape(N, C, H, W), "dgamma": dgamma, "dbeta": dbeta}
