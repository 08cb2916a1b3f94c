"""Op registry: every op is declared once, as an OpSpec, and registered here."""
from __future__ import annotations

from .groupnorm import GroupNormFwd
from .groupnorm_bwd import GroupNormBwd, GroupNormBwdData, GroupNormBwdGammaBeta
from .pool import AvgPool2dBwd, AvgPool2dFwd, MaxPool2dBwd, MaxPool2dFwd
from .spec import OpSpec

_REGISTRY: dict[str, OpSpec] = {spec.name: spec for spec in (
    GroupNormFwd(), GroupNormBwd(), GroupNormBwdData(), GroupNormBwdGammaBeta(),
    MaxPool2dFwd(), MaxPool2dBwd(), AvgPool2dFwd(), AvgPool2dBwd())}


def get_op(name: str) -> OpSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"op: unknown {name!r}; known ops: {', '.join(sorted(_REGISTRY))}") from None


def all_ops() -> list[OpSpec]:
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]
