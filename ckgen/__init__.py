"""ckgen: generated, tuned GPU kernels for GroupNorm and pooling.

    import ckgen
    y, mean, rstd = ckgen.groupnorm_fwd(x, gamma, beta, groups=32, activation="swish")
    y, _, _ = ckgen.groupnorm_fwd(x, gamma, beta, 32, activation="relu", residual=shortcut)  # one kernel
    dx, dgamma, dbeta = ckgen.groupnorm_bwd(dy, x, mean, rstd, gamma, 32, beta, activation="swish")
    y, indices = ckgen.maxpool2d_fwd(x, 3, stride=2, padding=1, return_indices=True)
    print(ckgen.explain("groupnorm_fwd", x, gamma, beta, 32))
    with ckgen.tuning(trials=12):   # or CKGEN_TUNE=1: a problem no DB entry has is tuned by its first call
        y, mean, rstd = ckgen.groupnorm_fwd(x, gamma, beta, groups=32)
"""
from __future__ import annotations

from ._version import __version__

from .runtime.api import explain
from .runtime.dispatch import NoConfigError
from .runtime.api.groupnorm import groupnorm_bwd, groupnorm_bwd_data, groupnorm_bwd_gamma_beta, groupnorm_fwd
from .runtime.api.pooling import avgpool2d_bwd, avgpool2d_fwd, maxpool2d_bwd, maxpool2d_fwd
from .runtime.tensors import bfloat16
from .tuner.online import tuning


def reload_db() -> None:
    """Forget the loaded instance DBs, cached choices and launch plans (a DB written by this
    process does this by itself; call it after another process wrote the DB)."""
    from .runtime.dispatch import dispatcher

    dispatcher().reload()


__all__ = ["NoConfigError", "__version__", "avgpool2d_bwd", "avgpool2d_fwd", "bfloat16", "explain", "groupnorm_bwd",
           "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta", "groupnorm_fwd", "maxpool2d_bwd", "maxpool2d_fwd",
           "reload_db", "tuning"]
