"""A plug-in op for the tests, written the way docs/adding-an-op.md describes: a channel-wise
scale, y[n, c, h, w] = x[n, c, h, w] * s[c], NCHW and NHWC, fp32/fp16/bf16.

Its three files (a template, a tuning space, an OpSpec module) are the strings below; `install`
writes them into a folder, imports the module and registers the op with `ckgen.ops.register`.
Nothing in ckgen knows the op: tests/test_plugin_op.py (CPU) and
tests/gpu/test_plugin_op_gpu.py (GPU) check what it gets from the registration alone."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

NAME = "chscale"

TEMPLATE = r'''// {{ name }}: channel-wise scale y = x * s[c], {{ dtype }}, {{ layout | upper }}, {{ vec }} elements per access.
{% include "common/prelude.cuh.j2" %}
{% include "common/vec_io.cuh.j2" %}
extern "C" __global__ void __launch_bounds__({{ threads }}) {{ name }}(
    const ck_store_t* CK_RESTRICT x, const ck_store_t* CK_RESTRICT s, ck_store_t* CK_RESTRICT y,
    int N, int C, int HW) {
  const long long vectors = (long long)N * C * HW / {{ vec }};
  const long long step = (long long)gridDim.x * {{ threads }};
  for (long long v = (long long)blockIdx.x * {{ threads }} + threadIdx.x; v < vectors; v += step) {
    const long long i = v * {{ vec }};
    float in[{{ vec }}], out[{{ vec }}];
    ck_load(x + i, in);
{% if layout == "nchw" %}
    const float scale = ck_to_f(s[(int)((i / HW) % C)]);  // a vector lies in one plane (HW % vec == 0)
#pragma unroll
    for (int j = 0; j < {{ vec }}; ++j) out[j] = in[j] * scale;
{% else %}
    const int c0 = (int)(i % C);  // a vector lies in one pixel's channels (C % vec == 0)
#pragma unroll
    for (int j = 0; j < {{ vec }}; ++j) out[j] = in[j] * ck_to_f(s[c0 + j]);
{% endif %}
    ck_store(y + i, out);
  }
}
'''

SPACE = '''# Tuning space of the channel-wise scale (a plug-in op of the tests).
op: chscale
params:
  tile:
    threads: [64, 128, 256, 512]   # threads per block
    vec_bytes: [4, 8, 16]          # bytes per vector access
constraints:
  - expr: "threads * vec_bytes <= 4096"
    reason: "a block moves at most 4 KiB per step"
default:
  threads: 256
  vec_bytes: 16
default_problems:
  dtypes: [bf16, fp32]
  layouts: [nchw, nhwc]
  shapes:
    - [8, 64, 56, 56]
    - [2, 320, 64, 64]
grids:
  small:
    about: "small maps"
    dtypes: [fp16]
    layouts: [nchw, nhwc]
    batches: [1, 4]
    shapes:
      - [32, 8, 8]
'''

MODULE = r'''"""The channel-wise scale op: y[n, c, h, w] = x[n, c, h, w] * s[c]."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

import numpy as np

from ckgen.ops.numeric import from_storage, round_to, to_storage
from ckgen.ops.spec import (DTYPES, LAYOUTS, Config, Launch, OpSpec, Problem, Support, Target, Tolerance,
                            check_choice, check_int, full_shapes, problem_of)

HERE = Path(__file__).resolve().parent
_STORAGE_BITS = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}


@dataclass(frozen=True)
class ChScaleProblem(Problem):
    N: int
    C: int
    H: int
    W: int
    dtype: str
    layout: str

    def __post_init__(self) -> None:
        for f in ("N", "C", "H", "W"):
            object.__setattr__(self, f, check_int(f, getattr(self, f)))
        if self.H * self.W > 2**31 - 1:
            raise ValueError(f"H, W: H*W = {self.H * self.W} exceeds 2147483647")
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("layout", self.layout, LAYOUTS)

    @property
    def HW(self) -> int:
        return self.H * self.W

    @property
    def numel(self) -> int:
        return self.N * self.C * self.H * self.W

    def key(self) -> str:
        return f"N={self.N},C={self.C},H={self.H},W={self.W},dtype={self.dtype},layout={self.layout}"


