"""GPU fuzz: a few hundred random valid problems per op family (GroupNorm forward, GroupNorm
backward and its two partial ops, max pooling forward/backward, avg pooling forward/backward),
each run with the config the dispatcher picks for it (the shipped DB's winners, else the space's
default or the valid config nearest it) and one more valid config of a small seeded pool, against
the float64 reference with poisoned outputs (ckgen.runtime.verify.Harness). A quarter of the problems
also go through the public API (CuPy inputs, every CuPy allocation poisoned).

Shapes are drawn odd and small, with the edges placed first: HW = 1, G = 1, G = C, N = 1,
slices too large for one block; pooling gets asymmetric kernels, strides and paddings, dilation,
ceil_mode, count_include_pad, divisor_override, return_indices and stored/recomputed indices;
max pooling inputs hold ties, NaN, +-inf and whole -inf planes, avg pooling inputs NaN and +-inf.

Seeded and reproducible: CKGEN_FUZZ_SEED (default 16) picks the problems, configs and inputs;
CKGEN_FUZZ_SCALE (default 1) multiplies the problem counts. A failure names the seed, the
problem's index, its key and the config, e.g.

    CKGEN_FUZZ_SEED=16 python -m pytest -m gpu tests/gpu/test_fuzz_gpu.py -k "maxpool2d and 3"
"""
from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.ops.numeric import max_violation, to_storage
from ckgen.ops.pool import maxpool2d_reference
from ckgen.ops.spec import Config

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("CKGEN_FUZZ_SEED", "16"))
SCALE = float(os.environ.get("CKGEN_FUZZ_SCALE", "1"))
CHUNK = 50  # problems per test (a failure report lists every bad problem of its chunk)
MAX_NUMEL = 1 << 19  # elements of x: keeps the float64 references and the run short
# family -> (problems, ops with their share of them)
FAMILIES = {
    "groupnorm_fwd": (300, {"groupnorm_fwd": 1.0}),
    "groupnorm_bwd": (300, {"groupnorm_bwd": 0.6, "groupnorm_bwd_data": 0.2, "groupnorm_bwd_gamma_beta": 0.2}),
    "maxpool2d": (300, {"maxpool2d_fwd": 0.5, "maxpool2d_bwd": 0.5}),
    "avgpool2d": (300, {"avgpool2d_fwd": 0.5, "avgpool2d_bwd": 0.5}),
}
POOL_CONFIGS = 2  # seeded random configs per instance class (op, dtype, layout[, activation | geometry])
GEOMETRIES = 8  # random pooling geometries per pooling op (each a compiled kernel family)
DTYPES, LAYOUTS = ("fp32", "fp16", "bf16"), ("nchw", "nhwc")


@dataclass
class Case:
    family: str
    index: int
    op: str
    problem: Any
    special: bool = False  # pooling: NaN / +-inf / -inf planes in the inputs
    no_affine: bool = False  # groupnorm_fwd: gamma = beta = None
    configs: list[Config] = field(default_factory=list)

    def seed(self) -> list[int]:
        return [SEED, list(FAMILIES).index(self.family), self.index]

    def where(self) -> str:
        return f"CKGEN_FUZZ_SEED={SEED} {self.family}[{self.index}] {self.op} {self.problem.key()}"


# ---------------------------------------------------------------------------------------------
# problems
# ---------------------------------------------------------------------------------------------
def _pick_op(rng: random.Random, shares: dict[str, float]) -> str:
    return rng.choices(list(shares), weights=list(shares.values()))[0]


GN_EDGES = [  # (N, C, H, W, G): the edges first
    (4, 64, 1, 1, 16),  # HW = 1
    (2, 24, 13, 11, 1),  # G = 1
    (2, 48, 7, 9, 48),  # G = C
    (1, 40, 17, 19, 8),  # N = 1, odd sizes
    (1, 64, 96, 96, 4),  # a slice too large for one block
    (3, 10, 1, 7, 5),  # C/G = 2, H = 1
    (2, 320, 5, 3, 32),  # C/G = 10 (not a multiple of the vector width)
    (1, 3, 2, 2, 3),  # tiny
]


