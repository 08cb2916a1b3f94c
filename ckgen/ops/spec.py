"""The OpSpec contract (and Problem) every op implements, plus the argument checks problems use.

The value types (Support, Config, Target, Launch, Tolerance, DTYPES, LAYOUTS) live in
ckgen.types, the bottom module; they are re-exported here for compatibility.

Nothing here imports CuPy: specs, spaces, rendering and the DB run on machines with no GPU.
"""
from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np

from ..space import load_space, load_space_file
from ..types import (DTYPES, INT32_MAX, LAYOUTS, Config, Launch, Support, Target, Tolerance,  # noqa: F401 - re-exported
                     short_repr)

__all__ = ["DTYPES", "INT32_MAX", "LAYOUTS", "Config", "Launch", "OpSpec", "OptionGroup", "Problem", "ProblemOption",
           "Support", "Target", "Tolerance", "check_choice", "check_flag", "check_int", "problem_of", "short_repr"]


def check_int(name: str, v: Any, lo: int = 1, hi: int = INT32_MAX) -> int:
    """`v` as a Python int in [lo, hi]; ValueError starting with `name` otherwise. NumPy integers
    are ints; bools, floats and strings are not."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name}: expected an int, got {short_repr(v)} ({type(v).__name__})")
    v = int(v)
    if v < lo:
        raise ValueError(f"{name}: must be {'a positive integer' if lo == 1 else f'>= {lo}'}, got {v}")
    if v > hi:
        raise ValueError(f"{name}: {v} exceeds {hi}" + (" (2^31-1: a 32-bit int in the kernel)" if hi == INT32_MAX else ""))
    return v


def check_flag(name: str, v: Any) -> bool:
    """A bool (Python or NumPy) or the int 0/1; ValueError starting with `name` otherwise."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)) and v in (0, 1):
        return bool(v)
    raise ValueError(f"{name}: expected a bool, got {short_repr(v)} ({type(v).__name__})")


def check_choice(name: str, v: Any, choices: Any, shown: str | None = None) -> str:
    """One of the strings `choices`; ValueError starting with `name` otherwise."""
    if not isinstance(v, str) or v not in choices:
        raise ValueError(f"{name}: {short_repr(v)} is not one of {shown or list(choices)}")
    return v


def problem_of(cls: type, kw: Mapping[str, Any], what: str, aliases: Mapping[str, str] | None = None,
               filled: Sequence[str] = ()) -> Any:
    """`cls(**kw)` for a problem dataclass, with a TypeError that names the first missing or
    unknown field and lists the fields (not Python's "__init__() missing 3 required positional
    arguments"). `what` names the problem kind; `aliases` maps other accepted keywords to the
    fields they stand for (pooling's kernel_size for kernel), shown in their place; `filled`:
    fields without a default that the caller fills when absent (listed as optional)."""
    fields = dataclasses.fields(cls)
    shown = {v: k for k, v in (aliases or {}).items()}
    required = [f.name for f in fields if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING and f.name not in filled]
    optional = [shown.get(f.name, f.name) for f in fields if f.name not in required]
    listed = ", ".join(shown.get(n, n) for n in required) + (f"; optional: {', '.join(optional)}" if optional else "")
    names = {f.name for f in fields}
    for k in kw:
        if k not in names:
            raise TypeError(f"{k}: not a field of a {what} problem (its fields: {listed})")
    for n in required:
        if n not in kw:
            raise TypeError(f"{shown.get(n, n)}: missing; a {what} problem needs {listed}")
    return cls(**kw)


