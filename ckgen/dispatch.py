"""Arrays -> Problem -> DB winner or fallback -> compiled kernel -> launch.

Never tunes implicitly. On a DB miss it falls back to the nearest tuned problem whose config
is valid here, else to the space's default (or the valid config nearest to it), and says so
once per problem through the `ckgen` logger."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from . import db as dbmod
from . import settings
from .codegen import KernelSource
from .instance import render_instance
from .ops import get_op
from .ops.spec import Config, OpSpec, Problem, Target

log = logging.getLogger("ckgen")


@dataclass(frozen=True)
class Choice:
    op: str
    problem: str
    instance: str
    config: Config
    source: str  # "tuned" | "nearest" | "default"
    reason: str
    entry: Any = None  # the db.Entry it came from, if any

    def __str__(self) -> str:
        return f"{self.op} {self.problem} -> {self.instance} [{self.source}] {self.reason}"


class Dispatcher:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._db: dbmod.InstanceDB | None = None
        self._choices: dict[tuple[str, str, str, int], tuple[Choice, KernelSource]] = {}
        self._told: set[tuple[str, str]] = set()

    # ---- the DB view: user DB over shipped DB, stale entries dropped per entry ----
    def database(self) -> dbmod.InstanceDB:
        with self._lock:
            if self._db is None:
                self._db = dbmod.load_layered(settings.user_db_path())
            return self._db

    def reload(self) -> None:
        with self._lock:
            self._db = None
            self._choices.clear()
            self._told.clear()

    # ---- selection ----
    def choose(self, op: OpSpec, problem: Problem, target: Target, max_vec_bytes: int = 16) -> tuple[Choice, KernelSource]:
        key = (op.name, problem.key(), target.arch, max_vec_bytes)
        hit = self._choices.get(key)
        if hit is None:
            hit = self._select(op, problem, target, max_vec_bytes)
            self._choices[key] = hit
            choice = hit[0]
            if choice.source != "tuned" and (op.name, problem.key()) not in self._told and not settings.quiet():
                self._told.add((op.name, problem.key()))
                log.warning("ckgen: %s", choice)
        return hit

    def _usable(self, op: OpSpec, problem: Problem, config: Config, target: Target, max_vec: int) -> str | None:
        if "vec_bytes" in config.as_dict() and config["vec_bytes"] > max_vec:
            return f"vec_bytes={config['vec_bytes']} exceeds the pointers' {max_vec}-byte alignment"
        ok = op.validate(problem, config, target)
        return None if ok else ok.reason

    def _select(self, op: OpSpec, problem: Problem, target: Target, max_vec: int) -> tuple[Choice, KernelSource]:
        db = self.database()
        entry = db.lookup(op.name, target.arch, problem.key())
        stale = ""
        if entry is not None:
            config = Config.of(entry.config_dict())
            why = self._usable(op, problem, config, target, max_vec)
            if why is None:
                src = render_instance(op, problem, config, target)
                if src.sha256 == entry.source_sha256:
                    return Choice(op.name, problem.key(), src.name, config, "tuned",
                                  f"DB entry ({entry.time_us:.1f} us on {entry.device})", entry), src
                stale = "tuned entry is stale (template changed since tuning); "
            else:
                stale = f"tuned entry unusable ({why}); "
        near = sorted((e for e in db.select(op.name, target.arch) if e.problem != problem.key()),
                      key=lambda e: op.distance(problem, op.problem_from_key(e.problem)))
        for e in near:
            config = Config.of(e.config_dict())
            if self._usable(op, problem, config, target, max_vec) is None:
                src = render_instance(op, problem, config, target)
                return Choice(op.name, problem.key(), src.name, config, "nearest",
                              f"{stale}not tuned; using the winner of the nearest tuned problem {e.problem}", e), src
        config = op.space.nearest_default(lambda c: self._usable(op, problem, c, target, max_vec) is None)
        if config is None:
            raise ValueError(f"{op.name}: no config of the tuning space can run {problem.key()}")
        src = render_instance(op, problem, config, target)
        what = "the default config" if config == op.space.default else "the valid config nearest the default"
        return Choice(op.name, problem.key(), src.name, config, "default",
                      f"{stale}not tuned and no tuned neighbour fits; using {what} "
                      f"(run `ckgen tune {op.name}` for this shape)"), src


_dispatcher = Dispatcher()


def dispatcher() -> Dispatcher:
    return _dispatcher


# ---------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------
def _groupnorm_problem(x: Any, gamma: Any, beta: Any, groups: Any, eps: Any, activation: Any,
                       op_name: str = "groupnorm_fwd"):
    """Checks shared by every GroupNorm op (eps=None: the op takes none) -> op, problem, x, gamma, beta."""
    from .tensors import as_device_tensor, check_vector, layout_of

    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"groups: expected a positive int, got {groups!r}")
    if eps is not None and (not isinstance(eps, (int, float)) or not (eps >= 0) or eps == float("inf")):
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    if activation not in (None, "none", "swish"):
        raise ValueError(f"activation: expected None or 'swish', got {activation!r}")
    xt = as_device_tensor(x, "x")
    layout = layout_of(xt, "x")
    N, C, H, W = xt.shape
    if C % groups:
        raise ValueError(f"groups: C={C} is not divisible by groups={groups}")
    gt = as_device_tensor(gamma, "gamma") if gamma is not None else None
    bt = as_device_tensor(beta, "beta") if beta is not None else None
    check_vector(gt, "gamma", C, xt.dtype, xt.device)
    check_vector(bt, "beta", C, xt.dtype, xt.device)
    op = get_op(op_name)
    problem = op.parse_problem(N=N, C=C, H=H, W=W, G=groups, dtype=xt.dtype, layout=layout,
                               activation=activation or "none")
    return op, problem, xt, gt, bt


def launch(op: OpSpec, problem: Problem, like: Any, ptrs: dict[str, int], eps: float = 0.0,
           vector_args: tuple[str, ...] | None = None) -> Choice:
    """Pick the instance for `problem` on `like`'s device and run every launch of it on the
    current stream of `like` (a DeviceTensor), with a workspace if the config needs one.
    `ptrs` maps the op's buffer names to device pointers; the alignment of those the kernels
    access with vectors (`vector_args`, default all) bounds the vector width."""
    import cupy

    from .compile import load_kernel
    from .target import device_info
    from .tensors import alignment, data_ptr, empty_f32, stream_for

    with cupy.cuda.Device(like.device):
        target = device_info(like.device).target
        vec_ptrs = [v for k, v in ptrs.items() if vector_args is None or k in vector_args]
        choice, src = _dispatcher.choose(op, problem, target, alignment(*vec_ptrs))
        launches = op.launches(problem, choice.config, target)
        kernels = [load_kernel(src, target, l.kernel) for l in launches]
        ws_bytes = op.workspace_bytes(problem, choice.config)
        ptrs = dict(ptrs)
        if ws_bytes:
            ws = empty_f32(like, ((ws_bytes + 3) // 4,))
            ptrs["ws"] = data_ptr(ws)
        args = op.kernel_args(problem, ptrs, float(eps))
        with stream_for(like):
            for kernel, l in zip(kernels, launches):
                kernel(l.grid, l.block, args, shared_mem=l.shared_mem)
    return choice


def groupnorm_fwd(x: Any, gamma: Any, beta: Any, groups: int, eps: float = 1e-5,
                  activation: str | None = None) -> tuple[Any, Any, Any]:
    """y, mean, rstd = GroupNorm(x) (then swish if activation='swish'); mean/rstd fp32 (N, G).
    Same semantics as torch.nn.functional.group_norm; y keeps x's memory layout."""
    import cupy

    from .tensors import data_ptr, empty_f32, empty_like_layout

    op, problem, xt, gt, bt = _groupnorm_problem(x, gamma, beta, groups, eps, activation)
    with cupy.cuda.Device(xt.device):
        y = empty_like_layout(xt, xt.shape, problem.layout)
        mean = empty_f32(xt, (problem.N, problem.G))
        rstd = empty_f32(xt, (problem.N, problem.G))
    ptrs = {"x": xt.ptr, "y": data_ptr(y), "mean": data_ptr(mean), "rstd": data_ptr(rstd)}
    if gt is not None:
        ptrs["gamma"] = gt.ptr
    if bt is not None:
        ptrs["beta"] = bt.ptr
    launch(op, problem, xt, ptrs, eps, vector_args=("x", "y", "gamma", "beta"))
    return y, mean, rstd


