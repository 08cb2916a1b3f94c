"""Selection and launch: a problem -> DB winner or fallback -> compiled kernels -> a launch plan.

Selection never tunes unless asked. On a DB miss it asks the config cost model (ckgen/model/)
for the best of the configs that won anywhere and their neighbours; without a model, it falls
back to the nearest tuned problem whose config is valid here, else to the space's default (or
the valid config nearest to it), and says so once per problem through the `ckgen` logger.
Asked (`CKGEN_TUNE=1`, a `ckgen.tuning()` block), a plan's selection tunes the problem first
(ckgen/tuner/online.py), once per problem and process, and selects the new DB entry.

Launch goes through a `Plan`, built once per (op, problem, device, pointer alignment class,
framework): the choice, the loaded kernels, their grids, the kernel-argument buffer with the
problem's scalars already in it, the output allocators and the workspace size. A call of a
known signature then does only: allocate outputs -> write the pointers into the argument
buffer -> cuLaunchKernel per kernel, on torch's current stream for torch inputs (CuPy's for
CuPy arrays). Workspaces come from the caller's allocator (torch's caching allocator, CuPy's
pool), so calls can be captured in CUDA graphs. The public op modules (`ckgen.runtime.api.*`) map a
call's arguments to a plan: `api.callkeys` caches signature -> plan."""
from __future__ import annotations

import contextlib
import logging
import re
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from .. import settings
from ..codegen import KernelSource
from ..instance import render_instance
from ..ops.spec import Config, OpSpec, Problem, Target
from ..types import printable
from . import db as dbmod

log = logging.getLogger("ckgen")


class NoConfigError(ValueError):
    """No config of an op's tuning space can run a problem (on this target, at this alignment)."""


@dataclass(frozen=True)
class Choice:
    op: str
    problem: str
    instance: str
    config: Config
    source: str  # "tuned" | "model" | "nearest" | "default"
    reason: str
    entry: Any = None  # the db.Entry it came from, if any

    def __str__(self) -> str:
        # the reason may quote DB text from other machines (a device name): shown, not obeyed
        return printable(f"{self.op} {self.problem} -> {self.instance} [{self.source}] {self.reason}")