def _gn_shape(rng: random.Random) -> tuple[int, int, int, int, int]:
    G = rng.choice([1, 2, 3, 4, 5, 6, 8, 16, 32])
    Cg = rng.choice([1, 1, 2, 3, 4, 5, 7, 8, 10, 16, 20, 40])
    if rng.random() < 0.1:
        G, Cg = G * Cg, 1  # G = C
    r = rng.random()
    if r < 0.12:
        H = W = 1
    elif r < 0.2:
        H, W = 1, rng.randint(1, 64)
    elif r < 0.28:
        H = W = rng.choice([32, 48, 64, 80])
    else:
        H, W = rng.randint(1, 40), rng.randint(1, 40)
    N = rng.choice([1, 1, 2, 2, 3, 4])
    while N * G * Cg * H * W > MAX_NUMEL:
        if N > 1:
            N -= 1
        elif H * W > 1:
            H, W = max(1, H // 2), max(1, W // 2)
        else:
            Cg = max(1, Cg // 2)
    return N, G * Cg, H, W, G


def gn_cases(family: str, count: int, rng: random.Random) -> list[Case]:
    shares = FAMILIES[family][1]
    out = []
    for i in range(count):
        N, C, H, W, G = GN_EDGES[i] if i < len(GN_EDGES) else _gn_shape(rng)
        op = _pick_op(rng, shares) if i >= len(GN_EDGES) else list(shares)[i % len(shares)]
        p = get_op(op).parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=rng.choice(DTYPES), layout=rng.choice(LAYOUTS),
                                     activation=rng.choice(["none", "swish"]))
        out.append(Case(family, i, op, p, no_affine=op == "groupnorm_fwd" and rng.random() < 0.1))
    return out


def _geometry(rng: random.Random, op: str) -> dict[str, Any]:
    kh = rng.randint(1, 5)
    kw = kh if rng.random() < 0.4 else rng.randint(1, 5)
    sh, sw = rng.choice([1, 1, 2, 2, 3]), rng.choice([1, 2, 2, 3])
    if rng.random() < 0.3:
        sw = sh
    geo: dict[str, Any] = dict(kernel=(kh, kw), stride=(sh, sw), padding=(rng.randint(0, kh // 2), rng.randint(0, kw // 2)),
                               ceil_mode=rng.random() < 0.4)
    if op.startswith("max"):
        geo["dilation"] = rng.choice([(1, 1), (1, 1), (2, 1), (1, 2), (2, 2), (3, 2)])
    if op == "maxpool2d_fwd":
        geo["return_indices"] = rng.random() < 0.5
    elif op == "maxpool2d_bwd":
        geo["indices"] = rng.choice(["stored", "recompute"])
    else:
        geo["count_include_pad"] = rng.random() < 0.6
        geo["divisor_override"] = rng.choice([0, 0, 0, 0, 1, 5, 7]) or None
    return geo


FIXED_GEOMETRIES = [  # one of each kind, beside the random ones
    dict(kernel=(3, 3), stride=(2, 2), padding=(1, 1), ceil_mode=True),  # ceil_mode overhang
    dict(kernel=(1, 1), stride=(1, 1), padding=(0, 0)),  # identity
    dict(kernel=(2, 3), stride=(3, 4), padding=(0, 1)),  # stride > kernel: gaps
]


def _pool_geometries(rng: random.Random, op: str) -> list[dict[str, Any]]:
    geos = []
    for g in FIXED_GEOMETRIES:
        extra = {k: v for k, v in _geometry(rng, op).items() if k not in ("kernel", "stride", "padding", "ceil_mode")}
        geos.append({**g, **extra})
    geos += [_geometry(rng, op) for _ in range(GEOMETRIES)]
    return geos


def pool_cases(family: str, count: int, rng: random.Random) -> list[Case]:
    shares = FAMILIES[family][1]
    geos = {op: _pool_geometries(rng, op) for op in shares}
    out = []
    i = 0
    while len(out) < count:
        op = _pick_op(rng, shares)
        geo = geos[op][i % len(geos[op])] if i < 2 * len(geos[op]) else rng.choice(geos[op])
        ek = [(k - 1) * d + 1 for k, d in zip(geo["kernel"], geo.get("dilation", (1, 1)))]
        lo = [max(1, e - 2 * p) for e, p in zip(ek, geo["padding"])]  # the smallest input with an output
        small = rng.random() < 0.12  # the smallest input: often HW = 1
        H = lo[0] if small else rng.randint(lo[0], lo[0] + 30)
        W = lo[1] if small else rng.randint(lo[1], lo[1] + 30)
        C = rng.choice([1, 2, 3, 5, 8, 13, 16, 24, 32, 40, 64])
        N = rng.choice([1, 1, 2, 3])
        while N * C * H * W > MAX_NUMEL and C > 1:
            C //= 2
        try:
            p = get_op(op).parse_problem(N=N, C=C, H=H, W=W, dtype=rng.choice(DTYPES), layout=rng.choice(LAYOUTS),
                                         **geo)
        except ValueError:  # e.g. a ceil_mode corner without an output: draw again
            continue
        out.append(Case(family, len(out), op, p, special=op != "avgpool2d_bwd" and rng.random() < 0.5))
        i += 1
    return out


def all_cases() -> dict[str, list[Case]]:
    out = {}
    for family, (count, _) in FAMILIES.items():
        rng = random.Random(f"ckgen-fuzz-{SEED}-{family}")
        n = max(len(GN_EDGES), int(round(count * SCALE)))
        out[family] = (gn_cases if family.startswith("groupnorm") else pool_cases)(family, n, rng)
    return out


# ---------------------------------------------------------------------------------------------
# configs: what the dispatcher picks, plus one of a small seeded pool per instance class
# ---------------------------------------------------------------------------------------------
def _class(case: Case) -> tuple[str, str]:
    """What picks the kernel besides the config: the problem key without the shape (GroupNorm:
    dtype, layout, activation; pooling: its parameters, dtype, layout, flags)."""
    shape_fields = 5 if case.op.startswith("groupnorm") else 4
    return case.op, ",".join(case.problem.key().split(",")[shape_fields:])


def plan(cases: dict[str, list[Case]], target: Any, dispatcher: Any) -> list[Any]:
    """Sets every case's configs; returns every source they need (for one parallel compile)."""
    sources: dict[str, Any] = {}
    pools: dict[tuple, list[Config]] = {}
    for case in itertools.chain.from_iterable(cases.values()):
        op = get_op(case.op)
        choice, src = dispatcher.choose(op, case.problem, target)
        case.configs = [choice.config]
        sources[src.sha256] = src
        key = _class(case)
        if key not in pools:
            rng = random.Random(f"ckgen-fuzz-{SEED}-{key}")
            space = list(op.space.enumerate())
            pools[key] = rng.sample(space, min(len(space), 8 * POOL_CONFIGS))
        rng = random.Random(f"ckgen-fuzz-{SEED}-{case.family}-{case.index}")
        usable = [c for c in pools[key] if c != choice.config and op.validate(case.problem, c, target)]
        usable = usable[:POOL_CONFIGS * 2]
        if usable:
            c = rng.choice(usable)
            case.configs.append(c)
            src = render_instance(op, case.problem, c, target)
            sources[src.sha256] = src
    return list(sources.values())


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
def make_inputs(case: Case) -> dict[str, np.ndarray]:
    op, p = get_op(case.op), case.problem
    rng = np.random.default_rng(case.seed())
    inputs = op.make_inputs(p, rng)
    if case.no_affine:
        inputs.pop("gamma", None)
        inputs.pop("beta", None)
    if case.special and case.op.startswith("max"):  # ties come from make_inputs (a coarse grid)
        x = inputs["x"]
        m = rng.random(x.shape)
        x[m < 0.03] = np.nan
        x[(m >= 0.03) & (m < 0.05)] = np.inf
        x[m > 0.92] = -np.inf
        x[rng.integers(p.N), rng.integers(p.C)] = -np.inf  # a whole plane: every window all -inf
        if "indices" in inputs:  # stored indices: the forward's, on these values
            inputs["indices"] = maxpool2d_reference(p, x)[1]
    elif case.special:  # avg forward: NaN and +-inf propagate (any order of the sum gives the same)
        x = inputs["x"]
        m = rng.random(x.shape)
        x[m < 0.01] = np.nan
        x[(m >= 0.01) & (m < 0.02)] = np.inf
        x[m > 0.99] = -np.inf
    return inputs


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------
CASES = all_cases()
CHUNKS = [(family, k) for family, cases in CASES.items() for k in range(-(-len(cases) // CHUNK))]


@pytest.fixture(scope="module")
def target():
    from ckgen.runtime.target import current_target

    return current_target()


@pytest.fixture(scope="module")
def planned(target, tmp_path_factory):
    """The dispatcher's view a user has on this GPU (the packaged DB, no user DB); every case's
    configs; every instance compiled in parallel into the cubin cache first."""
    from ckgen.runtime import db as dbmod
    from ckgen.runtime.compile import compile_many
    from ckgen.runtime.dispatch import Dispatcher

    with pytest.MonkeyPatch.context() as m:
        m.setenv("CKGEN_SHIPPED_DB", str(dbmod.packaged_db_path()))
        m.setenv("CKGEN_DB", str(tmp_path_factory.mktemp("fuzz") / "no-user-db.yaml"))
        m.setenv("CKGEN_QUIET", "1")  # no fallback notice per problem
        d = Dispatcher()
        sources = plan(CASES, target, d)
    failures = compile_many(sources, target)
    assert not failures, list(failures.values())[:3]
    return CASES


@pytest.mark.parametrize("family,chunk", CHUNKS, ids=[f"{f}-{k}" for f, k in CHUNKS])
def test_fuzz_matches_reference(family, chunk, planned, target):
    from ckgen.runtime.verify import Harness

    bad = []
    for case in planned[family][chunk * CHUNK:(chunk + 1) * CHUNK]:
        op = get_op(case.op)
        with np.errstate(invalid="ignore"):  # inf - inf in the avg reference: NaN, as on the GPU
            h = Harness(op, case.problem, inputs=make_inputs(case))
        for c in case.configs:
            chk = h.check(h.runner(render_instance(op, case.problem, c, target), c, target))
            if not chk.ok:
                bad.append(f"{case.where()} config {c.key()}: {chk.detail}")
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad)


# ---- the public API on a quarter of the problems (CuPy inputs; every CuPy allocation poisoned)
@pytest.fixture
def poisoned_allocations():
    """Every CuPy allocation (so every output ckgen allocates) starts as all-ones bits, NaN in
    every float dtype: an output element a kernel does not write fails the check."""
    import cupy

    pool = cupy.get_default_memory_pool()

    def alloc(size: int):
        mem = pool.malloc(size)
        if size:
            mem.memset_async(0xFF, size)
        return mem

    cupy.cuda.set_allocator(alloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(pool.malloc)


def _image(p: Any, a: np.ndarray, storage: bool = True) -> Any:
    """A logical (N, C, h, w) host array -> a device array in p's layout (bf16: ckgen.bfloat16)."""
    import cupy

    import ckgen

    flat = np.ascontiguousarray(a if p.layout == "nchw" else np.transpose(a, (0, 2, 3, 1)))
    dev = cupy.asarray(to_storage(flat, p.dtype) if storage else flat)
    if p.layout == "nhwc":
        dev = dev.transpose(0, 3, 1, 2)
    return ckgen.bfloat16(dev) if storage and p.dtype == "bf16" else dev


def _vector(p: Any, a: np.ndarray | None) -> Any:
    import cupy

    import ckgen

    if a is None:
        return None
    dev = cupy.asarray(to_storage(a, p.dtype))
    return ckgen.bfloat16(dev) if p.dtype == "bf16" else dev


def _flat(out: Any, layout: str) -> Any:
    """An output of the public API -> its bits, flat in device memory order."""
    import cupy

    import ckgen

    a = out.data if isinstance(out, ckgen.bfloat16) else out
    if a.ndim == 4 and layout == "nhwc":
        a = a.transpose(0, 2, 3, 1)
    return cupy.ascontiguousarray(a).ravel()


def _call_api(case: Case, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    import cupy

    import ckgen

    p, name = case.problem, case.op
    if name.startswith("groupnorm"):
        x, g, b = _image(p, inputs["x"]), _vector(p, inputs.get("gamma")), _vector(p, inputs.get("beta"))
        act = None if p.activation == "none" else p.activation
        if name == "groupnorm_fwd":
            y, mean, rstd = ckgen.groupnorm_fwd(x, g, b, p.G, eps=1e-5, activation=act)
            return {"y": y, "mean": mean, "rstd": rstd}
        dy = _image(p, inputs["dy"])
        mean, rstd = (cupy.asarray(inputs[k].astype(np.float32).reshape(p.N, p.G)) for k in ("mean", "rstd"))
        if name == "groupnorm_bwd":
            dx, dg, db = ckgen.groupnorm_bwd(dy, x, mean, rstd, g, p.G, b, activation=act)
            return {"dx": dx, "dgamma": dg, "dbeta": db}
        if name == "groupnorm_bwd_data":
            return {"dx": ckgen.groupnorm_bwd_data(dy, x, mean, rstd, g, p.G, b, activation=act)}
        dg, db = ckgen.groupnorm_bwd_gamma_beta(dy, x, mean, rstd, p.G, g, b, activation=act)
        return {"dgamma": dg, "dbeta": db}
    geo = dict(kernel_size=p.kernel, stride=p.stride, padding=p.padding, ceil_mode=p.ceil_mode)
    x = _image(p, inputs["x"])
    if name == "maxpool2d_fwd":
        out = ckgen.maxpool2d_fwd(x, **geo, dilation=p.dilation, return_indices=p.return_indices)
        return {"y": out[0], "indices": out[1]} if p.return_indices else {"y": out}
    if name == "maxpool2d_bwd":
        ind = _image(p, inputs["indices"], storage=False) if p.indices == "stored" else None
        return {"dx": ckgen.maxpool2d_bwd(_image(p, inputs["dy"]), x, **geo, dilation=p.dilation, indices=ind)}
    avg = dict(count_include_pad=p.count_include_pad, divisor_override=p.divisor_override or None)
    if name == "avgpool2d_fwd":
        return {"y": ckgen.avgpool2d_fwd(x, **geo, **avg)}
    return {"dx": ckgen.avgpool2d_bwd(_image(p, inputs["dy"]), x, **geo, **avg)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fuzz_public_api_matches_reference(family, planned, poisoned_allocations, monkeypatch, tmp_path):
    """The same dispatcher view as the planned configs (so every instance is compiled already)."""
    import cupy

    import ckgen
    from ckgen.runtime import db as dbmod

    monkeypatch.setenv("CKGEN_SHIPPED_DB", str(dbmod.packaged_db_path()))
    monkeypatch.setenv("CKGEN_DB", str(tmp_path / "no-user-db.yaml"))
    monkeypatch.setenv("CKGEN_QUIET", "1")
    ckgen.reload_db()
    bad = []
    try:
        for case in planned[family][::4]:
            op, p = get_op(case.op), case.problem
            inputs = make_inputs(case)
            if case.op == "groupnorm_fwd" and p.N * p.Cg * p.HW == 1:
                # one value per group: the public op refuses it before any launch, as F.group_norm
                # does (the kernels themselves are fuzzed on it by test_fuzz_matches_reference)
                with pytest.raises(ValueError, match=r"^x: .*N\*\(C/groups\)\*H\*W = 1"):
                    _call_api(case, inputs)
                continue
            with np.errstate(invalid="ignore"):
                ref = op.reference(p, inputs)
            got = _call_api(case, inputs)
            cupy.cuda.get_current_stream().synchronize()
            unpacked = op.unpack_outputs(p, {k: _flat(v, p.layout) for k, v in got.items()})
            for k, want in ref.items():
                tol = op.problem_tolerance(p, k)
                v = max_violation(unpacked[k], cupy.asarray(want), tol.atol, tol.rtol)
                if not v <= 1.0:
                    bad.append(f"{case.where()} via ckgen.{case.op}: {k} error {v:.3g}x tolerance")
    finally:
        ckgen.reload_db()
    assert not bad, f"{len(bad)} failed:\n" + "\n".join(bad)
