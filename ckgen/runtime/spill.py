"""The spill check of untuned picks: a config whose register estimate `validate` cannot trust
(`OpSpec.spill_prone`) is compiled (NVRTC, no GPU needed, into the kernel cache) and passed over
if its cubin spills registers. The dispatcher asks it of the cost model's best few."""
from __future__ import annotations

from typing import Any

from ..instance import render_instance
from ..ops.spec import OpSpec
from ..types import Config, Target
from . import compile as _compile

_SPILLS: dict[str, int | None] = {}


def spill_bytes(op: OpSpec, p: Any, config: Config, target: Target) -> int | None:
    """Bytes per thread the instance's kernels spill: the stack frame of the cubin that the
    launch would load (`compile.cubin_bytes`: NVRTC, no GPU needed, into the kernel cache, so
    an accepted pick is not compiled again; a cache that cannot take it is warned about once and
    the check goes on in memory), read from the cubin itself (`compile.frame_bytes`);
    remembered per source. None where that cannot be told (a HIP target, no NVRTC, a failed
    build). Not from ptxas's -v log: a second process compiling the same
    source got no ptxas report (a compile cache), and an empty report read as "no spill"."""
    if target.vendor != "cuda":
        return None
    src = render_instance(op, p, config, target)
    if src.sha256 not in _SPILLS:
        if _compile.nvrtc_missing():
            return None
        try:
            _SPILLS[src.sha256] = _compile.frame_bytes(_compile.cubin_bytes(src, target))
        except _compile.CompileError:
            _SPILLS[src.sha256] = None
    return _SPILLS[src.sha256]


class SpillFree:
    """The test an untuned pick must pass: compiled, it spills no registers (a config that cannot
    be checked passes). `rejected`: the configs it turned down, in the order asked."""

    def __init__(self, op: OpSpec, p: Any, target: Target) -> None:
        self.op, self.p, self.target = op, p, target
        self.rejected: list[Config] = []

    def __call__(self, config: Config) -> bool:
        if spill_bytes(self.op, self.p, config, self.target):
            self.rejected.append(config)
            return False
        return True


def spill_free(op: OpSpec, p: Any, target: Target) -> SpillFree | None:
    """For a problem whose register estimate `validate` cannot trust (`op.spill_prone`), a
    `SpillFree` test; None for every other problem (no compile)."""
    if target.vendor != "cuda" or not op.spill_prone(p):
        return None
    return SpillFree(op, p, target)