class Dispatcher:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._db: dbmod.InstanceDB | None = None
        self._choices: dict[tuple[str, str, str, int], tuple[Choice, KernelSource]] = {}
        self._told: set[tuple[str, str]] = set()
        #: set while `explain` asks: the caller gets the choice back, so it is not logged too
        self._asked = threading.local()
        self.plans: dict[tuple, Plan] = {}
        #: call signature -> plan (filled by the public op modules); cleared with the plans
        self.calls: dict[tuple, Plan] = {}
        self._forget: list[Callable[[], None]] = []
        #: (op, problem key, arch) of plans' choices that are not tuned and that online tuning
        #: has not tried: what opening a `ckgen.tuning()` block drops (see drop_untuned)
        self._untuned: set[tuple[str, str, str]] = set()

    # ---- the DB view: user DB over shipped DB, stale entries dropped per entry ----
    def database(self) -> dbmod.InstanceDB:
        with self._lock:
            if self._db is None:
                self._db = dbmod.load_layered(settings.user_db_path())
            return self._db

    def reload(self) -> None:
        """Forget the loaded DBs, the choices and every launch plan (the next call re-selects)."""
        with self._lock:
            self._db = None
            self._choices.clear()
            self._told.clear()
            self._untuned.clear()
            self.plans.clear()
            self.calls.clear()

    def drop_untuned(self) -> None:
        """Forget the choices and launch plans of untuned problems that online tuning has not
        tried (a `ckgen.tuning()` block opened: their next call builds its plan again, and tunes)."""
        with self._lock:
            keys, self._untuned = self._untuned, set()
        keys = {k for k in keys if not _hook.attempted(*k)}
        if not keys:
            return
        for k in self._choices.copy():
            if k[:3] in keys:
                self._choices.pop(k, None)
        problems = {k[:2] for k in keys}
        for cache in (self.calls, self.plans):
            for k, plan in cache.copy().items():
                if plan.choice.source != "tuned" and (plan.choice.op, plan.choice.problem) in problems:
                    cache.pop(k, None)

    # ---- selection ----
    def choose(self, op: OpSpec, problem: Problem, target: Target, max_vec_bytes: int = 16,
               site: Any = None) -> tuple[Choice, KernelSource]:
        """The choice for `problem` (cached). `site` (a `Site`: given by plan building only) lets
        an untuned choice be tuned first by the untuned hook (`set_untuned_hook`: online tuning)."""
        key = (op.name, problem.key(), target.arch, max_vec_bytes)
        hit = self._choices.get(key)
        new = hit is None
        if new:
            hit = self.select(op, problem, target, max_vec_bytes)
        if site is not None and hit[0].source != "tuned":
            if _hook.on_untuned(op, problem, target, site):  # a winner is in the DB now (reloaded)
                hit, new = self.select(op, problem, target, max_vec_bytes), True
            if hit[0].source != "tuned" and not _hook.attempted(*key[:3]):
                with self._lock:
                    self._untuned.add(key[:3])
        if new:
            self._choices[key] = hit
            choice = hit[0]
            if choice.source != "tuned" and (op.name, problem.key()) not in self._told:
                self._told.add((op.name, problem.key()))
                if not settings.quiet() and not getattr(self._asked, "on", False):
                    log.warning("ckgen: %s", choice)
        return hit

    @contextlib.contextmanager
    def asked(self) -> Iterator[None]:
        """Choices made inside are returned to a caller that asked for them (`explain`), so the
        once-per-problem notice is not logged as well: it counts as told, and a later call of the
        same problem stays quiet too."""
        self._asked.on = True
        try:
            yield
        finally:
            self._asked.on = False

    def _usable(self, op: OpSpec, problem: Problem, config: Config, target: Target, max_vec: int) -> str | None:
        why = self._aligned(config, max_vec)
        if why is not None:
            return why
        ok = op.validate(problem, config, target)
        return None if ok else ok.reason

    @staticmethod
    def _aligned(config: Config, max_vec: int) -> str | None:
        try:
            vb = config["vec_bytes"]
        except KeyError:  # a space without vectors
            vb = 0
        return f"vec_bytes={vb} exceeds the pointers' {max_vec}-byte alignment" if vb > max_vec else None

    def _why_none(self, op: OpSpec, problem: Problem, target: Target, max_vec: int, top: int = 3) -> str:
        """Why no config of the space runs `problem`: its `top` most common reasons. Reasons that
        differ in their numbers alone count as one, shown by their first instance ("like it")."""
        groups: dict[str, list] = {}
        for c in op.space.enumerate():
            why = self._usable(op, problem, c, target, max_vec)
            if why is not None:
                g = groups.setdefault(re.sub(r"\d+", "#", why), [0, why, False])
                g[0] += 1
                g[2] = g[2] or why != g[1]
        ranked = sorted(groups.values(), key=lambda g: -g[0])[:top]
        total = sum(g[0] for g in groups.values())
        return (f"the most common reasons, over its {total} configs: "
                + "; ".join(f"{why} ({n} configs{' like it' if alike else ''})" for n, why, alike in ranked))

    def select(self, op: OpSpec, problem: Problem, target: Target, max_vec: int) -> tuple[Choice, KernelSource]:
        """The choice for `problem` as the DB and the cost model give it, uncached: no untuned-choice
        message, no online tuning (`choose` adds those; the tuner asks this for its incumbent)."""
        db = self.database()
        entry = db.lookup(op.name, target.arch, problem.key())
        stale = ""
        if entry is not None:
            config = Config.of(entry.config_dict())
            why = self._usable(op, problem, config, target, max_vec)
            if why is None:
                src = render_instance(op, problem, config, target)
                if src.sha256 == entry.source_sha256:
                    how = ", tuned online" if entry.provenance_dict().get("tuned_by") == "online" else ""
                    return Choice(op.name, problem.key(), src.name, config, "tuned",
                                  f"DB entry ({entry.time_us:.1f} us on {entry.device}{how})", entry), src
                stale = "tuned entry is stale (template changed since tuning); "
            else:
                stale = f"tuned entry unusable ({why}); "
        from .. import model  # the cost model's pick among every config that won and its neighbours
        from .spill import spill_free  # NHWC pooling forward: passes over picks whose cubins spill

        accept = spill_free(op, problem, target)

        def admitted(c: Config) -> bool:  # _usable for a config of the space that op.class_check admits
            return self._aligned(c, max_vec) is None and bool(op.shape_check(problem, c, target))

        shape_many = getattr(op, "shape_check_many", None)
        if shape_many is not None:  # the same on knob arrays (GroupNorm): the walk asks whole chunks
            def many(k: Any) -> Any:
                ok = shape_many(problem, k, target)
                return None if ok is None or "vec_bytes" not in k else ok & (k["vec_bytes"] <= max_vec)

            admitted.many = many  # type: ignore[attr-defined]

        picked = model.dispatch_pick(op, problem, target, db.select(op.name),
                                         lambda c: self._usable(op, problem, c, target, max_vec) is None, accept,
                                         admitted)
        if picked is not None:
            config, pred, n, sibling = picked
            src = render_instance(op, problem, config, target)
            why = (f"the cost model predicts {pred}, best of {n} candidates" if sibling is None else
                   f"keeping the winner of the tuned sibling {sibling} (the cost model predicts {pred}; "
                   f"none of its {n} candidates is predicted {100 * model.NEAREST_MARGIN:.0f}% faster)")
            if accept is not None and accept.rejected:
                why += f"; passed over {len(accept.rejected)} that spill registers (a stack frame in their cubins)"
            return Choice(op.name, problem.key(), src.name, config, "model", f"{stale}not tuned; {why}"), src
        near = sorted((e for e in db.select(op.name, target.arch) if e.problem != problem.key()),
                      key=lambda e: op.distance(problem, op.problem_from_key(e.problem)))
        for e in near:
            config = Config.of(e.config_dict())
            if self._usable(op, problem, config, target, max_vec) is None:
                src = render_instance(op, problem, config, target)
                return Choice(op.name, problem.key(), src.name, config, "nearest",
                              f"{stale}not tuned; using the winner of the nearest tuned problem {e.problem}", e), src
        config = op.space.default  # nearest_default's first answer, without ordering the whole space
        if self._usable(op, problem, config, target, max_vec) is not None:
            config = op.space.nearest_default(lambda c: self._usable(op, problem, c, target, max_vec) is None)
        if config is None:
            raise NoConfigError(f"{op.name}: no config of the tuning space can run {problem.key()}; "
                             + self._why_none(op, problem, target, max_vec))
        src = render_instance(op, problem, config, target)
        what = "the default config" if config == op.space.default else "the valid config nearest the default"
        return Choice(op.name, problem.key(), src.name, config, "default",
                      f"{stale}not tuned and no tuned neighbour fits; using {what} "
                      f"(run `ckgen tune {op.name}` for this shape)"), src


