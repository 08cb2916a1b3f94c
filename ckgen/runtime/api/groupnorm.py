"""Public GroupNorm ops: groupnorm_fwd, groupnorm_bwd, groupnorm_bwd_data, groupnorm_bwd_gamma_beta.

Same semantics as torch.nn.functional.group_norm (then F.silu with activation="swish") and its
gradients. Inputs are torch CUDA tensors or CuPy arrays (bf16 as `ckgen.bfloat16(uint16_array)`),
NCHW or channels-last; outputs keep x's layout and framework. See `ckgen.runtime.api` for the fast path."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...ops import get_op
from ..dispatch import Output, dispatcher, plan_for, remember
from ..tensors import ALIGN, Slow, sig

_CALLS = dispatcher().calls
_F32_MAX = float(np.finfo(np.float32).max)


def _groups(groups: Any) -> int:
    if isinstance(groups, (int, np.integer)) and not isinstance(groups, (bool, np.bool_)) and groups >= 1:
        return int(groups)
    raise ValueError(f"groups: expected a positive int, got {groups!r}")


def _eps(eps: Any) -> float:
    """eps as a float: a finite number >= 0 that float32 (the kernels' type) can hold."""
    if isinstance(eps, (int, float, np.integer, np.floating)) and not isinstance(eps, (bool, np.bool_)):
        try:
            v = float(eps)
        except OverflowError:
            v = math.inf
        if 0.0 <= v <= _F32_MAX:
            return v
    raise ValueError(f"eps: expected a finite number >= 0 (at most {_F32_MAX:.4g}, float32), got {eps!r}")


def _activation(activation: Any) -> str:
    if activation is None or activation == "none":
        return "none"
    if activation == "swish":
        return "swish"
    raise ValueError(f"activation: expected None or 'swish', got {activation!r}")


def _problem(op_name: str, x: Any, gamma: Any, beta: Any, groups: Any, activation: Any):
    """The full checks every GroupNorm op shares -> op, problem, x, gamma, beta (DeviceTensors)."""
    from ..tensors import as_device_tensor, check_vector, layout_of

    groups = _groups(groups)
    act = _activation(activation)
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
    problem = op.parse_problem(N=N, C=C, H=H, W=W, G=groups, dtype=xt.dtype, layout=layout, activation=act)
    return op, problem, xt, gt, bt


def _ptr(t: Any) -> int:
    return t.ptr if t is not None else 0


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
def _plan_fwd(x: Any, gamma: Any, beta: Any, groups: Any, eps: Any = 1e-5, activation: Any = None):
    try:
        kx, px = sig(x)
        kg, pg = sig(gamma)
        kb, pb = sig(beta)
        if type(groups) is not int or not (activation is None or type(activation) is str):
            raise Slow
        key = ("groupnorm_fwd", kx, kg, kb, groups, activation, ALIGN[(px | pg | pb) & 15])
        plan = _CALLS.get(key)
        if plan is not None:
            return plan, (px, pg, pb)
    except Slow:
        key = None
    op, p, xt, gt, bt = _problem("groupnorm_fwd", x, gamma, beta, groups, activation)
    if p.N * p.Cg * p.HW == 1:  # where F.group_norm raises (its _verify_batch_size), before any launch
        raise ValueError(f"x: shape {xt.shape} with groups={p.G} leaves N*(C/groups)*H*W = 1 value to "
                         "normalize; PyTorch's group_norm refuses it too (\"Expected more than 1 value per "
                         "channel when training\")")
    ins = {"x": xt.ptr, "gamma": _ptr(gt), "beta": _ptr(bt)}
    outs = (Output("y", xt.shape, p.layout, p.dtype), Output("mean", (p.N, p.G), "flat", "fp32"),
            Output("rstd", (p.N, p.G), "flat", "fp32"))
    plan = plan_for(op, p, xt, ins, outs, ("x", "gamma", "beta"))
    remember(key, plan)
    return plan, tuple(ins.values())


def groupnorm_fwd(x: Any, gamma: Any, beta: Any, groups: int, eps: float = 1e-5,
                  activation: str | None = None) -> tuple[Any, Any, Any]:
    """y, mean, rstd = GroupNorm(x) (then swish if activation='swish'); mean/rstd fp32 (N, G).
    Same semantics as torch.nn.functional.group_norm; y keeps x's memory layout."""
    plan, ins = _plan_fwd(x, gamma, beta, groups, eps, activation)
    if type(eps) is not float or not 0.0 <= eps <= _F32_MAX:
        eps = _eps(eps)
    y, mean, rstd = plan.run(ins, eps, x)
    return y, mean, rstd


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
def _stats(t: Any, arg: str, N: int, G: int, device: int):
    from ..tensors import as_device_tensor

    st = as_device_tensor(t, arg)
    if st.dtype != "fp32":
        raise TypeError(f"{arg}: expected float32 (as groupnorm_fwd returns it), got {st.dtype}")
    if st.shape not in ((N, G), (N * G,)):
        raise ValueError(f"{arg}: expected shape ({N}, {G}), got {st.shape}")
    if st.strides not in ((G, 1), (1,)) and N * G > 1:
        raise ValueError(f"{arg}: must be contiguous, got strides {st.strides}")
    if st.device != device:
        raise ValueError(f"{arg}: on device {st.device} but x is on device {device}")
    return st


def _plan_bwd(op_name: str, dy: Any, x: Any, mean: Any, rstd: Any, gamma: Any, beta: Any, groups: Any,
              activation: Any):
    try:
        kd, pd = sig(dy)
        kx, px = sig(x)
        km, pm = sig(mean)
        kr, pr = sig(rstd)
        kg, pg = sig(gamma)
        kb, pb = sig(beta)
        if type(groups) is not int or not (activation is None or type(activation) is str):
            raise Slow
        key = (op_name, kd, kx, km, kr, kg, kb, groups, activation, ALIGN[(pd | px | pg | pb) & 15])
        plan = _CALLS.get(key)
        if plan is not None:
            return plan, (px, pd, pm, pr, pg, pb)
    except Slow:
        key = None
    from ..tensors import as_device_tensor, check_like

    op, p, xt, gt, bt = _problem(op_name, x, gamma, beta, groups, activation)
    dyt = as_device_tensor(dy, "dy")
    check_like(dyt, "dy", xt.shape, xt, p.layout)
    mt = _stats(mean, "mean", p.N, p.G, xt.device)
    rt = _stats(rstd, "rstd", p.N, p.G, xt.device)
    ins = {"x": xt.ptr, "dy": dyt.ptr, "mean": mt.ptr, "rstd": rt.ptr, "gamma": _ptr(gt), "beta": _ptr(bt)}
    outs = []
    if "dx" in op.outputs:
        outs.append(Output("dx", xt.shape, p.layout, p.dtype))
    outs += [Output(k, (p.C,), "flat", p.dtype) for k in ("dgamma", "dbeta") if k in op.outputs]
    plan = plan_for(op, p, xt, ins, outs, ("x", "dy", "gamma", "beta"))
    remember(key, plan)
    return plan, tuple(ins.values())


def _plan_bwd_full(dy: Any, x: Any, mean: Any, rstd: Any, gamma: Any, groups: Any, beta: Any = None,
                   activation: Any = None):
    return _plan_bwd("groupnorm_bwd", dy, x, mean, rstd, gamma, beta, groups, activation)


def _plan_bwd_data(dy: Any, x: Any, mean: Any, rstd: Any, gamma: Any, groups: Any, beta: Any = None,
                   activation: Any = None):
    return _plan_bwd("groupnorm_bwd_data", dy, x, mean, rstd, gamma, beta, groups, activation)


def _plan_bwd_gamma_beta(dy: Any, x: Any, mean: Any, rstd: Any, groups: Any, gamma: Any = None, beta: Any = None,
                         activation: Any = None):
    return _plan_bwd("groupnorm_bwd_gamma_beta", dy, x, mean, rstd, gamma, beta, groups, activation)


def groupnorm_bwd(dy: Any, x: Any, mean: Any, rstd: Any, gamma: Any, groups: int, beta: Any = None,
                  activation: str | None = None) -> tuple[Any, Any, Any]:
    """dx, dgamma, dbeta of groupnorm_fwd (and swish, recomputed from x, mean, rstd, gamma, beta)
    given the upstream gradient dy and the forward's mean/rstd. dgamma/dbeta are deterministic
    (fixed-order sums, no atomics) and have x's dtype; dx keeps x's layout."""
    plan, ins = _plan_bwd("groupnorm_bwd", dy, x, mean, rstd, gamma, beta, groups, activation)
    dx, dgamma, dbeta = plan.run(ins, 0.0, x)
    return dx, dgamma, dbeta


def groupnorm_bwd_data(dy: Any, x: Any, mean: Any, rstd: Any, gamma: Any, groups: int, beta: Any = None,
                       activation: str | None = None) -> Any:
    """dx of groupnorm_fwd alone (see groupnorm_bwd)."""
    plan, ins = _plan_bwd("groupnorm_bwd_data", dy, x, mean, rstd, gamma, beta, groups, activation)
    return plan.run(ins, 0.0, x)[0]


def groupnorm_bwd_gamma_beta(dy: Any, x: Any, mean: Any, rstd: Any, groups: int, gamma: Any = None,
                             beta: Any = None, activation: str | None = None) -> tuple[Any, Any]:
    """dgamma, dbeta of groupnorm_fwd alone (see groupnorm_bwd); gamma/beta are needed only for swish."""
    plan, ins = _plan_bwd("groupnorm_bwd_gamma_beta", dy, x, mean, rstd, gamma, beta, groups, activation)
    dgamma, dbeta = plan.run(ins, 0.0, x)
    return dgamma, dbeta


planners = {"groupnorm_fwd": _plan_fwd, "groupnorm_bwd": _plan_bwd_full, "groupnorm_bwd_data": _plan_bwd_data,
            "groupnorm_bwd_gamma_beta": _plan_bwd_gamma_beta}
