"""GPU tier: the dispatch fast path. Launch plans give the same results as the first call, every
op captures and replays in a CUDA graph (torch.cuda.graph and CuPy stream capture), also with
configs that need a workspace, misaligned pointers get their own plan, a DB write invalidates
the plans, calls from a new thread work, and bad arguments still raise after a good call of the
same signature."""
from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

import ckgen  # noqa: E402
from ckgen.runtime import db as dbmod  # noqa: E402
from ckgen import settings  # noqa: E402
from ckgen.instance import render_instance  # noqa: E402
from ckgen.ops import get_op  # noqa: E402
from ckgen.ops.spec import Config  # noqa: E402

pytestmark = pytest.mark.gpu

OPS = ["groupnorm_fwd", "groupnorm_fwd_swish", "groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta",
       "maxpool2d_fwd", "maxpool2d_fwd_indices", "maxpool2d_bwd", "maxpool2d_bwd_recompute", "avgpool2d_fwd",
       "avgpool2d_bwd"]
GN = (2, 64, 32, 30, 8)  # N, C, H, W, G
POOL = (2, 16, 13, 11)  # N, C, H, W; k3 s2 p1 (overlapping windows)
K, S, P = 3, 2, 1


@pytest.fixture(autouse=True)
def _fresh_dispatcher():
    ckgen.reload_db()
    yield
    ckgen.reload_db()


def _fmt(layout):
    return torch.channels_last if layout == "nhwc" else torch.contiguous_format


def make_inputs(name: str, layout: str, dtype=torch.bfloat16) -> dict:
    """Fresh random inputs of one op call (torch tensors, `layout`)."""
    f = _fmt(layout)
    if name.startswith("groupnorm"):
        N, C, H, W, G = GN
        x = (torch.randn(N, C, H, W, device="cuda") + 0.5).to(dtype).contiguous(memory_format=f)
        d = {"x": x, "gamma": (1 + 0.2 * torch.randn(C, device="cuda")).to(dtype),
             "beta": (0.2 * torch.randn(C, device="cuda")).to(dtype)}
        if "bwd" in name:
            _, mean, rstd = ckgen.groupnorm_fwd(x, d["gamma"], d["beta"], G)
            d.update(dy=torch.randn(N, C, H, W, device="cuda").to(dtype).contiguous(memory_format=f),
                     mean=mean, rstd=rstd)
        return d
    N, C, H, W = POOL
    x = torch.randn(N, C, H, W, device="cuda").to(dtype).contiguous(memory_format=f)
    d = {"x": x}
    if "bwd" in name:
        y, idx = ckgen.maxpool2d_fwd(x, K, S, P, return_indices=True)
        d["dy"] = torch.randn(y.shape, device="cuda").to(dtype).contiguous(memory_format=f)
        if name == "maxpool2d_bwd":
            d["indices"] = idx
    return d


def call(name: str, d: dict):
    """Run op `name` on inputs `d` (torch tensors or CuPy arrays); returns a tuple of outputs."""
    G = GN[4]
    if name == "groupnorm_fwd":
        return ckgen.groupnorm_fwd(d["x"], d["gamma"], d["beta"], G)
    if name == "groupnorm_fwd_swish":
        return ckgen.groupnorm_fwd(d["x"], d["gamma"], d["beta"], G, activation="swish")
    if name == "groupnorm_bwd":
        return ckgen.groupnorm_bwd(d["dy"], d["x"], d["mean"], d["rstd"], d["gamma"], G, d["beta"])
    if name == "groupnorm_bwd_data":
        return (ckgen.groupnorm_bwd_data(d["dy"], d["x"], d["mean"], d["rstd"], d["gamma"], G, d["beta"]),)
    if name == "groupnorm_bwd_gamma_beta":
        return ckgen.groupnorm_bwd_gamma_beta(d["dy"], d["x"], d["mean"], d["rstd"], G, d["gamma"], d["beta"])
    if name == "maxpool2d_fwd":
        return (ckgen.maxpool2d_fwd(d["x"], K, S, P),)
    if name == "maxpool2d_fwd_indices":
        return ckgen.maxpool2d_fwd(d["x"], K, S, P, return_indices=True)
    if name in ("maxpool2d_bwd", "maxpool2d_bwd_recompute"):
        return (ckgen.maxpool2d_bwd(d["dy"], d["x"], K, S, P, indices=d.get("indices")),)
    if name == "avgpool2d_fwd":
        return (ckgen.avgpool2d_fwd(d["x"], K, S, P),)
    if name == "avgpool2d_bwd":
        return (ckgen.avgpool2d_bwd(d["dy"], d["x"], K, S, P),)
    raise AssertionError(name)


