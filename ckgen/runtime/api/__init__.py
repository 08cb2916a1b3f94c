"""The public ops, one module per op family. Each public function maps its arguments to a
launch plan (`dispatch.Plan`) and runs it:

- fast path: the call's signature (every tensor argument's framework, shape, strides, dtype and
  device, the scalar options, the pointers' alignment class) -> the cached plan. The signature
  holds everything the argument checks read, so a signature seen before has passed them.
- first call of a signature, or arguments of other types (NumPy integers, lists, objects with
  __cuda_array_interface__): the full checks (ValueError/TypeError naming the argument, before
  anything is launched), then the plan of the problem (built once), remembered for the signature.

`planners[op](*args, **kwargs) -> (plan, input pointers)` is what `explain` uses."""
from __future__ import annotations

from typing import Any, Callable

from ...ops import get_op
from ...types import served
from ..dispatch import Choice, dispatcher
from . import groupnorm, pooling
from .groupnorm import groupnorm_bwd, groupnorm_bwd_data, groupnorm_bwd_gamma_beta, groupnorm_fwd
from .pooling import avgpool2d_bwd, avgpool2d_fwd, maxpool2d_bwd, maxpool2d_fwd

planners: dict[str, Callable[..., tuple[Any, tuple[int, ...]]]] = {**groupnorm.planners, **pooling.planners}
#: each op's public function by op name (`ckgen bench` hands it to the op's `bench_callables`)
functions: dict[str, Callable[..., Any]] = {f.__name__: f for f in (
    groupnorm_fwd, groupnorm_bwd, groupnorm_bwd_data, groupnorm_bwd_gamma_beta,
    maxpool2d_fwd, maxpool2d_bwd, avgpool2d_fwd, avgpool2d_bwd)}


def explain(op_name: str, *args: Any, **kwargs: Any) -> Choice:
    """Which instance would this call use, and why? With the call's arguments, e.g.
    `explain("groupnorm_fwd", x, gamma, beta, 32)`, `explain("maxpool2d_fwd", x, 3, 2, 1)`, or
    with a problem: `explain("groupnorm_fwd", N=2, C=320, H=64, W=64, G=32, dtype="bf16",
    layout="nhwc", arch="sm_90")`. Launches nothing (the plan it builds serves the next call).
    The choice is returned, not logged: a problem explained here is not announced again by its
    calls (`print(explain(...))` shows it once)."""
    with dispatcher().asked():
        return _explain(op_name, *args, **kwargs)


def _explain(op_name: str, *args: Any, **kwargs: Any) -> Choice:
    op = get_op(op_name)
    if args:
        return planners[op_name](*args, **kwargs)[0].choice
    arch = kwargs.pop("arch", None)
    if arch is None:
        from ..target import NoGPUError, current_target

        try:
            target = current_target()
        except NoGPUError as e:  # offline, a problem is explained for a named arch
            raise NoGPUError(f'{e}; to explain a problem without a GPU, pass arch= (e.g. arch="sm_90")') from None
    else:
        try:
            target = served(arch)
        except ValueError as e:
            raise ValueError(f"arch: {str(e).removeprefix('target: ')}") from None
    problem = op.parse_problem(**kwargs)
    return dispatcher().choose(op, problem, target)[0]