@dataclasses.dataclass(frozen=True)
class ProblemOption:
    """One problem option of `ckgen tune` / `ckgen explain` (e.g. `--groups`), as an op family
    declares it (`OpSpec.problem_options`); an op takes those whose `dest` is in its `tune_options`.

    - flag: the option, e.g. "--kernel"; dest: its argparse dest (default: the flag's name, with
      `_` for `-`);
    - help: argparse's help text;
    - type: "ints" (comma-separated integers: K or KH,KW), "positive_int", or a callable argparse
      type; None: a string (or a flag, with `action`);
    - choices: the accepted strings; action: "store_true" (a flag, None when absent) or
      "bool" (`--x` / `--no-x`, None when absent);
    - fields: the problem fields, as the op's ValueErrors name them, this option sets (an error
      starting with one is reported against the option);
    - without_shape: whether the option is taken without --shape too (it narrows the default
      problems, as --activation does); by default it needs --shape."""

    flag: str
    help: str
    type: Any = None
    choices: tuple[str, ...] | None = None
    action: str | None = None
    fields: tuple[str, ...] = ()
    without_shape: bool = False
    dest: str = ""

    def __post_init__(self) -> None:
        if not self.dest:
            object.__setattr__(self, "dest", self.flag.lstrip("-").replace("-", "_"))


@dataclasses.dataclass(frozen=True)
class OptionGroup:
    """The problem options an op family adds to `ckgen tune` and `ckgen explain`: one argparse
    group (title, description), shared by the family's ops. Groups appear in the help in the
    order their first op was registered; the same group (by title) is added once."""

    title: str
    description: str
    options: tuple[ProblemOption, ...]


class Problem(abc.ABC):
    """A problem of one op: the DB key is `key()`; the op's `problem_from_key` inverts it."""

    dtype: str

    @abc.abstractmethod
    def key(self) -> str: ...


def full_shapes(spec: Any, shape: Any, width: int) -> list[tuple[int, ...]]:
    """The shapes one entry of a problem list stands for: `shape` itself (`width` numbers, N
    first), or, in a list with `batches`, one shape per batch (`shape` then omits N)."""
    batches = spec.get("batches")
    want = width - 1 if batches else width
    if not isinstance(shape, (list, tuple)) or len(shape) != want:
        raise ValueError(f"problem list shape {shape!r}: expected {want} numbers"
                         + (" (no N: the list's `batches` give it)" if batches else ""))
    return [tuple(shape)] if not batches else [(int(n), *shape) for n in batches]


def layered_validate(op: "OpSpec", problem: Any, config: Config, target: Target) -> Support:
    """`validate` as the space's check, then `class_check`, then `shape_check`, the first refusal
    answering: the order the cost model's candidate walk relies on (it asks each layer apart)."""
    in_space = op.space.check(config)
    if not in_space:
        return in_space
    of_class = op.class_check(problem, config, target)
    if not of_class:
        return of_class
    return op.shape_check(problem, config, target)