def problem_of(name: str, layout: str, dtype: str = "bf16"):
    op_name = {"groupnorm_fwd_swish": "groupnorm_fwd", "maxpool2d_fwd_indices": "maxpool2d_fwd",
               "maxpool2d_bwd_recompute": "maxpool2d_bwd"}.get(name, name)
    op = get_op(op_name)
    if op_name.startswith("groupnorm"):
        N, C, H, W, G = GN
        return op, op.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=dtype, layout=layout,
                                    activation="swish" if name.endswith("swish") else "none")
    N, C, H, W = POOL
    extra = {}
    if op_name == "maxpool2d_fwd":
        extra["return_indices"] = name.endswith("indices")
    if op_name == "maxpool2d_bwd":
        extra["indices"] = "recompute" if name.endswith("recompute") else "stored"
    return op, op.parse_problem(N=N, C=C, H=H, W=W, dtype=dtype, layout=layout, kernel=K, stride=S, padding=P,
                                **extra)


WORKSPACE = {  # a config family that needs a workspace, per op (where the op has one)
    "groupnorm_fwd": lambda c: c["merge"] == "global",
    "groupnorm_fwd_swish": lambda c: c["merge"] == "global",
    "groupnorm_bwd": lambda c: c["scheme"] == "multi_stage",
    "groupnorm_bwd_data": lambda c: c["scheme"] == "multi_stage",
    "groupnorm_bwd_gamma_beta": lambda c: True,  # the dgamma/dbeta partial rows
    "maxpool2d_bwd": lambda c: c["algo"] == "scatter",
    "maxpool2d_bwd_recompute": lambda c: c["algo"] == "scatter",
    "avgpool2d_bwd": lambda c: c["algo"] == "scatter",
}


def force(name: str, layout: str, pred, dtype: str = "bf16", workspace: bool = False) -> Config:
    """Write a user-DB entry so the dispatcher picks a config satisfying `pred` for this call."""
    from ckgen.runtime.target import current_target

    target = current_target()
    op, p = problem_of(name, layout, dtype)
    config = next(c for c in op.space.enumerate() if op.validate(p, c, target) and pred(c))
    if workspace:
        assert op.workspace_bytes(p, config) > 0, config
    src = render_instance(op, p, config, target)
    dbmod.save_entries(settings.user_db_path(), [dbmod.Entry(
        op=op.name, vendor=target.vendor, arch=target.arch, device="test", problem=p.key(), config=config.items,
        instance=src.name, source_sha256=src.sha256, time_us=1.0, gbps=1.0, default_time_us=1.0,
        provenance={"date": "2026-01-01T00:00:00+00:00"})])
    return config


def _refill(d: dict) -> None:
    """New random values into the floating-point inputs, in place (graph inputs are static)."""
    for k, t in d.items():
        if k in ("mean", "rstd", "indices"):
            continue
        t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))


# Configs whose results may differ in the last bit from run to run: the pooling backward's
# scatter algorithm adds overlapping windows' gradients with fp32 atomics, in no fixed order
# (templates/common/pool2d_bwd.cuh.j2). A replay is compared with an eager call within one
# rounding of the output dtype there, bit for bit everywhere else.
SCATTER = ("maxpool2d_bwd", "maxpool2d_bwd_recompute", "avgpool2d_bwd")
ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def _same(a, b, exact: bool = True) -> None:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    if exact or a.dtype not in ULP:
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()
    else:
        # one rounding of a sum of a few fp32 terms: <= 1 ulp of the largest magnitude involved
        tol = 2 * ULP[a.dtype] * b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= tol, ((a.float() - b.float()).abs().max(), tol)