_dispatcher = Dispatcher()
dbmod.on_change(_dispatcher.reload)  # `ckgen tune` writing the DB in this process: re-select


def dispatcher() -> Dispatcher:
    return _dispatcher


# ---------------------------------------------------------------------------------------------
# The untuned hook: what a plan's untuned choice may do first (online tuning, ckgen/tuner/online.py,
# registers itself when imported). The runtime never imports the tuner.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Site:
    """Where a plan is being built: its device (current while the plan is built) and whether the
    caller's current stream is capturing a CUDA graph."""

    device: int
    capturing: Callable[[], bool]


@dataclass(frozen=True)
class UntunedHook:
    #: on_untuned(op, problem, target, site) -> True when the DB now has a winner (select again)
    on_untuned: Callable[[OpSpec, Problem, Target, Site], bool]
    #: attempted(op name, problem key, arch) -> True when the hook will not try that problem again
    attempted: Callable[[str, str, str], bool]


_NO_HOOK = UntunedHook(lambda op, problem, target, site: False, lambda op, problem, arch: False)
_hook = _NO_HOOK


def set_untuned_hook(on_untuned: Callable[[OpSpec, Problem, Target, Site], bool] | None,
                     attempted: Callable[[str, str, str], bool] | None = None) -> None:
    """Register what `Dispatcher.choose` calls while it builds a plan whose choice is not a tuned
    DB entry (`on_untuned`; True: the DB has a winner now, select again), and what says whether a
    problem was tried already (`attempted`: `drop_untuned` keeps those plans). None: no hook."""
    global _hook
    _hook = _NO_HOOK if on_untuned is None else \
        UntunedHook(on_untuned, attempted or (lambda op, problem, arch: False))