def _groupnorm_bwd_problem(op_name: str, dy: Any, x: Any, mean: Any, rstd: Any, gamma: Any, beta: Any,
                           groups: Any, activation: Any):
    from .tensors import as_device_tensor, check_like

    op, problem, xt, gt, bt = _groupnorm_problem(x, gamma, beta, groups, None, activation, op_name)
    dyt = as_device_tensor(dy, "dy")
    check_like(dyt, "dy", xt.shape, xt, problem.layout)
    N, G = problem.N, problem.G
    stats = []
    for arg, t in (("mean", mean), ("rstd", rstd)):
        st = as_device_tensor(t, arg)
        if st.dtype != "fp32":
            raise TypeError(f"{arg}: expected float32 (as groupnorm_fwd returns it), got {st.dtype}")
        if st.shape not in ((N, G), (N * G,)):
            raise ValueError(f"{arg}: expected shape ({N}, {G}), got {st.shape}")
        if st.strides not in ((G, 1), (1,)) and N * G > 1:
            raise ValueError(f"{arg}: must be contiguous, got strides {st.strides}")
        if st.device != xt.device:
            raise ValueError(f"{arg}: on device {st.device} but x is on device {xt.device}")
        stats.append(st)
    ptrs = {"x": xt.ptr, "dy": dyt.ptr, "mean": stats[0].ptr, "rstd": stats[1].ptr}
    ptrs.update({k: t.ptr for k, t in (("gamma", gt), ("beta", bt)) if t is not None})
    return op, problem, xt, ptrs


