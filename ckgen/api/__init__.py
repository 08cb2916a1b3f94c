"""The public ops, one module per op family. Each public function maps its arguments to a
launch plan (`dispatch.Plan`) and runs it:

- fast path: the call's signature (every tensor argument's framework, shape, strides, dtype and
  device, the scalar options, the pointers' alignment class) -> the cached plan. The signature
  holds everything the argument checks read, so a signature seen before has passed them.
- first call of a signature, or arguments of other types (NumPy integers, lists, objects with
  __cuda_array_interface__): the full checks (ValueError/TypeError naming the argument, before
  anything is launched), then the plan of the problem (built once), remembered for the signature.

`planners[op](*args, **kwargs) -> (plan, input pointers)` is what `ckgen.explain` uses."""
from __future__ import annotations

from typing import Any, Callable

from . import groupnorm, pooling

planners: dict[str, Callable[..., tuple[Any, tuple[int, ...]]]] = {**groupnorm.planners, **pooling.planners}