def untuned_hook() -> UntunedHook:
    """The hook in effect (`set_untuned_hook`)."""
    return _hook


# ---------------------------------------------------------------------------------------------
# Launch plans
# ---------------------------------------------------------------------------------------------
_LAUNCH_LOCK = threading.Lock()  # one argument buffer per plan: fill and launch under the lock
_SLOT = 8  # bytes per kernel argument slot (pointers; int32/float32 use the low 4 bytes)
_graph_keep: list[Any] = []  # CuPy workspaces of captured launches: the graph replays into them
#: a workspace up to this size is kept per (plan, stream) and reused by the next call on that
#: stream (calls on one stream run in order), except under stream capture
_KEEP_WS_BYTES = 4 << 20
_multi_gpu: bool | None = None  # more than one visible device: check the current one per call
_rt: Any = None  # cupy.cuda.runtime and driver.launchKernel, bound when the first plan is built
_launch_kernel: Any = None
_launch_cooperative: Any = None  # driver.launchCooperativeKernel (Launch.cooperative: a grid barrier)


@dataclass(frozen=True)
class Output:
    """An output buffer a plan allocates per call: logical shape, memory layout, dtype."""

    name: str
    shape: tuple[int, ...]
    layout: str  # "nchw" | "nhwc" | "flat"
    dtype: str  # "fp32" | "fp16" | "bf16" | "int64"


class Plan:
    """One problem's launch on one device, computed once (see the module doc). `run(ins, eps,
    like)` is a launcher generated for this plan (as Triton generates one per kernel): `ins`
    are the input pointers in the order the op's public function gave them to `plan_for`,
    `like` the caller's x (outputs shaped like it are allocated with torch.empty_like)."""

    __slots__ = ("choice", "device", "launches", "run", "_kernels", "_keep")

    def __init__(self, op: OpSpec, problem: Problem, like: Any, inputs: Sequence[str], outputs: Sequence[Output],
                 vector_ptrs: Sequence[int]) -> None:
        from .compile import load_kernel
        from .target import device_info
        from .tensors import alignment, current_stream_fn

        global _multi_gpu, _rt, _launch_kernel, _launch_cooperative
        if _rt is None:
            from .target import require_cupy

            require_cupy()  # not installed: say what to install
            from cupy.cuda import driver, runtime

            _rt, _launch_kernel, _launch_cooperative = runtime, driver.launchKernel, driver.launchCooperativeKernel
            _multi_gpu = runtime.getDeviceCount() > 1
        self.device = like.device
        with _on_device(self.device):
            target = device_info(self.device).target
            stream_of = current_stream_fn(like)
            site = Site(self.device, lambda: bool(_rt.streamIsCapturing(stream_of())))  # for online tuning
            self.choice, src = _dispatcher.choose(op, problem, target, alignment(*vector_ptrs), site)
            config = self.choice.config
            launches = op.launches(problem, config, target)
            self._kernels = [load_kernel(src, target, l.kernel).kernel for l in launches]  # cupy Functions
        steps = [(k.ptr, *l.grid, *l.block, l.shared_mem, l.cooperative) for k, l in zip(self._kernels, launches)]
        self.launches = len(steps)
        self.run, self._keep = _launcher(self, op, problem, like, inputs, outputs, steps,
                                         op.workspace_bytes(problem, config), op.workspace_zeroed(problem, config))

    def __repr__(self) -> str:
        return f"Plan({self.choice.instance}, device {self.device})"


