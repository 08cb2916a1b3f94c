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

from .avg import AvgPool2dBwd, AvgPool2dFwd
from .max import MaxPool2dBwd, MaxPool2dFwd
from .problem import (AvgPoolProblem, MaxPoolBwdProblem, MaxPoolFwdProblem, PoolProblem, avgpool2d_bwd_reference,
                      avgpool2d_divisor, avgpool2d_reference, maxpool2d_bwd_reference, maxpool2d_reference,
                      pool_output_size, smooth_random, tie_heavy)

__all__ = ["AvgPool2dBwd", "AvgPool2dFwd", "AvgPoolProblem", "MaxPool2dBwd", "MaxPool2dFwd", "MaxPoolBwdProblem",
           "MaxPoolFwdProblem", "PoolProblem", "avgpool2d_bwd_reference", "avgpool2d_divisor", "avgpool2d_reference",
           "maxpool2d_bwd_reference", "maxpool2d_reference", "pool_output_size", "tie_heavy", "smooth_random"]