class OpSpec(abc.ABC):
    """One op, declared once. The CLI, DB, dispatcher, tuner and tests work from this alone.

    Contract:
      - `validate` never raises for a config of the op's space: it returns Support.no(reason).
      - `render_context` is all a template sees: dtype/layout/activation and the config, never
        the shape, so one compiled instance serves every shape its config is valid for.
      - `reference` is float64 NumPy; `make_inputs` draws fresh random (never zero) inputs.
    """

    name: ClassVar[str]
    template: ClassVar[str]

    @abc.abstractmethod
    def parse_problem(self, **kw: Any) -> Problem: ...

    @abc.abstractmethod
    def problem_from_key(self, key: str) -> Problem: ...

    #: the `ckgen tune` options (argparse dests) this op's problems take with --shape; the CLI
    #: refuses the others (e.g. --kernel on GroupNorm) before anything runs
    tune_options: ClassVar[tuple[str, ...]] = ()

    def problems_from_cli(self, args: Any) -> list[Problem]:
        """The problems `ckgen tune OP --shape ...` names (args: the CLI's argparse namespace,
        with dtype/layout lists that may be None). Raise ValueError naming the bad option."""
        raise ValueError(f"--shape: {self.name} takes no shape from the command line")

    def default_problems(self, dtypes: list[str] | None = None, layouts: list[str] | None = None,
                         activations: list[str] | None = None) -> list[Problem]:
        """The space's default problems (what `ckgen tune OP` tunes); lists given here replace the YAML's."""
        return self.problems_of(self.space.default_problems, dtypes, layouts, activations)

    @abc.abstractmethod
    def problems_of(self, spec: Any, dtypes: list[str] | None = None, layouts: list[str] | None = None,
                    activations: list[str] | None = None) -> list[Problem]:
        """The problems a problem list of the tuning space's YAML names (`default_problems`, or a
        grid of `grids`); lists given here replace the YAML's."""

    def grid_names(self) -> list[str]:
        """`ckgen tune --grid` names: `default` (the default problems), then the space's `grids`."""
        return ["default", *self.space.grids]

    def grid_about(self, name: str) -> str:
        """A grid's one-line description (its `about` in the YAML)."""
        if name == "default":
            return "the default problems (default_problems)"
        return str(self.space.grids.get(name, {}).get("about", ""))

    def grid_problems(self, name: str, dtypes: list[str] | None = None, layouts: list[str] | None = None,
                      activations: list[str] | None = None) -> list[Problem]:
        """The problems of grid `name` (`default`: the default problems), each once, in the YAML's
        order; lists given here replace the grid's dtypes, layouts, activations."""
        if name == "default":
            return self.default_problems(dtypes, layouts, activations)
        if name not in self.space.grids:
            raise ValueError(f"--grid: {self.name} has no grid {name!r}; its grids: {', '.join(self.grid_names())}")
        return list(dict.fromkeys(self.problems_of(self.space.grids[name], dtypes, layouts, activations)))

    @abc.abstractmethod
    def validate(self, problem: Any, config: Config, target: Target) -> Support: ...

    def problem_class(self, problem: Any) -> Any:
        """What of `problem` `class_check` reads (hashable), or None: no class check. The cost
        model's candidate walk remembers `class_check`'s answers per (op, problem class, target),
        so that a later problem of the class asks `validate` only about configs it admits."""
        return None

    def class_check(self, problem: Any, config: Config, target: Target) -> Support:
        """The part of `validate` that reads only `problem_class(problem)` of the problem (and the
        config and target); validate makes it first after the space's check, so a config it
        refuses is invalid for every problem of the class. By default: admits all."""
        return Support.yes()

    def shape_check(self, problem: Any, config: Config, target: Target) -> Support:
        """What `validate` checks after the space's check and `class_check`: validate is the three
        in that order, so for a config of the space that class_check admits, this is validate's
        answer (the candidate walk asks it alone there). By default validate itself."""
        return self.validate(problem, config, target)

    def class_check_many(self, problem: Any, knobs: Mapping[str, np.ndarray], target: Target) -> np.ndarray | None:
        """`bool(class_check)` of many configs at once, `knobs` holding each knob's values as an
        array (one entry per config), as a bool array; None where the op has no such form (the
        walk then asks `class_check` per config). Must agree with `class_check` everywhere
        (tests/test_pick_latency.py compares them over the product of each space)."""
        return None

    def spill_prone(self, problem: Any) -> bool:
        """True where `validate`'s register estimate is known to admit configs that spill: the
        dispatcher then compiles an untuned pick (offline, NVRTC) and takes the next candidate
        while it spills (`spill.spill_free`)."""
        return False

    @abc.abstractmethod
    def instance_name(self, problem: Any, config: Config) -> str: ...

    @abc.abstractmethod
    def render_context(self, problem: Any, config: Config, target: Target) -> dict[str, Any]: ...

    @abc.abstractmethod
    def launches(self, problem: Any, config: Config, target: Target) -> tuple[Launch, ...]:
        """The kernels of one call, in order (all take the same arguments)."""

    def main_blocks(self, problem: Any, config: Config, target: Target) -> int:
        """Blocks of the call's main launch (the one named as the instance, else its `_stats`
        kernel, else the first): the grid the cost model carries a winner's split with. Ops
        that know it without building their launches say so faster."""
        launches = self.launches(problem, config, target)
        name = self.instance_name(problem, config)
        by_name = {l.kernel: l for l in launches}
        main = by_name.get(name) or by_name.get(f"{name}_stats") or launches[0]
        return int(np.prod(main.grid))

    def workspace_bytes(self, problem: Any, config: Config) -> int:
        """Scratch memory the launches need (ptrs['ws']); none by default."""
        return 0

    def workspace_zeroed(self, problem: Any, config: Config) -> tuple[int, int]:
        """(byte offset, byte count) of the workspace that must hold zeros before the first call
        (counters the kernels leave at zero again); (0, 0): none. A workspace kept from call to
        call is zeroed once, when it is allocated; a fresh one every call."""
        return 0, 0

    @abc.abstractmethod
    def min_bytes(self, problem: Any) -> int: ...

    @abc.abstractmethod
    def make_inputs(self, problem: Any, rng: np.random.Generator) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def reference(self, problem: Any, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def tolerance(self, dtype: str, output: str) -> Tolerance: ...

    def problem_tolerance(self, problem: Any, output: str) -> Tolerance:
        """The tolerance verification uses; ops whose error grows with the shape override it."""
        return self.tolerance(problem.dtype, output)

    def seed_configs(self, problem: Any, target: Target, num_sms: int, count: int) -> list[Config]:
        """Configs a tuner should measure first (a warm start); by default none."""
        return []

    def seed_family(self, config: Config) -> Any:
        """The structural family of a config (knobs that switch the kernel's algorithm, between
        which times jump rather than vary smoothly), or None (one family). The tuner seeds at
        least the first of `seed_configs` of each family, so no family is left to the model."""
        return None

    def families_first(self, ranked: Sequence[Config], count: int) -> list[Config]:
        """The first `count` of `ranked` reordered: the best of each `seed_family` first, then the
        rest, each part in `ranked`'s order (diverse seeds for `seed_configs`)."""
        seen: set[Any] = set()
        heads: list[Config] = []
        for c in ranked:
            fam = self.seed_family(c)
            if fam not in seen:
                seen.add(fam)
                heads.append(c)
        chosen = set(heads)
        return (heads + [c for c in ranked if c not in chosen])[:count]

    # ---- device buffers, as flat host arrays in device memory order (used by verify/bench) ----
    @abc.abstractmethod
    def pack_inputs(self, problem: Any, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def output_buffers(self, problem: Any) -> dict[str, tuple[int, Any]]:
        """name -> (element count, NumPy dtype of the stored bits)."""

    @abc.abstractmethod
    def unpack_outputs(self, problem: Any, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    # ---- kernel arguments: every kernel of an op takes (pointers..., scalars... [, eps]) ----
    #: the kernels' pointer parameters, in order; a buffer a call does not have is passed as 0
    arg_names: ClassVar[tuple[str, ...]]
    #: whether a float32 eps follows the scalars (a run-time value, not part of the problem)
    takes_eps: ClassVar[bool] = False
    #: pointer parameters after eps (the fused inputs a newer kernel takes), 0 when a call has none;
    #: kernels that declare fewer parameters never read them, so older kernels keep their signature
    tail_arg_names: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def scalar_args(self, problem: Any) -> tuple:
        """The NumPy scalars (int32 shape values) after the pointers; fixed for a problem."""

    def kernel_args(self, problem: Any, ptrs: Mapping[str, int], eps: float = 0.0) -> tuple:
        """The argument tuple of every launch: `ptrs` maps arg_names to device pointers."""
        out = tuple(np.uint64(ptrs.get(n, 0)) for n in self.arg_names) + self.scalar_args(problem)
        out = out + (np.float32(eps),) if self.takes_eps else out
        return out + tuple(np.uint64(ptrs.get(n, 0)) for n in self.tail_arg_names)

    @abc.abstractmethod
    def distance(self, a: Any, b: Any) -> float:
        """How far apart two problems are, for the dispatcher's nearest-tuned fallback."""

    def related_distance(self, a: Any, b: Any) -> float:
        """How far apart two problems are for the cost model's measured correction (how much one's
        timings say about the other's): `distance`, unless an op says otherwise."""
        return self.distance(a, b)

    # ---- what the config cost model asks of an op (ckgen/model/features.py) ----
    # Each has a generic default, so an op that defines none still gets a cost-model pick: one
    # stream read, no re-reads, no split, no serial chain, registers no limit on occupancy.

    def model_family(self) -> str:
        """The ops whose recorded winners join this op's candidates (carried into its space):
        those of the same family. By default the op alone (its name)."""
        return self.name

    def model_streams(self, problem: Any) -> int:
        """Input streams a thread reads side by side (bytes in flight per unrolled vector): 1 by default."""
        return 1

    def model_unroll(self, problem: Any, config: Config) -> int:
        """Vectors (or positions) a thread has in flight: the `items` knob where the space has
        one, else the `th` x `tw` tile (1 without them)."""
        d = config.as_dict()
        items = d.get("items")
        return items if items is not None else d.get("th", 1) * d.get("tw", 1)

    def model_vec_bytes(self, problem: Any, config: Config) -> int:
        """Bytes of one vector access: the `vec_bytes` knob (one element without it)."""
        vb = config.as_dict().get("vec_bytes")
        return vb if vb is not None else DTYPES[problem.dtype]["itemsize"]

    def regs_used(self, problem: Any, config: Config) -> int:
        """Registers per thread the compiler is expected to allocate, for occupancy (the model
        takes at least 32). By default 32: registers do not limit the blocks per SM."""
        return 32

    def model_run_bytes(self, problem: Any, config: Config) -> int | None:
        """The contiguous run of bytes a block reads (a run not a whole number of 32-byte sectors
        wastes the rest of its sectors: the `sector` term); None: long runs (no term, the default)."""
        return None

    def model_reread_bytes(self, problem: Any, config: Config) -> float:
        """Bytes read again beyond `min_bytes` (the `reread` term); 0 by default."""
        return 0

    def model_split(self, problem: Any, config: Config) -> int:
        """Blocks that share one slice of the reduction (a cluster or a workspace merge: the
        `split` term); 1 by default."""
        return 1

    def model_slices_per_block(self, problem: Any, config: Config) -> int:
        """Independent slices (GroupNorm's groups) one block works on side by side where the
        layout interleaves them (the `gpb` term); 1 by default."""
        return 1

    def model_scatter(self, problem: Any, config: Config) -> bool:
        """The config writes by scatter: zeroing and atomic adds (the `scatter` term); False by default."""
        return False

    def chain_steps(self, problem: Any, config: Config, narrow_rows: bool = True) -> int:
        """The load round trips one block makes one after another (its critical path: the `chain`
        term); `narrow_rows` selects a kernel-version rule where an op has two. 0 by default (no term)."""
        return 0

    def geometry_columns(self, problem: Any, knobs: Mapping[str, np.ndarray], target: Target,
                         narrow_rows: bool = True) -> dict[str, Any] | None:
        """What the cost model asks per config, for many configs at once (`knobs`: each knob's
        values as an array), each entry an array or a scalar for all: launches, blocks and threads
        of the main launch, regs, ws (workspace bytes), steps (`chain_steps`), unroll, vec_bytes;
        optionally run, reread, split, slices, scatter (the hooks above; absent: their default).
        Equal to the scalar hooks exactly. None (the default): no such form, the model asks the
        hooks config by config."""
        return None

    def overrides(self, method: str) -> bool:
        """Whether the op's class overrides OpSpec's `method`: where `class_check_many` or
        `geometry_columns` is overridden the candidate walk checks a whole step of the space's
        lattice at once and the model predicts on arrays; a `model_*` hook left at its default
        is not asked per config (its default holds for every config)."""
        return getattr(type(self), method) is not getattr(OpSpec, method)

    # ---- plug-in hooks: files, records, CLI, benchmark, sanitizer ----
    #: the folder holding `template`; None: ckgen's templates/. A template there may include
    #: ckgen's own (`common/prelude.cuh.j2`, `common/vec_io.cuh.j2`): the op's folder is searched
    #: first, then ckgen's.
    template_dir: ClassVar[Path | str | None] = None
    #: the op's tuning space (YAML); None: ckgen's tuning_spaces/<name>.yaml
    space_path: ClassVar[Path | str | None] = None
    #: the `ckgen tune` / `ckgen explain` options of the op's family (its `tune_options` name which
    #: of them it takes); None: none beyond --shape, --grid, --dtype and --layout
    problem_options: ClassVar[OptionGroup | None] = None

    def space_file(self) -> str:
        """Where the op's tuning space is, for messages: `space_path`, else tuning_spaces/<name>.yaml."""
        return f"tuning_spaces/{self.name}.yaml" if self.space_path is None else str(self.space_path)

    @property
    def space(self) -> Any:
        """The op's tuning space, read once: `space_path`, else ckgen's tuning_spaces/<name>.yaml."""
        return load_space(self.name) if self.space_path is None else load_space_file(str(self.space_path))

    def problem_features(self, problem: Any) -> dict[str, Any]:
        """What decides the op's kernels, of the problem alone: stored with each tuning record
        (`records.make_record`) for the studies that read them. By default the element size, then
        layout, N, C and H*W where the problem has those fields, then `min_bytes`; ops add their own."""
        out: dict[str, Any] = {"dtype_bytes": DTYPES[problem.dtype]["itemsize"]}
        if all(hasattr(problem, k) for k in ("layout", "N", "C", "H", "W")):
            out.update(layout=problem.layout, N=problem.N, C=problem.C, HW=problem.H * problem.W)
        out["min_bytes"] = self.min_bytes(problem)
        return out

    def bench_callables(self, problem: Any, device: str = "cuda",
                        call: Callable[..., Any] | None = None) -> tuple[Callable[[], Any], Callable[[], Any], str]:
        """`ckgen bench`'s comparison for `problem`, on fresh torch inputs on `device`: (the ckgen
        call, PyTorch's eager equivalent, a label naming what eager runs). `call` is the op's
        public function where ckgen has one (`ckgen.runtime.api.functions`: the op specs sit
        below the runtime and do not import it), None for a plug-in, which calls its own. The
        ckgen call runs on a GPU only; the eager one anywhere. An op that overrides this is in
        `ckgen bench` (`bench_ready`); by default it is not."""
        raise NotImplementedError(f"{self.name}: no benchmark (OpSpec.bench_callables)")

    @property
    def bench_ready(self) -> bool:
        """Whether `ckgen bench` times the op: its class overrides `bench_callables`."""
        return type(self).bench_callables is not OpSpec.bench_callables

    def explain_fields(self, problem: Any) -> dict[str, Any]:
        """The keyword fields `ckgen.explain(name, arch=..., **fields)` rebuilds `problem` from
        (`ckgen bench` records the dispatcher's choice with them). By default the problem
        dataclass's init fields."""
        return {f.name: getattr(problem, f.name) for f in dataclasses.fields(problem) if f.init}

    def sanitize_problems(self) -> list[Any]:
        """Small problems covering the op's variants for tools/sanitize_ops.py (compute-sanitizer):
        by default, of the default problems, the smallest (by `min_bytes`) of each dtype and layout."""
        best: dict[tuple[Any, Any], Any] = {}
        for p in self.default_problems():
            k = (p.dtype, getattr(p, "layout", None))
            if k not in best or self.min_bytes(p) < self.min_bytes(best[k]):
                best[k] = p
        return list(best.values())
