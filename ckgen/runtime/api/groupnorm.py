"""Public GroupNorm ops: groupnorm_fwd, groupnorm_bwd, groupnorm_bwd_data, groupnorm_bwd_gamma_beta.

Same semantics as torch.nn.functional.group_norm (then F.silu with activation="swish") and its
gradients. Inputs are torch CUDA tensors or CuPy arrays (bf16 as `ckgen.bfloat16(uint16_array)`),
NCHW or channels-last; outputs keep x's layout and framework. See `ckgen.runtime.api` for the fast path."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...ops import get_op
from ..dispatch import NoConfigError, Output, dispatcher, plan_for, remember
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


#: the activation names the public functions take -> the problem's (silu is swish)
_ACTIVATIONS = {None: "none", "none": "none", "swish": "swish", "silu": "swish", "relu": "relu",
                "gelu": "gelu", "gelu_tanh": "gelu_tanh"}


def _activation(activation: Any) -> str:
    act = _ACTIVATIONS.get(activation) if activation is None or isinstance(activation, str) else None
    if act is None:
        raise ValueError(f"activation: expected None, 'swish' (or 'silu'), 'relu', 'gelu' or 'gelu_tanh', "
                         f"got {activation!r}")
    return act


def _problem(op_name: str, x: Any, gamma: Any, beta: Any, groups: Any, activation: Any,
             residual: bool = False, bias_nc: bool = False):
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
    problem = op.parse_problem(N=N, C=C, H=H, W=W, G=groups, dtype=xt.dtype, layout=layout, activation=act,
                               residual=residual, bias_nc=bias_nc)
    return op, problem, xt, gt, bt


def _fused_inputs(xt: Any, layout: str, residual: Any, bias_nc: Any) -> tuple[Any, Any]:
    """residual (x's shape, dtype, device and layout) and bias_nc ((N, C), x's dtype, contiguous)
    as DeviceTensors, or None."""
    from ..tensors import as_device_tensor, check_like

    rt = bt = None
    if residual is not None:
        rt = as_device_tensor(residual, "residual")
        check_like(rt, "residual", xt.shape, xt, layout)
    if bias_nc is not None:
        bt = as_device_tensor(bias_nc, "bias_nc")
        N, C = xt.shape[0], xt.shape[1]
        if bt.shape != (N, C):
            raise ValueError(f"bias_nc: expected shape ({N}, {C}) (x's N and C), got {bt.shape}")
        if bt.dtype != xt.dtype:
            raise TypeError(f"bias_nc: dtype {bt.dtype} differs from x's {xt.dtype}; cast it to x's dtype")
        if bt.strides != (C, 1) and N * C > 1:
            raise ValueError(f"bias_nc: must be contiguous, got strides {bt.strides}")
        if bt.device != xt.device:
            raise ValueError(f"bias_nc: on device {bt.device} but x is on device {xt.device}")
    return rt, bt


def _ptr(t: Any) -> int:
    return t.ptr if t is not None else 0


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
def _plan_fwd(x: Any, gamma: Any, beta: Any, groups: Any, eps: Any = 1e-5, activation: Any = None,
              residual: Any = None, bias_nc: Any = None):
    try:
        kx, px = sig(x)
        kg, pg = sig(gamma)
        kb, pb = sig(beta)
        kr, pr = sig(residual)
        kn, pn = sig(bias_nc)
        if type(groups) is not int or not (activation is None or type(activation) is str):
            raise Slow
        key = ("groupnorm_fwd", kx, kg, kb, groups, activation, kr, kn, ALIGN[(px | pg | pb | pr | pn) & 15])
        plan = _CALLS.get(key)
        if plan is not None:
            return plan, (px, pg, pb) + ((pr,) if kr is not None else ()) + ((pn,) if kn is not None else ())
    except Slow:
        key = None
    op, p, xt, gt, bt = _problem("groupnorm_fwd", x, gamma, beta, groups, activation,
                                 residual is not None, bias_nc is not None)
    rt, nt = _fused_inputs(xt, p.layout, residual, bias_nc)
    if p.N * p.Cg * p.HW == 1:  # where F.group_norm raises (its _verify_batch_size), before any launch
        raise ValueError(f"x: shape {xt.shape} with groups={p.G} leaves N*(C/groups)*H*W = 1 value to "
                         "normalize; PyTorch's group_norm refuses it too (\"Expected more than 1 value per "
                         "channel when training\")")
    ins = {"x": xt.ptr, "gamma": _ptr(gt), "beta": _ptr(bt)}
    if rt is not None:  # the fused inputs only where given: a plain call's launcher packs no more
        ins["res"] = rt.ptr
    if nt is not None:
        ins["bias"] = nt.ptr
    outs = (Output("y", xt.shape, p.layout, p.dtype), Output("mean", (p.N, p.G), "flat", "fp32"),
            Output("rstd", (p.N, p.G), "flat", "fp32"))
    plan = plan_for(op, p, xt, ins, outs, ("x", "gamma", "beta", "res", "bias"))
    remember(key, plan)
    return plan, tuple(ins.values())


def groupnorm_fwd(x: Any, gamma: Any, beta: Any, groups: int, eps: float = 1e-5,
                  activation: str | None = None, residual: Any = None, bias_nc: Any = None) -> tuple[Any, Any, Any]:
    """y, mean, rstd = act(GroupNorm(x + bias_nc[n, c]) + residual); mean/rstd fp32 (N, G), of
    x + bias_nc. Same semantics as torch.nn.functional.group_norm, then the residual add and the
    activation: None, 'swish' (= 'silu'), 'relu', 'gelu' or 'gelu_tanh'. residual: x's shape,
    dtype and layout; bias_nc: (N, C) in x's dtype (diffusers' time embedding). One kernel reads
    x (and the residual) once and writes y once; y keeps x's memory layout. Where no kernel fuses
    a problem (its slices too large to hold on chip), torch tensors run the plain kernel and
    PyTorch's add and activation around it; CuPy arrays raise NoConfigError."""
    try:
        plan, ins = _plan_fwd(x, gamma, beta, groups, eps, activation, residual, bias_nc)
    except NoConfigError:
        if _activation(activation) in ("none", "swish") and residual is None and bias_nc is None:
            raise
        return _fwd_composed(x, gamma, beta, groups, eps, activation, residual, bias_nc)
    if type(eps) is not float or not 0.0 <= eps <= _F32_MAX:
        eps = _eps(eps)
    y, mean, rstd = plan.run(ins, eps, x)
    return y, mean, rstd


def _fwd_composed(x: Any, gamma: Any, beta: Any, groups: int, eps: float, activation: Any, residual: Any,
                  bias_nc: Any) -> tuple[Any, Any, Any]:
    """The fused forward as the plain kernel and PyTorch's elementwise ops (torch tensors only)."""
    from ..tensors import as_device_tensor

    if as_device_tensor(x, "x").kind != "torch":
        raise NoConfigError(f"groupnorm_fwd: no kernel fuses activation={activation!r}, residual and bias_nc for "
                            f"x of shape {tuple(x.shape)} (its slices are too large to hold on chip); "
                            "pass torch tensors (then PyTorch adds and activates around the plain kernel) "
                            "or apply them yourself")
    import torch.nn.functional as F

    h = x + bias_nc[:, :, None, None] if bias_nc is not None else x
    y, mean, rstd = groupnorm_fwd(h, gamma, beta, groups, eps)
    if residual is not None:
        y = y + residual
    act = _activation(activation)
    y = {"none": lambda t: t, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
         "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act](y)
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

    if _activation(activation) not in ("none", "swish"):
        raise ValueError(f"activation: {activation!r} has no backward kernel yet; {op_name} takes None or "
                         "'swish' (the forward fuses relu, gelu and gelu_tanh)")
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