@pytest.mark.parametrize("workspace", [False, True])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("name", OPS)
def test_torch_cuda_graph_capture_and_replay(name, layout, workspace):
    if workspace:
        if name not in WORKSPACE:
            pytest.skip("this op has no config with a workspace")
        config = force(name, layout, WORKSPACE[name], workspace=True)
    d = make_inputs(name, layout)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call(name, d)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = call(name, d)
    for _ in range(2):  # replay twice on fresh data: each replay reads the inputs anew
        _refill(d)
        g.replay()
        torch.cuda.synchronize()
        eager = call(name, d)
        for a, b in zip(captured, eager):
            _same(a, b, exact=not (workspace and name in SCATTER))
    if workspace:
        choice = _explain(name, d)
        assert choice.source == "tuned" and choice.config == config, choice


GRID_BARRIER = {  # (op, variant) -> a config family of one cooperative launch with a barrier
    ("groupnorm_fwd", "rows"): lambda c: c["merge"] == "grid" and c["slice_in"] == "rows",
    ("groupnorm_fwd", "regs"): lambda c: c["merge"] == "grid" and c["slice_in"] == "regs",
    ("groupnorm_fwd_swish", "rows"): lambda c: c["merge"] == "grid" and c["slice_in"] == "rows",
    ("groupnorm_fwd_swish", "regs"): lambda c: c["merge"] == "grid" and c["slice_in"] == "regs",
    # the backward's single_pass/fused past a cluster (split > 8): a grid-wide barrier
    ("groupnorm_bwd", "fused"): lambda c: c["scheme"] == "fused" and c["split"] > 8,
    ("groupnorm_bwd_data", "fused"): lambda c: c["scheme"] == "fused" and c["split"] > 8,
}


@pytest.mark.parametrize("name,slice_in", GRID_BARRIER)
def test_torch_cuda_graph_capture_of_a_grid_barrier_kernel(name, slice_in):
    """GroupNorm forward merge=grid and backward split > 8 (one cooperative launch, blocks meeting
    at a barrier whose counters live in the workspace) eager, captured into a CUDA graph and
    replayed on fresh data: the same bits as an eager call each time (the counters reset themselves)."""
    config = force(name, "nhwc", GRID_BARRIER[name, slice_in], workspace=True)
    from ckgen.runtime.target import current_target

    op, p = problem_of(name, "nhwc")
    assert any(launch.cooperative for launch in op.launches(p, config, current_target()))
    d = make_inputs(name, "nhwc")
    first = call(name, d)
    for a, b in zip(first, call(name, d)):  # a second eager call reuses the kept workspace
        _same(a, b)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(name, d)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        captured = call(name, d)
    for _ in range(3):
        _refill(d)
        g.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, call(name, d)):
            _same(a, b)
    choice = _explain(name, d)
    assert choice.source == "tuned" and choice.config == config, choice


def _explain(name: str, d: dict):
    G = GN[4]
    op = problem_of(name, "nchw")[0].name
    if name.startswith("groupnorm_fwd"):
        return ckgen.explain(op, d["x"], d["gamma"], d["beta"], G, activation="swish" if "swish" in name else None)
    if name in ("groupnorm_bwd", "groupnorm_bwd_data"):
        return ckgen.explain(op, d["dy"], d["x"], d["mean"], d["rstd"], d["gamma"], G, d["beta"])
    if name == "groupnorm_bwd_gamma_beta":
        return ckgen.explain(op, d["dy"], d["x"], d["mean"], d["rstd"], G, d["gamma"], d["beta"])
    if name.startswith("maxpool2d_fwd"):
        return ckgen.explain(op, d["x"], K, S, P, return_indices=name.endswith("indices"))
    if name.startswith("maxpool2d_bwd"):
        return ckgen.explain(op, d["dy"], d["x"], K, S, P, indices=d.get("indices"))
    if name == "avgpool2d_fwd":
        return ckgen.explain(op, d["x"], K, S, P)
    return ckgen.explain(op, d["dy"], d["x"], K, S, P)


def _to_cupy(d: dict) -> dict:
    return {k: cupy.from_dlpack(v.detach()) for k, v in d.items()}