def arg_slots(values: Sequence[Any]) -> tuple[Any, Any]:
    """Kernel parameters as cuLaunchKernel takes them: one 8-byte slot per value (each value's
    bytes, numpy scalars, in the low end of its slot) and the array of the slots' addresses. The
    slots may be rewritten between launches (the dispatcher's launcher does, per call)."""
    import numpy as np

    buf = np.zeros(len(values), dtype=np.uint64)
    raw = buf.view(np.uint8)
    for i, v in enumerate(values):
        b = np.asarray(v).tobytes()
        raw[i * _SLOT:i * _SLOT + len(b)] = np.frombuffer(b, np.uint8)
    return buf, np.array([buf.ctypes.data + i * _SLOT for i in range(len(values))], dtype=np.uint64)


def _arg_buffer(op: OpSpec, problem: Problem) -> tuple[Any, Any, int]:
    """The kernels' argument buffer: one 8-byte slot per argument (pointers, then the scalars,
    written here once, then eps), the array of slot addresses cuLaunchKernel takes, and the
    byte offset of eps (-1: none)."""
    nptr = len(op.arg_names)
    scalars = op.scalar_args(problem)
    tail = (0,) * len(op.tail_arg_names)  # the pointers after eps (OpSpec.tail_arg_names)
    buf, kargs = arg_slots((0,) * nptr + tuple(scalars) + ((0,) if op.takes_eps else ()) + tail)  # pointers, eps: per call
    return buf, kargs, (nptr + len(scalars)) * _SLOT if op.takes_eps else -1


