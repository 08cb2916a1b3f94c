"""CPU tests of the dispatch fast path's generated launchers (no GPU): the argument buffer a
plan's launcher hands to cuLaunchKernel holds exactly `op.kernel_args` for the call's pointers,
outputs have the right shape, layout and dtype, and a workspace is kept per stream outside
stream capture and fresh under it. The CUDA calls are replaced by recorders; torch's CPU
tensors stand in for device tensors."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ckgen.runtime import dispatch, tensors  # noqa: E402
from ckgen.runtime.dispatch import Output  # noqa: E402
from ckgen.ops import get_op  # noqa: E402
from ckgen.runtime.tensors import DeviceTensor  # noqa: E402


class FakeCuda:
    """Stands in for cupy.cuda.runtime and driver.launchKernel: records every launch with the
    argument slots it would pass (read back through the kernel-parameter addresses)."""

    def __init__(self, nslots: int) -> None:
        self.nslots = nslots
        self.launches: list[tuple] = []
        self.cooperative: list[bool] = []  # launched through launchCooperativeKernel
        self.capturing = False

    def streamIsCapturing(self, stream: int) -> bool:  # noqa: N802 - CuPy's name
        return self.capturing

    def getDevice(self) -> int:  # noqa: N802
        return 0

    def memsetAsync(self, ptr: int, value: int, nbytes: int, stream: int) -> None:  # noqa: N802
        self.launches.append(("memset", ptr, value, nbytes, stream))

    def launch(self, f, gx, gy, gz, bx, by, bz, smem, stream, kargs, extra) -> None:
        addrs = [ctypes.c_uint64.from_address(kargs + 8 * i).value for i in range(self.nslots)]
        slots = [ctypes.string_at(a, 8) for a in addrs]
        self.launches.append((f, (gx, gy, gz), (bx, by, bz), smem, stream, slots))
        self.cooperative.append(extra is None)

    def launch_coop(self, f, gx, gy, gz, bx, by, bz, smem, stream, kargs) -> None:  # no `extra`
        self.launch(f, gx, gy, gz, bx, by, bz, smem, stream, kargs, None)


def _slots(args: tuple) -> list[bytes]:
    """op.kernel_args as the 8-byte slots the launcher fills (4-byte values in the low half)."""
    return [np.asarray(a).tobytes().ljust(8, b"\0") for a in args]


@pytest.fixture
def fake(monkeypatch):
    def make(op, problem):
        nslots = len(op.arg_names) + len(op.scalar_args(problem)) + (1 if op.takes_eps else 0) + len(op.tail_arg_names)
        cuda = FakeCuda(nslots)
        monkeypatch.setattr(dispatch, "_rt", cuda)
        monkeypatch.setattr(dispatch, "_launch_kernel", cuda.launch)
        monkeypatch.setattr(dispatch, "_launch_cooperative", cuda.launch_coop)
        monkeypatch.setattr(dispatch, "_multi_gpu", False)
        monkeypatch.setattr(tensors, "current_stream_fn", lambda ref: (lambda: 77))
        kept: list = []

        def keep_alloc(nbytes):  # CuPy's pool in real use; host memory here
            kept.append(torch.empty(nbytes, dtype=torch.uint8))
            return kept[-1], kept[-1].data_ptr()

        monkeypatch.setattr(dispatch, "_keep_alloc", keep_alloc)
        return cuda
    return make


def like_of(t) -> DeviceTensor:
    layout = "nhwc" if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous() else "nchw"
    return DeviceTensor(t, "torch", t.data_ptr(), tuple(t.shape), tuple(t.stride()),
                        {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[t.dtype], 0), layout


def plan_stub(name="test"):
    return SimpleNamespace(choice=SimpleNamespace(instance=name))


# (kernel, grid, block, shared memory, cooperative): the second a cooperative launch (merge=grid)
STEPS = [(1111, 8, 1, 1, 256, 1, 1, 0, False), (2222, 3, 2, 1, 128, 1, 1, 64, True)]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_groupnorm_fwd_launcher_passes_kernel_args(fake, layout):
    op = get_op("groupnorm_fwd")
    x = torch.randn(2, 64, 6, 5, dtype=torch.bfloat16)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    like, lay = like_of(x)
    p = op.parse_problem(N=2, C=64, H=6, W=5, G=8, dtype="bf16", layout=lay)
    cuda = fake(op, p)
    outs = [Output("y", like.shape, lay, "bf16"), Output("mean", (2, 8), "flat", "fp32"),
            Output("rstd", (2, 8), "flat", "fp32")]
    run, _ = dispatch._launcher(plan_stub(), op, p, like, ("x", "gamma", "beta"), outs, STEPS, 0)
    y, mean, rstd = run((x.data_ptr(), 4096, 0), 1e-5, x)
    assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == x.dtype
    assert mean.shape == (2, 8) and mean.dtype == torch.float32 and rstd.shape == (2, 8)
    want = _slots(op.kernel_args(p, {"x": x.data_ptr(), "gamma": 4096, "y": y.data_ptr(), "mean": mean.data_ptr(),
                                     "rstd": rstd.data_ptr()}, 1e-5))
    assert len(cuda.launches) == 2
    for (f, grid, block, smem, stream, slots), coop, step in zip(cuda.launches, cuda.cooperative, STEPS):
        assert (f, *grid, *block, smem, coop) == step and stream == 77
        assert slots == want
    # a second call: new outputs, the same scalars, the new pointers and eps
    y2, m2, r2 = run((x.data_ptr() + 64, 0, 8192), 0.5, x)
    assert y2.data_ptr() != y.data_ptr()
    want2 = _slots(op.kernel_args(p, {"x": x.data_ptr() + 64, "beta": 8192, "y": y2.data_ptr(), "mean": m2.data_ptr(),
                                      "rstd": r2.data_ptr()}, 0.5))
    assert cuda.launches[-1][-1] == want2


def test_fused_inputs_are_packed_after_eps(fake):
    """The residual and bias pointers go to the slots after eps (OpSpec.tail_arg_names)."""
    op = get_op("groupnorm_fwd")
    x = torch.randn(2, 64, 6, 5, dtype=torch.bfloat16)
    like, lay = like_of(x)
    p = op.parse_problem(N=2, C=64, H=6, W=5, G=8, dtype="bf16", layout=lay, activation="relu",
                         residual=True, bias_nc=True)
    cuda = fake(op, p)
    outs = [Output("y", like.shape, lay, "bf16"), Output("mean", (2, 8), "flat", "fp32"),
            Output("rstd", (2, 8), "flat", "fp32")]
    run, _ = dispatch._launcher(plan_stub(), op, p, like, ("x", "gamma", "beta", "res", "bias"), outs, STEPS[:1], 0)
    y, mean, rstd = run((x.data_ptr(), 0, 0, 4096, 8192), 1e-5, x)
    want = _slots(op.kernel_args(p, {"x": x.data_ptr(), "y": y.data_ptr(), "mean": mean.data_ptr(),
                                     "rstd": rstd.data_ptr(), "res": 4096, "bias": 8192}, 1e-5))
    assert cuda.launches[-1][-1] == want and want[-2:] == _slots((np.uint64(4096), np.uint64(8192)))


@pytest.mark.parametrize("ws_bytes", [256, 64 << 20])
def test_workspace_is_kept_per_stream_outside_capture_and_fresh_under_it(fake, ws_bytes):
    op = get_op("maxpool2d_bwd")
    x = torch.randn(2, 16, 9, 9, dtype=torch.float16)
    like, lay = like_of(x)
    p = op.parse_problem(N=2, C=16, H=9, W=9, dtype="fp16", layout=lay, kernel=3, stride=2, padding=1,
                         indices="recompute")
    cuda = fake(op, p)
    run, _ = dispatch._launcher(plan_stub(), op, p, like, ("x", "dy", "indices"),
                                [Output("dx", like.shape, lay, "fp16")], STEPS[:1], ws_bytes)
    ws_slot = op.arg_names.index("ws")

    def ws_ptr() -> int:
        return int.from_bytes(cuda.launches[-1][-1][ws_slot], "little")

    (dx,) = run((x.data_ptr(), 1024, 0), 0.0, x)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    first = ws_ptr()
    assert first != 0
    run((x.data_ptr(), 1024, 0), 0.0, x)
    if ws_bytes <= dispatch._KEEP_WS_BYTES:
        assert ws_ptr() == first  # kept for this stream
    cuda.capturing = True
    held = torch.empty(ws_bytes, dtype=torch.uint8)  # keeps the allocator from handing `first` back
    run((x.data_ptr(), 1024, 0), 0.0, x)
    assert ws_ptr() not in (0, first)  # under capture: the graph's own workspace
    del held


@pytest.mark.parametrize("ws_bytes", [4096, 64 << 20])
def test_a_workspaces_counters_are_zeroed_once_when_kept_and_every_call_when_fresh(fake, ws_bytes):
    """op.workspace_zeroed (the GroupNorm backward's ticket counters): the launcher zeroes that
    range on the call's stream before the kernels: once for a workspace kept for the stream (the
    kernels leave it zero), in every call for a fresh one (per call when large, under capture)."""
    op = get_op("groupnorm_bwd")
    x = torch.randn(2, 16, 8, 8, dtype=torch.float16)
    like, lay = like_of(x)
    p = op.parse_problem(N=2, C=16, H=8, W=8, G=4, dtype="fp16", layout=lay)
    cuda = fake(op, p)
    outs = [Output("dx", like.shape, lay, "fp16"), Output("dgamma", (16,), "flat", "fp16"),
            Output("dbeta", (16,), "flat", "fp16")]
    run, _ = dispatch._launcher(plan_stub(), op, p, like, ("x", "dy", "mean", "rstd", "gamma", "beta"), outs,
                                STEPS[:1], ws_bytes, (ws_bytes - 16, 16))
    ws_slot = op.arg_names.index("ws")
    ins = (x.data_ptr(), x.data_ptr(), 4096, 4096, 0, 0)

    def call() -> list:
        n = len(cuda.launches)
        run(ins, 0.0, x)
        return cuda.launches[n:]

    def zeroed(got: list) -> bool:
        ws = int.from_bytes(got[-1][-1][ws_slot], "little")
        assert got[-1][0] == STEPS[0][0]  # the kernel comes last
        return [g for g in got if g[0] == "memset"] == [("memset", ws + ws_bytes - 16, 0, 16, 77)]

    kept = ws_bytes <= dispatch._KEEP_WS_BYTES
    assert zeroed(call())
    assert zeroed(call()) != kept  # a kept workspace is zeroed once, a fresh one again
    cuda.capturing = True
    assert zeroed(call())  # the graph's own workspace: zeroed in the graph
    # no zeroed range: no memset
    run2, _ = dispatch._launcher(plan_stub(), op, p, like, ("x", "dy", "mean", "rstd", "gamma", "beta"), outs,
                                 STEPS[:1], ws_bytes)
    n = len(cuda.launches)
    run2(ins, 0.0, x)
    assert all(g[0] != "memset" for g in cuda.launches[n:])


def test_output_like_x_falls_back_for_tensor_subclasses(fake):
    """empty_like only for plain tensors; a subclass (e.g. nn.Parameter) gets empty_strided."""
    op = get_op("avgpool2d_bwd")
    x = torch.nn.Parameter(torch.randn(1, 8, 4, 4))
    like, lay = like_of(x.detach())
    p = op.parse_problem(N=1, C=8, H=4, W=4, dtype="fp32", layout=lay, kernel=2, stride=2)
    fake(op, p)
    run, _ = dispatch._launcher(plan_stub(), op, p, like, ("dy",), [Output("dx", like.shape, lay, "fp32")],
                                STEPS[:1], 0)
    (dx,) = run((4096,), 0.0, x)
    assert type(dx) is torch.Tensor and dx.shape == x.shape and not dx.requires_grad


def test_harness_cooperative_launcher_passes_kernel_args(monkeypatch):
    """verify.cooperative_launcher (the tuner's and the GPU tests' path for merge=grid) launches
    through launchCooperativeKernel with the same 8-byte argument slots the dispatcher fills."""
    import cupy
    from cupy.cuda import driver

    from ckgen.types import Launch
    from ckgen.runtime.verify import cooperative_launcher

    op = get_op("groupnorm_fwd")
    p = op.parse_problem(N=2, C=64, H=6, W=5, G=8, dtype="bf16", layout="nhwc")
    args = op.kernel_args(p, {"x": 4096, "gamma": 8192, "y": 12288, "mean": 16384, "rstd": 20480, "ws": 24576}, 1e-5)
    got = []

    def fake(f, gx, gy, gz, bx, by, bz, smem, stream, kargs):
        addrs = [ctypes.c_uint64.from_address(kargs + 8 * i).value for i in range(len(args))]
        got.append((f, (gx, gy, gz), (bx, by, bz), smem, stream, [ctypes.string_at(a, 8) for a in addrs]))

    monkeypatch.setattr(driver, "launchCooperativeKernel", fake)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: SimpleNamespace(ptr=77))
    kernel = SimpleNamespace(kernel=SimpleNamespace(ptr=1111))
    run = cooperative_launcher(kernel, Launch("k", (16, 1, 1), (512, 1, 1), 0, cooperative=True), args)
    run()
    run()
    assert got == [(1111, (16, 1, 1), (512, 1, 1), 0, 77, _slots(args))] * 2