@pytest.mark.parametrize("workspace", [False, True])
@pytest.mark.parametrize("name", OPS)
def test_cupy_stream_capture_and_replay(name, workspace):
    if workspace:
        if name not in WORKSPACE:
            pytest.skip("this op has no config with a workspace")
        force(name, "nhwc", WORKSPACE[name], dtype="fp16", workspace=True)
    d = make_inputs(name, "nhwc", torch.float16)
    torch.cuda.synchronize()
    c = _to_cupy(d)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        for _ in range(2):
            call(name, c)
        s.synchronize()
        s.begin_capture()
        captured = call(name, c)
        graph = s.end_capture()
        for _ in range(2):
            _refill(d)  # torch writes the same memory the CuPy arrays view
            torch.cuda.synchronize()
            graph.launch(s)
            s.synchronize()
            eager = call(name, c)
            s.synchronize()
            for a, b in zip(captured, eager):
                assert a.shape == b.shape and a.strides == b.strides
                _same(torch.from_dlpack(a), torch.from_dlpack(b), exact=not (workspace and name in SCATTER))
        if workspace:
            assert _explain(name, c).source == "tuned"


@pytest.mark.parametrize("name", ["groupnorm_fwd", "groupnorm_bwd", "maxpool2d_fwd", "avgpool2d_bwd"])
def test_misaligned_pointers_get_their_own_plan(name):
    """The same shape at an address 2 bytes off 16: a plan with narrower vectors, right results,
    and the aligned call after it still uses its own plan."""
    d = make_inputs(name, "nhwc")
    ref = call(name, d)
    mis = {}
    for k, t in d.items():
        if k in ("mean", "rstd", "indices") or t.dim() < 4:
            mis[k] = t
            continue
        buf = torch.empty(t.numel() + 8, device="cuda", dtype=t.dtype)
        view = buf[1:1 + t.numel()].view(t.shape[0], t.shape[2], t.shape[3], t.shape[1]).permute(0, 3, 1, 2)
        view.copy_(t)
        assert view.data_ptr() % 16 == 2
        mis[k] = view
    c_al, c_mis = _explain(name, d), _explain(name, mis)
    assert c_mis.config["vec_bytes"] <= 2, c_mis
    got = call(name, mis)
    again = call(name, d)
    for a, b, r in zip(got, again, ref):
        _same(b, r)  # the aligned plan again: bitwise the first result
        tol = 0.05 if name.startswith("groupnorm") else 0.0  # another config: another rounding order
        assert (a.float() - r.float()).abs().max().item() <= tol * max(1.0, r.float().abs().max().item())
    assert c_al.config == _explain(name, d).config


def test_db_write_invalidates_plans():
    """A DB entry written in this process (as `ckgen tune` does) is used by the next call."""
    d = make_inputs("maxpool2d_fwd", "nchw")
    first = _explain("maxpool2d_fwd", d)
    call("maxpool2d_fwd", d)
    other = force("maxpool2d_fwd", "nchw", lambda c: Config.of(c.as_dict()) != first.config)
    now = _explain("maxpool2d_fwd", d)
    assert now.source == "tuned" and now.config == other != first.config
    y = call("maxpool2d_fwd", d)[0]
    _same(y, torch.nn.functional.max_pool2d(d["x"], K, S, P))


def test_call_from_a_new_thread():
    d = make_inputs("groupnorm_fwd", "nhwc")
    want = call("groupnorm_fwd", d)
    got: list = []
    errors: list = []

    def run():
        try:
            got.append(call("groupnorm_fwd", d))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
    for a, b in zip(got[0], want):
        _same(a, b)


def test_launches_on_torchs_current_stream():
    d = make_inputs("avgpool2d_fwd", "nchw")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # keep the stream busy: a launch elsewhere would run first
        y = call("avgpool2d_fwd", d)[0]
        y.add_(1)  # ordered after ckgen's kernel only on the same stream
    s.synchronize()
    _same(y, torch.nn.functional.avg_pool2d(d["x"], K, S, P) + 1)