def _launcher(plan: Plan, op: OpSpec, problem: Problem, like: Any, inputs: Sequence[str],
              outputs: Sequence[Output], steps: list[tuple], ws_bytes: int,
              ws_zeroed: tuple[int, int] = (0, 0)) -> tuple[Callable[..., tuple], list]:
    """Generate the plan's run(ins, eps=0.0, like=None): allocate the outputs, fill the pointer
    slots, launch every step on the current stream, return the outputs. Straight-line code:
    no per-call loops, dicts or lookups beyond the stream's workspace. `ws_zeroed` (offset,
    bytes): the workspace's part that must be zero before a call and that the kernels leave
    zero (op.workspace_zeroed): a kept workspace is zeroed once, a fresh one in each call."""
    from .tensors import _strides, bfloat16, current_stream_fn, workspace_allocator

    buf, kargs, eps_at = _arg_buffer(op, problem)
    ns: dict[str, Any] = {
        "LOCK": _LAUNCH_LOCK, "pack": struct.Struct(f"<{len(op.arg_names)}Q").pack_into, "buf": buf,
        "KARGS": int(kargs.ctypes.data), "pack_eps": struct.Struct("<f").pack_into, "launch": _launch_kernel,
        "launch_coop": _launch_cooperative,
        "stream_of": current_stream_fn(like), "rt": _rt, "retry": _retry, "STEPS": tuple(steps), "plan": plan,
    }
    keep: list[Any] = [buf, kargs]  # alive as long as the plan
    body = ["def run(ins, eps=0.0, like=None):"]
    ptr_of = {name: f"ins[{i}]" for i, name in enumerate(inputs)}
    if like.kind == "torch":
        import torch

        ns.update(empty_strided=torch.empty_strided, empty_like=torch.empty_like, Tensor=torch.Tensor,
                  DEV=like.obj.device)
        tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int64": torch.int64}
        for i, o in enumerate(outputs):
            ns[f"S{i}"], ns[f"T{i}"], ns[f"D{i}"] = o.shape, _strides(o.shape, o.layout), tdt[o.dtype]
            strided = f"empty_strided(S{i}, T{i}, dtype=D{i}, device=DEV)"
            if tuple(o.shape) == tuple(like.shape) and o.dtype == like.dtype and o.layout != "flat":
                body.append(f"    o{i} = empty_like(like) if type(like) is Tensor else {strided}")
            else:
                body.append(f"    o{i} = {strided}")
            ptr_of[o.name] = f"o{i}.data_ptr()"
    else:
        import math

        import cupy

        from .tensors import _ITEMSIZE, _STORAGE

        ns.update(alloc=cupy.cuda.alloc, ndarray=cupy.ndarray, new=object.__new__, setattr=object.__setattr__,
                  bfloat16=bfloat16)
        for i, o in enumerate(outputs):
            item = _ITEMSIZE[o.dtype]
            ns[f"S{i}"], ns[f"D{i}"] = o.shape, cupy.dtype(_STORAGE[o.dtype])
            ns[f"B{i}"] = tuple(s * item for s in _strides(o.shape, o.layout))
            body += [f"    m{i} = alloc({max(1, math.prod(o.shape)) * item})",
                     f"    o{i} = ndarray(S{i}, D{i}, m{i}, B{i})"]
            if o.dtype == "bf16":  # a checked uint16 array: wrap without re-checking
                body += [f"    w{i} = new(bfloat16)", f"    setattr(w{i}, 'data', o{i})", f"    o{i} = w{i}"]
            ptr_of[o.name] = f"m{i}.ptr"
    body.append("    stream = stream_of()")
    if ws_bytes:
        ns["WS"] = workspace_allocator(like, ws_bytes)
        ns["KEPT"] = {}
        ns["graph_keep"] = _graph_keep
        z0, nz = ws_zeroed
        ns["memset"], ns["Z0"], ns["NZ"] = _rt.memsetAsync, z0, nz
        zero = ["        memset(ws[1] + Z0, 0, NZ, stream)"] if nz else []  # a fresh workspace's counters
        body += ["    if rt.streamIsCapturing(stream):",
                 "        ws = WS()  # the graph's own: from the capture's pool (torch), kept alive (CuPy)"]
        if like.kind != "torch":
            body.append("        graph_keep.append(ws[0])")
        body += zero
        if ws_bytes <= _KEEP_WS_BYTES:  # kept per stream: calls on one stream run in order
            ns["WS_KEEP"] = lambda: _keep_alloc(ws_bytes)
            body += ["    else:", "        ws = KEPT.get(stream)", "        if ws is None:",
                     "            ws = KEPT[stream] = WS_KEEP()"] + ["    " + z for z in zero]  # zeroed once
        else:  # large: from the allocator per call, freed (stream-ordered) when the call returns
            body += ["    else:", "        ws = WS()"] + zero
        ptr_of["ws"] = "ws[1]"
    ptrs = ", ".join(ptr_of.get(n, "0") for n in op.arg_names)
    body += ["    with LOCK:", f"        pack(buf, 0, {ptrs})"]
    if op.tail_arg_names and any(n in ptr_of for n in op.tail_arg_names):
        tail_at = (len(op.arg_names) + len(op.scalar_args(problem)) + (1 if op.takes_eps else 0)) * _SLOT
        ns["pack_tail"] = struct.Struct(f"<{len(op.tail_arg_names)}Q").pack_into
        body.append(f"        pack_tail(buf, {tail_at}, {', '.join(ptr_of.get(n, '0') for n in op.tail_arg_names)})")
    if eps_at >= 0:
        body.append(f"        pack_eps(buf, {eps_at}, eps)")
    body.append("        try:")
    for f, gx, gy, gz, bx, by, bz, smem, coop in steps:  # a cooperative launch takes no `extra`
        body.append(f"            launch_coop({f}, {gx}, {gy}, {gz}, {bx}, {by}, {bz}, {smem}, stream, KARGS)" if coop else
                    f"            launch({f}, {gx}, {gy}, {gz}, {bx}, {by}, {bz}, {smem}, stream, KARGS, 0)")
    body += ["        except Exception as e:", "            retry(e, STEPS, stream, KARGS)"]
    body.append(f"    return ({''.join(f'o{i}, ' for i in range(len(outputs)))})")
    code = "\n".join(body) + "\n"
    exec(compile(code, f"<ckgen launcher {plan.choice.instance}>", "exec"), ns)  # noqa: S102 - our own code
    here = ns["run"]
    here.source = code  # for debugging: print(plan.run.source)
    if not _multi_gpu:
        return here, keep
    device = like.device

    def run(ins: tuple, eps: float = 0.0, like: Any = None) -> tuple:
        if _rt.getDevice() != device:
            with _on_device(device):
                return here(ins, eps, like)
        return here(ins, eps, like)

    run.source = code
    return run, keep


