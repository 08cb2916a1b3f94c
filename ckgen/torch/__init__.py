"""ckgen in PyTorch models: custom ops with autograd, drop-in modules, and convert(model).

    import ckgen.torch as ct

    report = ct.convert(model)            # nn.GroupNorm (+ SiLU), (nn.ReLU +) nn.MaxPool2d, nn.AvgPool2d -> ckgen,
                                          # and timm / diffusers / LDM blocks through adapters
    print(report)
    model = torch.compile(model)          # the ops trace (fullgraph=True) and run in CUDA graphs

    gn = ct.GroupNorm(32, 320)            # nn.GroupNorm's arguments and state_dict
    gns = ct.GroupNormSwish(32, 320)      # GroupNorm then SiLU, one kernel each way
    mp = ct.MaxPool2d(3, 2, 1, indices="recompute")
    rmp = ct.ReLUMaxPool2d(2)             # nn.ReLU then nn.MaxPool2d(2), pooled first
    y, mean, rstd = torch.ops.ckgen.groupnorm_fwd(x, gamma, beta, 32, 1e-5, "swish")

PyTorch is an optional dependency (`pip install ckgen[torch]`); `import ckgen` never imports
it, `import ckgen.torch` does. Importing this package registers the `ckgen::` custom ops.
"""
from __future__ import annotations

try:
    import torch as _torch  # noqa: F401 - the real torch (absolute import)
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("ckgen.torch needs PyTorch: pip install 'ckgen[torch]'") from e

from . import adapters, functional, ops
from .adapters import Adapter, register_adapter, registered_adapters, unregister_adapter
from .convert import OPS, ConvertReport, ConvertWarning, Entry, FusePattern, Site, convert
from .functional import avg_pool2d, group_norm, max_pool2d
from .modules import AvgPool2d, GroupNorm, GroupNormAct, GroupNormSwish, MaxPool2d, ReLUMaxPool2d, SiLUPlaceholder
from .ops import DoubleBackwardError, fallbacks, reset_fallbacks

__all__ = ["OPS", "Adapter", "AvgPool2d", "ConvertReport", "ConvertWarning", "DoubleBackwardError", "Entry",
           "FusePattern", "GroupNorm", "GroupNormAct", "GroupNormSwish", "MaxPool2d", "SiLUPlaceholder", "Site",
           "adapters", "avg_pool2d", "convert",
           "fallbacks", "functional", "group_norm", "max_pool2d", "ops", "ReLUMaxPool2d", "register_adapter",
           "registered_adapters", "reset_fallbacks", "unregister_adapter"]