def test_bad_arguments_still_raise_after_a_cached_call():
    d = make_inputs("groupnorm_fwd", "nchw")
    x, g, b = d["x"], d["gamma"], d["beta"]
    ckgen.groupnorm_fwd(x, g, b, 8)
    ckgen.maxpool2d_fwd(x, 3, 2, 1)
    bad = [
        (lambda: ckgen.groupnorm_fwd(x, g, b, 8.0), ValueError, "groups"),
        (lambda: ckgen.groupnorm_fwd(x, g, b, True), ValueError, "groups"),
        (lambda: ckgen.groupnorm_fwd(x, g, b, 8, eps=float("nan")), ValueError, "eps"),
        (lambda: ckgen.groupnorm_fwd(x, g, b, 8, eps=1e39), ValueError, "eps"),
        (lambda: ckgen.groupnorm_fwd(x, g, b, 8, eps=10 ** 400), ValueError, "eps"),
        (lambda: ckgen.groupnorm_fwd(x, g, b, 8, eps=None), ValueError, "eps"),
        (lambda: ckgen.groupnorm_fwd(x, g, b, 8, activation="tanh"), ValueError, "activation"),
        (lambda: ckgen.groupnorm_fwd(x, g[:8], b, 8), ValueError, "gamma"),
        (lambda: ckgen.groupnorm_fwd(x.float(), g, b, 8), TypeError, "gamma"),
        (lambda: ckgen.groupnorm_fwd(x.cpu(), g, b, 8), TypeError, "x"),
        (lambda: ckgen.maxpool2d_fwd(x, 3.0, 2, 1), ValueError, "kernel_size"),
        (lambda: ckgen.maxpool2d_fwd(x, 3, 2, 2), ValueError, "padding"),
        (lambda: ckgen.maxpool2d_fwd(x, 3, 2, 1, ceil_mode="no"), TypeError, "ceil_mode"),
        (lambda: ckgen.maxpool2d_fwd(x, 3, 2, 1, return_indices=2), TypeError, "return_indices"),
    ]
    for fn, exc, word in bad:
        with pytest.raises(exc) as ei:
            fn()
        assert str(ei.value).startswith(word + ":"), str(ei.value)
    # NumPy scalars and lists are taken (through the full checks) and give the same results
    y1 = ckgen.groupnorm_fwd(x, g, b, 8, eps=1e-5)[0]
    y2 = ckgen.groupnorm_fwd(x, g, b, np.int64(8), eps=np.float32(1e-5))[0]
    _same(y1, y2)
    _same(ckgen.maxpool2d_fwd(x, [3, 3], (2, 2), np.int64(1)), ckgen.maxpool2d_fwd(x, 3, 2, 1))


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_groupnorm_bwd_one_kernel_tickets_hold_across_calls_streams_and_graphs(layout, split):
    """single_pass/fused groupnorm_bwd fold dgamma/dbeta in the last block of each channel tile,
    counted by ticket counters in the workspace that the kernel leaves at zero. Calls back to
    back, on a second stream (its own kept workspace) and replays of a captured graph (the
    graph's workspace, zeroed in the graph) all give PyTorch autograd's gradients, bit for bit
    the same from call to call."""
    import torch.nn.functional as F

    op = get_op("groupnorm_bwd")
    config = force("groupnorm_bwd", layout, lambda c: op.dgb_last(c) and (c["split"] > 1) == split)
    d = make_inputs("groupnorm_bwd", layout)
    G = GN[4]
    xd, gd, bd = (d[k].detach().double().requires_grad_() for k in ("x", "gamma", "beta"))
    F.group_norm(xd, G, gd, bd, 1e-5).backward(d["dy"].double())
    p = problem_of("groupnorm_bwd", layout)[1]

    def check(outs) -> None:
        for got, ref, name in zip(outs, (xd.grad, gd.grad, bd.grad), ("dx", "dgamma", "dbeta")):
            tol = op.problem_tolerance(p, name)
            torch.testing.assert_close(got.double(), ref, atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{name}: {m}")

    first = call("groupnorm_bwd", d)
    check(first)
    for _ in range(3):
        for a, b in zip(call("groupnorm_bwd", d), first):
            _same(a, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            got = call("groupnorm_bwd", d)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for a, b in zip(got, first):
        _same(a, b)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = call("groupnorm_bwd", d)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, first):
            _same(a, b)
    choice = _explain("groupnorm_bwd", d)
    assert choice.source == "tuned" and choice.config == config, choice
