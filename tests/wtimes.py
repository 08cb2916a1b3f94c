"""Synthetic timings for the multi-worker tests (importable by spawned workers): 8 max-pooling
problems (a space that enumerates in a fraction of a second, so each worker starts fast), each searched over a fixed subset of its valid configs, with a smooth landscape that
differs per problem."""
from __future__ import annotations

import functools
import hashlib

from ckgen.ops import get_op
from ckgen.types import Config, Target

OP = get_op("maxpool2d_fwd")
SM90 = Target.named("sm_90")
SHAPES = [(32, 64, 112, 112), (8, 128, 56, 56), (16, 256, 28, 28), (4, 512, 14, 14),
          (2, 64, 224, 224), (64, 32, 56, 56), (8, 96, 64, 64), (1, 160, 128, 128)]
PROBLEMS = [OP.parse_problem(N=n, C=c, H=h, W=w, kernel=3, stride=2, padding=1, dtype="bf16", layout=lay)
            for (n, c, h, w), lay in zip(SHAPES, ["nhwc", "nchw"] * 4)]
KEYS = [p.key() for p in PROBLEMS]
SUBSET = 10  # configs searched per problem


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "big")


@functools.lru_cache(maxsize=None)
def subset(key: str) -> frozenset[Config]:
    p = OP.problem_from_key(key)
    valid = sorted((c for c in OP.space.enumerate() if OP.validate(p, c, SM90)), key=lambda c: _h(key + c.key()))
    default = OP.space.nearest_default(lambda c: bool(OP.validate(p, c, SM90)))
    return frozenset(valid[: SUBSET - 1] + [default])


def restrict_to(key: str, config: Config) -> bool:
    return config in subset(key)


def time_of(key: str, config: Config) -> float | None:
    """Smooth in the knobs, shifted per problem; a few configs fail (a recorded failure)."""
    if _h("fail" + key + config.key()) % 17 == 0:
        return None
    k = _h(key) % 7
    return (100.0 + 10 * k - 2.0 * config["vec_bytes"] + abs(config["threads"] - 64 * (1 + k % 4)) / 64
            + config["tw"] * config["th"] / 4 + (_h(key + config.key()) % 1000) / 500.0)