def _groupnorm_bwd_run(op_name: str, dy: Any, x: Any, mean: Any, rstd: Any, gamma: Any, beta: Any,
                       groups: Any, activation: Any) -> dict[str, Any]:
    import cupy

    from .tensors import data_ptr, empty_like_layout, empty_vector

    op, problem, xt, ptrs = _groupnorm_bwd_problem(op_name, dy, x, mean, rstd, gamma, beta, groups, activation)
    out: dict[str, Any] = {}
    with cupy.cuda.Device(xt.device):
        if "dx" in op.outputs:
            out["dx"] = empty_like_layout(xt, xt.shape, problem.layout)
        for k in ("dgamma", "dbeta"):
            if k in op.outputs:
                out[k] = empty_vector(xt, problem.C)
    launch(op, problem, xt, {**ptrs, **{k: data_ptr(v) for k, v in out.items()}},
           vector_args=("x", "dy", "dx", "gamma", "beta"))
    return out


def groupnorm_bwd(dy: Any, x: Any, mean: Any, rstd: Any, gamma: Any, groups: int, beta: Any = None,
                  activation: str | None = None) -> tuple[Any, Any, Any]:
    """dx, dgamma, dbeta of groupnorm_fwd (and swish, recomputed from x, mean, rstd, gamma, beta)
    given the upstream gradient dy and the forward's mean/rstd. dgamma/dbeta are deterministic
    (fixed-order sums, no atomics) and have x's dtype; dx keeps x's layout."""
    o = _groupnorm_bwd_run("groupnorm_bwd", dy, x, mean, rstd, gamma, beta, groups, activation)
    return o["dx"], o["dgamma"], o["dbeta"]


def groupnorm_bwd_data(dy: Any, x: Any, mean: Any, rstd: Any, gamma: Any, groups: int, beta: Any = None,
                       activation: str | None = None) -> Any:
    """dx of groupnorm_fwd alone (see groupnorm_bwd)."""
    return _groupnorm_bwd_run("groupnorm_bwd_data", dy, x, mean, rstd, gamma, beta, groups, activation)["dx"]


def groupnorm_bwd_gamma_beta(dy: Any, x: Any, mean: Any, rstd: Any, groups: int, gamma: Any = None,
                             beta: Any = None, activation: str | None = None) -> tuple[Any, Any]:
    """dgamma, dbeta of groupnorm_fwd alone (see groupnorm_bwd); gamma/beta are needed only for swish."""
    o = _groupnorm_bwd_run("groupnorm_bwd_gamma_beta", dy, x, mean, rstd, gamma, beta, groups, activation)
    return o["dgamma"], o["dbeta"]


def explain(op_name: str, *args: Any, **kwargs: Any) -> Choice:
    """Which instance would this call use, and why? With the call's arguments, e.g.
    `explain("groupnorm_fwd", x, gamma, beta, 32)` or `explain("groupnorm_bwd", dy, x, mean, rstd,
    gamma, 32)`, or with a problem: `explain("groupnorm_fwd", N=2, C=320, H=64, W=64, G=32, dtype="bf16",
    layout="nhwc", arch="sm_90")`. Launches nothing."""
    op = get_op(op_name)
    if args:
        from .target import device_info
        from .tensors import alignment

        if op_name == "groupnorm_fwd":
            names: tuple[str, ...] = ("x", "gamma", "beta", "groups", "eps", "activation")
            call = {"eps": 1e-5, "activation": None, **dict(zip(names, args)), **kwargs}
            op, problem, xt, gt, bt = _groupnorm_problem(**{k: call.get(k) for k in names})
            vec = alignment(xt.ptr, *(t.ptr for t in (gt, bt) if t is not None))
        elif op_name in ("groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta"):
            names = ("dy", "x", "mean", "rstd", "gamma", "groups", "beta", "activation")
            if op_name == "groupnorm_bwd_gamma_beta":
                names = ("dy", "x", "mean", "rstd", "groups", "gamma", "beta", "activation")
            call = {"gamma": None, "beta": None, "activation": None, **dict(zip(names, args)), **kwargs}
            op, problem, xt, ptrs = _groupnorm_bwd_problem(op_name, **{k: call.get(k) for k in names})
            vec = alignment(*(v for k, v in ptrs.items() if k not in ("mean", "rstd")))
        else:
            raise ValueError(f"op: explain with tensors is implemented for the GroupNorm ops, not {op_name}")
        return _dispatcher.choose(op, problem, device_info(xt.device).target, vec)[0]
    else:
        arch = kwargs.pop("arch", None)
        if arch is None:
            from .target import current_target

            target = current_target()
        else:
            target = Target.named(arch)
        problem = op.parse_problem(**kwargs)
    return _dispatcher.choose(op, problem, target)[0]