class ChScale(OpSpec):
    name: ClassVar[str] = "chscale"
    template: ClassVar[str] = "chscale.cu.j2"
    template_dir: ClassVar[Path] = HERE / "templates"
    space_path: ClassVar[Path] = HERE / "tuning_spaces" / "chscale.yaml"
    arg_names: ClassVar[tuple[str, ...]] = ("x", "s", "y")

    def parse_problem(self, **kw: Any) -> ChScaleProblem:
        return problem_of(ChScaleProblem, kw, "channel scale")

    def problem_from_key(self, key: str) -> ChScaleProblem:
        try:
            kv = dict(part.split("=", 1) for part in key.split(","))
            return ChScaleProblem(int(kv["N"]), int(kv["C"]), int(kv["H"]), int(kv["W"]), kv["dtype"], kv["layout"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"problem key {key!r} is malformed: {e}") from None

    def problems_of(self, spec: Any, dtypes=None, layouts=None, activations=None) -> list[ChScaleProblem]:
        return [ChScaleProblem(N, C, H, W, d, l) for shape in spec["shapes"] for N, C, H, W in full_shapes(spec, shape, 4)
                for d in dtypes or spec["dtypes"] for l in layouts or spec["layouts"]]

    def problems_from_cli(self, args: Any) -> list[ChScaleProblem]:
        if len(args.shape) != 4:
            raise ValueError(f"--shape: takes N,C,H,W (4 numbers), got {len(args.shape)}")
        n, c, h, w = args.shape
        return [self.parse_problem(N=n, C=c, H=h, W=w, dtype=d, layout=l)
                for d in (args.dtype or ["bf16"]) for l in (args.layout or ["nchw"])]

    def vec(self, p: ChScaleProblem, config: Config) -> int:
        return config["vec_bytes"] // DTYPES[p.dtype]["itemsize"]

    def validate(self, p: ChScaleProblem, config: Config, target: Target) -> Support:
        ok = self.space.check(config)
        if not ok:
            return ok
        vec = self.vec(p, config)
        if vec < 1:
            return Support.no(f"vec_bytes={config['vec_bytes']} is less than one {p.dtype} element")
        along = p.HW if p.layout == "nchw" else p.C
        if along % vec:
            what = "H*W" if p.layout == "nchw" else "C"
            return Support.no(f"vec_bytes={config['vec_bytes']}: {what}={along} is not a multiple of the "
                              f"vector ({vec} elements)")
        return Support.yes()

    def instance_name(self, p: ChScaleProblem, config: Config) -> str:
        return f"chscale_{p.dtype}_{p.layout}_t{config['threads']}_v{config['vec_bytes']}"

    def render_context(self, p: ChScaleProblem, config: Config, target: Target) -> dict[str, Any]:
        d = DTYPES[p.dtype]
        return dict(config.as_dict(), target=target, dtype=p.dtype, layout=p.layout, storage=d["storage"],
                    itemsize=d["itemsize"], vec=self.vec(p, config))

    def launches(self, p: ChScaleProblem, config: Config, target: Target) -> tuple[Launch, ...]:
        t = config["threads"]
        blocks = min(-(-(p.numel // self.vec(p, config)) // t), 1 << 20)  # a grid-stride loop past 2^20 blocks
        return (Launch(self.instance_name(p, config), (blocks, 1, 1), (t, 1, 1)),)

    def min_bytes(self, p: ChScaleProblem) -> int:
        return (2 * p.numel + p.C) * DTYPES[p.dtype]["itemsize"]

    def make_inputs(self, p: ChScaleProblem, rng: np.random.Generator) -> dict[str, np.ndarray]:
        x = rng.standard_normal((p.N, p.C, p.H, p.W)) + 0.25
        s = rng.uniform(0.5, 2.0, p.C) * rng.choice([-1.0, 1.0], p.C)
        return {"x": round_to(x, p.dtype), "s": round_to(s, p.dtype)}

    def reference(self, p: ChScaleProblem, inputs: Mapping[str, np.ndarray], eps: float = 0.0) -> dict[str, np.ndarray]:
        x = np.asarray(inputs["x"], dtype=np.float64)
        return {"y": x * np.asarray(inputs["s"], dtype=np.float64).reshape(1, p.C, 1, 1)}

    def tolerance(self, dtype: str, output: str) -> Tolerance:
        # one product in fp32, rounded once to the dtype
        return {"fp32": Tolerance(1e-6, 1e-6), "fp16": Tolerance(1e-5, 1e-3), "bf16": Tolerance(1e-5, 8e-3)}[dtype]

    def _memory_order(self, p: ChScaleProblem, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a if p.layout == "nchw" else np.transpose(a, (0, 2, 3, 1))).ravel()

    def pack_inputs(self, p: ChScaleProblem, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"x": to_storage(self._memory_order(p, inputs["x"]), p.dtype), "s": to_storage(inputs["s"], p.dtype)}

    def output_buffers(self, p: ChScaleProblem) -> dict[str, tuple[int, Any]]:
        return {"y": (p.numel, _STORAGE_BITS[p.dtype])}

    def unpack_outputs(self, p: ChScaleProblem, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        y = from_storage(raw["y"], p.dtype)
        if p.layout == "nchw":
            return {"y": y.reshape(p.N, p.C, p.H, p.W)}
        return {"y": y.reshape(p.N, p.H, p.W, p.C).transpose(0, 3, 1, 2)}

    def scalar_args(self, p: ChScaleProblem) -> tuple:
        return np.int32(p.N), np.int32(p.C), np.int32(p.HW)

    def distance(self, a: ChScaleProblem, b: ChScaleProblem) -> float:
        return (abs(math.log(a.numel / b.numel)) + abs(math.log(a.C / b.C))
                + 4.0 * (a.layout != b.layout) + 2.0 * (a.dtype != b.dtype))

    def bench_callables(self, p: ChScaleProblem, device: str = "cuda", call: Any = None) -> tuple[Any, Any, str]:
        """`chscale` against PyTorch's broadcast product."""
        import torch

        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[p.dtype]
        fmt = torch.channels_last if p.layout == "nhwc" else torch.contiguous_format
        x = torch.randn(p.N, p.C, p.H, p.W, device=device).to(dt).contiguous(memory_format=fmt)
        s = (torch.rand(p.C, device=device) + 0.5).to(dt)
        return (lambda: chscale(x, s)), (lambda: x * s.view(1, -1, 1, 1)), "x * s[None, :, None, None]"


def chscale(x: Any, s: Any) -> Any:
    """The public function: y = x * s[c] for a CuPy array or torch CUDA tensor x (N, C, H, W; NCHW
    or channels-last) and s (C,) of x's dtype, through ckgen's dispatcher; y in x's layout."""
    from ckgen.runtime.dispatch import Output, plan_for
    from ckgen.ops import get_op
    from ckgen.runtime.tensors import as_device_tensor, layout_of

    xt, st = as_device_tensor(x, "x"), as_device_tensor(s, "s")
    layout = layout_of(xt, "x")
    N, C, H, W = xt.shape
    if st.shape != (C,) or st.strides != (1,) or st.dtype != xt.dtype or st.device != xt.device:
        raise ValueError(f"s: expected a contiguous ({C},) {xt.dtype} tensor on x's device, got shape {st.shape}, "
                         f"strides {st.strides}, {st.dtype} on device {st.device}")
    op = get_op("chscale")
    p = op.parse_problem(N=N, C=C, H=H, W=W, dtype=xt.dtype, layout=layout)
    plan = plan_for(op, p, xt, {"x": xt.ptr, "s": st.ptr}, [Output("y", (N, C, H, W), layout, p.dtype)], ("x", "s"))
    return plan.run((xt.ptr, st.ptr), 0.0, x)[0]
'''


def write(folder: Path) -> Path:
    """The op's three files under `folder`: templates/chscale.cu.j2, tuning_spaces/chscale.yaml,
    chscale_op.py. Returns the module's path."""
    (folder / "templates").mkdir(parents=True, exist_ok=True)
    (folder / "tuning_spaces").mkdir(parents=True, exist_ok=True)
    (folder / "templates" / "chscale.cu.j2").write_text(TEMPLATE)
    (folder / "tuning_spaces" / "chscale.yaml").write_text(SPACE)
    module = folder / "chscale_op.py"
    module.write_text(MODULE)
    return module


def install(folder: Path):
    """Write the files, import the module (as `chscale_op`) and register the op; returns the OpSpec."""
    from ckgen.ops import register

    path = write(folder)
    spec = importlib.util.spec_from_file_location("chscale_op", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["chscale_op"] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return register(module.ChScale())


def uninstall() -> None:
    from ckgen.ops import unregister

    unregister(NAME)
    sys.modules.pop("chscale_op", None)