def _keep_alloc(nbytes: int) -> tuple[Any, int]:
    """A workspace a plan keeps for a stream: from CuPy's pool, whatever the framework. Not from
    torch's allocator: a kept buffer allocated during torch.compile's CUDA-graph warm-up would
    sit in the graph's private pool, which must hold only tracked tensors."""
    import cupy

    mem = cupy.cuda.alloc(nbytes)
    return mem, mem.ptr


def _retry(e: Exception, steps: tuple, stream: int, kargs: int) -> None:
    """A launch failed. A thread that never used CUDA has no current context: bind the device's
    primary context and launch again (only the first step can have failed that way)."""
    if "CONTEXT" not in str(e):
        raise e
    _rt.memGetInfo()
    for f, gx, gy, gz, bx, by, bz, smem, coop in steps:
        if coop:
            _launch_cooperative(f, gx, gy, gz, bx, by, bz, smem, stream, kargs)
        else:
            _launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, kargs, 0)


class _on_device:
    """Make `device` current for the block (and restore the previous one) if it is not."""

    __slots__ = ("device", "prev")

    def __init__(self, device: int) -> None:
        self.device = device
        self.prev = -1

    def __enter__(self) -> None:
        from cupy.cuda import runtime

        cur = runtime.getDevice()
        if cur != self.device:
            self.prev = cur
            runtime.setDevice(self.device)

    def __exit__(self, *exc: Any) -> None:
        if self.prev >= 0:
            from cupy.cuda import runtime

            runtime.setDevice(self.prev)


def plan_for(op: OpSpec, problem: Problem, like: Any, inputs: dict[str, int], outputs: Sequence[Output],
             vector_args: Sequence[str]) -> Plan:
    """The plan of `problem` for tensors like `like` (a checked DeviceTensor), built on first use.
    `inputs` maps the op's input buffer names to this call's pointers (in the order the op's
    public function passes them to Plan.run); `vector_args` names those whose alignment bounds
    the vector width (outputs are always allocated 256-byte aligned)."""
    from .tensors import ALIGN

    align = 0
    for name in vector_args:
        align |= inputs.get(name, 0)
    key = (op.name, problem, like.device, ALIGN[align & 15], like.kind, like.dtype)
    plan = _dispatcher.plans.get(key)
    if plan is None:
        plan = Plan(op, problem, like, tuple(inputs), outputs,
                    [v for k, v in inputs.items() if k in vector_args])
        _dispatcher.plans[key] = plan
    return plan


def remember(call_key: tuple | None, plan: Plan) -> None:
    """Cache a call signature's plan (bounded: a flood of distinct shapes starts it afresh)."""
    if call_key is None:
        return
    calls = _dispatcher.calls
    if len(calls) >= 4096:
        calls.clear()
    calls[call_key] = plan
