"""Model-level benchmark: ckgen.torch.convert in real models, against PyTorch eager and torch.compile.

    python bench/models.py [--quick] [--suite models|blocks|all] [--rows NAME,...] [--budget S] [--out DIR]

Suite "models" (the default; random-init models built from configs, no weights downloaded), bf16,
channels-last:
  sd15-unet     diffusers UNet2DConditionModel with Stable Diffusion 1.5's config, batch 4, 64x64
                latent, 77 text tokens: training step
  sdxl-blocks   SDXL-size UNet blocks: diffusers DownBlock2D 320->320 (128x128 latent, 1024 px),
                320->640, 640->1280, 2 ResnetBlock2D each with the time embedding, batch 2: training step
  vae-decode    diffusers AutoencoderKL (SD's VAE config) decode at 512 and 1024 px: inference
  vae-encode    its encoder at 512 px: training step
  resnet50_gn   timm resnet50_gn, batch 32, 224 px: training step and inference
  resnet26d     timm resnet26d (ResNet-D: AvgPool2d in the shortcuts), batch 64: training step
Suite "blocks": stacks of 4 SD-style ResBlocks, ResNet-50 and VGG-16 (torchvision's if importable).
A row whose library (diffusers, timm) is missing is skipped with the reason.

Columns, all in one run on the same weights and inputs:
  eager         the nn model
  compile       torch.compile(model)
  compile_ro    torch.compile(model, mode="reduce-overhead") (CUDA graphs)
  ck_eager      ckgen.torch.convert(model)
  ck_compile    torch.compile(converted, fullgraph=True) (max pools traced as PyTorch's, for Inductor:
                the modules' under_compile default)
  ck_compile_ro torch.compile(converted, fullgraph=True, mode="reduce-overhead")
  ck_compile_ckpool  (only when named in --columns) torch.compile(fullgraph=True) of a model
                converted with max_pool_under_compile="ckgen"
Default columns: eager, ck_eager, compile, ck_compile, ck_compile_ro ("models"; --quick drops
ck_compile_ro) or all six ("blocks").

Each cell: host-inclusive ms per step (wall clock, synchronized; what a training loop sees) and
GPU-only ms per step (the sum of the device kernels' times, torch.profiler), both the median of
--interleave rounds run after every column of a row has compiled and warmed up: each round runs
--min-steps timed steps and one profiled step of every column, in rotating order, so that the
host's drift over a run does not decide a comparison (the column's own first timing is kept as
host_ms_seq); and the share of GPU time in GroupNorm / pooling kernels. A column that fails
records its error and the run goes on. Rows (and within a row the columns, most telling first)
run in order until the time budget is spent (default 330 s with --quick, so that a quick run with
its compilations fits in about 6 minutes on an H200; 1800 s otherwise); the rest are listed as
skipped. ckgen's dispatcher notices (untuned shapes) and any fallback to PyTorch are listed per row.

Numerics: the converted model's output against the nn model's, in eval mode on the row's input.
The tolerance is the dtype's own noise: both are compared with the nn model run in float32 on the
same input, and the converted model passes when its relative L2 error against that reference is
at most 2x the nn model's own (bf16/fp16 rounding is the only intended difference: the fused
kernels round once where PyTorch rounds after the norm and again after the SiLU) plus 1e-3 (for
float32 rows, 1e-4).

Writes DIR/<date>-models-<device>.md, .json and .png (matplotlib, if importable; else a message;
bench/reports.py names them); DIR: --out, else $OUT, else bench/results.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

COLUMNS = ("eager", "compile", "compile_ro", "ck_eager", "ck_compile", "ck_compile_ro")
EXTRA_COLUMNS = ("ck_compile_ckpool",)  # run only when --columns names them
QUICK_COLUMNS = ("eager", "compile", "ck_eager", "ck_compile")
MODEL_COLUMNS = ("eager", "ck_eager", "compile", "ck_compile", "ck_compile_ro")


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------
def resblock_stack(C: int, n: int = 4, groups: int = 32):
    from torch import nn

    class ResBlock(nn.Module):
        """LDM's ResBlock without the time embedding: in_layers, out_layers, identity skip."""

        def __init__(self) -> None:
            super().__init__()
            self.in_layers = nn.Sequential(nn.GroupNorm(groups, C), nn.SiLU(), nn.Conv2d(C, C, 3, padding=1))
            self.out_layers = nn.Sequential(nn.GroupNorm(groups, C), nn.SiLU(), nn.Conv2d(C, C, 3, padding=1))

        def forward(self, x):
            return x + self.out_layers(self.in_layers(x))

    return nn.Sequential(*[ResBlock() for _ in range(n)])


def resnet50():
    try:
        import torchvision

        return torchvision.models.resnet50(weights=None), "torchvision"
    except Exception:  # noqa: BLE001 - torchvision missing or broken: the local definition
        return _local_resnet50(), "local"


def vgg16():
    try:
        import torchvision

        return torchvision.models.vgg16(weights=None), "torchvision"
    except Exception:  # noqa: BLE001
        return _local_vgg16(), "local"


def _local_resnet50():
    """torchvision's ResNet-50 layer for layer (Bottleneck v1.5), without torchvision."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride, down):
            super().__init__()
            cout = width * 4
            self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) \
                if down else None

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return self.relu(out + (self.downsample(x) if self.downsample is not None else x))

    layers, cin = [], 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        stage = []
        for i in range(blocks):
            stage.append(Bottleneck(cin, width, stride if i == 0 else 1, i == 0))
            cin = width * 4
        layers.append(nn.Sequential(*stage))
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                         nn.MaxPool2d(3, 2, 1), *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))


def _local_vgg16():
    from torch import nn

    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    layers, cin = [], 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=True)]
            cin = v
    return nn.Sequential(nn.Sequential(*layers), nn.AdaptiveAvgPool2d(7), nn.Flatten(),
                         nn.Linear(512 * 49, 4096), nn.ReLU(True), nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU(True),
                         nn.Dropout(), nn.Linear(4096, 1000))


# ---------------------------------------------------------------------------------------------
# the "models" suite: diffusers and timm, random init from configs (no download)
# ---------------------------------------------------------------------------------------------
# Stable Diffusion 1.5's UNet2DConditionModel config (its unet/config.json).
SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, center_input_sample=False, flip_sin_to_cos=True, freq_shift=0,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    mid_block_type="UNetMidBlock2DCrossAttn",
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    only_cross_attention=False, block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, downsample_padding=1,
    mid_block_scale_factor=1, act_fn="silu", norm_num_groups=32, norm_eps=1e-5, cross_attention_dim=768,
    attention_head_dim=8, dual_cross_attention=False, use_linear_projection=False, upcast_attention=False)
# Stable Diffusion's AutoencoderKL config (its vae/config.json).
SD_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, act_fn="silu",
    norm_num_groups=32, sample_size=512)
# Tiny versions for --smoke (the same classes, so the same adapters).
SD15_UNET_TINY = dict(SD15_UNET, block_out_channels=(32, 64, 64, 64), norm_num_groups=8, cross_attention_dim=32,
                      attention_head_dim=4, layers_per_block=1)
SD_VAE_TINY = dict(SD_VAE, block_out_channels=(16, 32, 32, 32), norm_num_groups=8, layers_per_block=1)


def _wrap(call, **tensors):
    """An nn.Module whose forward(x) is call(self, x): the model's other inputs (time step, text
    embedding) are buffers, so that torch.compile, deepcopy and .to() treat them as the model's."""
    from torch import nn

    class Step(nn.Module):
        def forward(self, x):
            return call(self, x)

    m = Step()
    for k, v in tensors.items():
        m.register_buffer(k, v, persistent=False)
    return m


def sd15_unet(tiny: bool, batch: int):
    import torch
    from diffusers import UNet2DConditionModel

    cfg = SD15_UNET_TINY if tiny else SD15_UNET
    m = _wrap(lambda self, x: self.unet(x, self.t, encoder_hidden_states=self.text).sample,
              t=torch.full((batch,), 500, dtype=torch.long),
              text=torch.randn(batch, 77, cfg["cross_attention_dim"]))
    m.unet = UNet2DConditionModel(**cfg)
    return m


def sdxl_blocks(tiny: bool, batch: int):
    """SDXL's UNet resolution/channel stages (320 at 128x128 for 1024 px, 640, 1280), as diffusers'
    DownBlock2D (2 ResnetBlock2D with the 1280-wide time embedding each); without SDXL's
    transformer layers, whose attention and matmuls convert does not touch."""
    import torch
    from diffusers.models.unets.unet_2d_blocks import DownBlock2D
    from torch import nn

    c, temb = ((32, 64, 128), 64) if tiny else ((320, 640, 1280), 1280)
    groups = 8 if tiny else 32

    def call(self, x):
        for blk in self.blocks:
            x, _ = blk(x, self.temb)
        return x

    m = _wrap(call, temb=torch.randn(batch, temb))
    m.blocks = nn.ModuleList([
        DownBlock2D(in_channels=c[0], out_channels=c[0], temb_channels=temb, num_layers=2, resnet_groups=groups),
        DownBlock2D(in_channels=c[0], out_channels=c[1], temb_channels=temb, num_layers=2, resnet_groups=groups),
        DownBlock2D(in_channels=c[1], out_channels=c[2], temb_channels=temb, num_layers=2, resnet_groups=groups,
                    add_downsample=False)])
    return m


def vae(tiny: bool, part: str):
    from diffusers import AutoencoderKL

    m = _wrap((lambda self, z: self.vae.decode(z).sample) if part == "decode" else (lambda self, x: self.vae.encoder(x)))
    m.vae = AutoencoderKL(**(SD_VAE_TINY if tiny else SD_VAE))
    if part == "encode":
        m.vae.decoder = None  # not used: no parameters to hold or to time
        m.vae.post_quant_conv = None
    return m


def timm_model(name: str, tiny: bool):
    import timm

    return timm.create_model(name, pretrained=False, **({"layers": (1, 1, 1, 1)} if tiny else {}))


MODEL_ROWS = {  # name: (label, library)
    "sd15-unet": ("SD1.5 UNet", "diffusers"), "sdxl-blocks": ("SDXL-size UNet blocks", "diffusers"),
    "vae-decode": ("VAE decode", "diffusers"), "vae-encode": ("VAE encoder", "diffusers"),
    "resnet50_gn": ("timm resnet50_gn", "timm"), "resnet26d": ("timm resnet26d", "timm"),
}


@dataclass
class Row:
    name: str  # "resblocks", "resnet50", "vgg16", or one of MODEL_ROWS
    shape: tuple  # input (N, C, H, W)
    layout: str  # "nhwc" | "nchw"
    mode: str  # "train" | "infer"
    quick: bool = False
    tiny: bool = False  # --smoke: the model's tiny configuration
    cells: dict = field(default_factory=dict)  # column -> result dict
    notes: list = field(default_factory=list)
    skipped: str = ""
    numerics: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        what = "4 ResBlocks" if self.name == "resblocks" else MODEL_ROWS.get(self.name, (self.name,))[0]
        if self.name in ("vae-decode", "vae-encode"):
            what += f" {self.shape[2] * (8 if self.name == 'vae-decode' else 1)} px"
        return f"{what} {'x'.join(map(str, self.shape))} {self.layout} {self.mode}"


def plan(quick: bool, smoke: bool, suite: str = "models") -> list[Row]:
    rows: list[Row] = []
    if suite in ("models", "all"):
        rows += plan_models(quick, smoke)
    if suite in ("blocks", "all"):
        rows += plan_blocks(quick, smoke)
    return rows


def plan_models(quick: bool, smoke: bool) -> list[Row]:
    if smoke:  # tiny configurations of the same classes (checks the script and the adapters, any device;
        # NCHW training: torch's CPU backward of channels-last GroupNorm and upsampling crashes)
        return [Row("sd15-unet", (2, 4, 16, 16), "nchw", "train", True, True),
                Row("sdxl-blocks", (2, 32, 16, 16), "nchw", "train", True, True),
                Row("vae-decode", (1, 4, 8, 8), "nhwc", "infer", True, True),
                Row("vae-encode", (1, 3, 32, 32), "nchw", "train", True, True),
                Row("resnet50_gn", (2, 3, 32, 32), "nhwc", "infer", True, True),
                Row("resnet26d", (2, 3, 32, 32), "nchw", "train", True, True)]
    rows = [  # quick ones first: the budget ends a run in this order
        Row("sd15-unet", (4, 4, 64, 64), "nhwc", "train", True),
        Row("resnet26d", (64, 3, 224, 224), "nhwc", "train", True),
        Row("vae-decode", (1, 4, 64, 64), "nhwc", "infer", True),
        Row("resnet50_gn", (32, 3, 224, 224), "nhwc", "train", True),
        Row("sdxl-blocks", (2, 320, 128, 128), "nhwc", "train"),
        Row("vae-decode", (1, 4, 128, 128), "nhwc", "infer"),
        Row("vae-encode", (1, 3, 512, 512), "nhwc", "train"),
        Row("resnet50_gn", (32, 3, 224, 224), "nhwc", "infer"),
    ]
    return [r for r in rows if r.quick] if quick else rows


def plan_blocks(quick: bool, smoke: bool) -> list[Row]:
    if smoke:  # tiny, for checking the script itself (any device; NCHW training: PyTorch's CPU
        # channels-last GroupNorm backward crashes when the input needs no gradient)
        return [Row("resblocks", (2, 64, 16, 16), "nchw", "train", True),
                Row("resblocks", (2, 64, 16, 16), "nhwc", "infer", True)]
    rows = [
        Row("resblocks", (2, 320, 64, 64), "nhwc", "train", True),
        Row("resblocks", (1, 256, 256, 256), "nhwc", "train", True),
        Row("resnet50", (32, 3, 224, 224), "nhwc", "train", True),
        Row("resblocks", (8, 320, 64, 64), "nhwc", "train"),
        Row("resblocks", (2, 640, 32, 32), "nhwc", "train"),
        Row("vgg16", (16, 3, 224, 224), "nhwc", "train"),
        Row("resblocks", (2, 320, 64, 64), "nchw", "train"),
        Row("resblocks", (1, 256, 256, 256), "nchw", "train"),
        Row("resblocks", (2, 320, 64, 64), "nhwc", "infer"),
        Row("resblocks", (1, 256, 256, 256), "nhwc", "infer"),
        Row("resnet50", (32, 3, 224, 224), "nhwc", "infer"),
        Row("resblocks", (8, 320, 64, 64), "nchw", "train"),
        Row("resblocks", (2, 640, 32, 32), "nchw", "train"),
        Row("vgg16", (16, 3, 224, 224), "nhwc", "infer"),
    ]
    return [r for r in rows if r.quick] if quick else rows


def build(row: Row, dtype, device):
    import torch

    torch.manual_seed(0)
    if row.name == "resblocks":
        model, src = resblock_stack(row.shape[1]), "local"
    elif row.name == "resnet50":
        model, src = resnet50()
    elif row.name == "vgg16":
        model, src = vgg16()
    elif row.name == "sd15-unet":
        model, src = sd15_unet(row.tiny, row.shape[0]), "diffusers"
    elif row.name == "sdxl-blocks":
        model, src = sdxl_blocks(row.tiny, row.shape[0]), "diffusers"
    elif row.name in ("vae-decode", "vae-encode"):
        model, src = vae(row.tiny, row.name.split("-")[1]), "diffusers"
    else:
        model, src = timm_model(row.name, row.tiny), "timm"
    fmt = torch.channels_last if row.layout == "nhwc" else torch.contiguous_format
    model = model.to(device=device, dtype=dtype).to(memory_format=fmt)
    model.train(row.mode == "train")
    return model, src


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------
def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(fn, model, x, mode):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]

    if mode == "train":
        def step():
            torch.compiler.cudagraph_mark_step_begin()
            out = _out(fn(x))
            out.float().mean().backward()
            for p in params:
                p.grad = None
    else:
        def step():
            torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                fn(x)
    return step


def _kind(names: str) -> str:
    n = names.lower()
    if "group_norm" in n or "groupnorm" in n:
        return "gn"
    return "pool" if "pool" in n else ""


def gpu_kernel_times(step, steps: int, device) -> tuple[float, float, float]:
    """(GPU ms per step, GroupNorm share, pooling share) from torch.profiler's device kernels.

    A kernel counts as GroupNorm (pooling) when its name or the name of the op that launched
    it, or of any op around that one, says so: PyTorch's own kernels (RowwiseMoments... under
    aten::native_group_norm, a layout copy under it too), Triton's (triton_..._native_group_norm_...)
    and ckgen's (ckgen_groupnorm_fwd_...) alike."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return float("nan"), float("nan"), float("nan")
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    total = {"": 0.0, "gn": 0.0, "pool": 0.0}
    for fe in prof.events():
        if fe.device_type != DeviceType.CPU or not getattr(fe, "kernels", None):
            continue
        chain, parent = [fe.name], fe.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        for k in fe.kernels:
            total[_kind(" ".join([k.name, *chain]))] += k.duration
    all_us = sum(total.values())
    if all_us <= 0:
        return float("nan"), float("nan"), float("nan")
    return all_us / 1e3 / steps, total["gn"] / all_us, total["pool"] / all_us


def measure(step, device, min_steps: int, min_seconds: float, profile_steps: int, warmup: int) -> dict:
    t0 = time.perf_counter()
    step()  # first call: compilation, kernel loading, cudnn autotuning
    _sync(device)
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    _sync(device)
    n, t0 = 0, time.perf_counter()
    while n < min_steps or time.perf_counter() - t0 < min_seconds:
        step()
        n += 1
        if n >= 10 * min_steps:
            break
    _sync(device)
    host_ms = (time.perf_counter() - t0) * 1e3 / n
    gpu_ms, gn_share, pool_share = gpu_kernel_times(step, profile_steps, device)
    return {"host_ms": host_ms, "gpu_ms": gpu_ms, "gn_share": gn_share, "pool_share": pool_share, "steps": n,
            "first_s": first_s}


def interleaved_host_ms(steps: dict, device, rounds: int, n: int, gpu: bool = False) -> dict:
    """Host-inclusive ms per step of each column, timed in `rounds` interleaved rounds (each round
    runs n steps of every column, in a rotating order) and reduced by the median: the host's speed
    drifts over a run, and columns timed minutes apart would compare the drift, not the columns.
    With gpu=True each round also profiles one step of the column (`gpu_kernel_times`), and the
    result is {column: (host ms, GPU ms, GroupNorm share, pooling share)}, each a median."""
    cols = list(steps)
    times: dict = {c: [] for c in cols}
    kern: dict = {c: [] for c in cols}
    for c in cols:  # one step each first: nothing is timed that (re)compiles or reallocates
        steps[c]()
    for r in range(rounds):
        for c in cols[r % len(cols):] + cols[: r % len(cols)]:
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(n):
                steps[c]()
            _sync(device)
            times[c].append((time.perf_counter() - t0) * 1e3 / n)
            if gpu:
                kern[c].append(gpu_kernel_times(steps[c], 1, device))

    def med(v):
        v = sorted(x for x in v if not math.isnan(x))
        return v[len(v) // 2] if v else float("nan")

    if not gpu:
        return {c: med(v) for c, v in times.items()}
    return {c: (med(times[c]), *(med([k[i] for k in kern[c]]) for i in range(3))) for c in cols}


class _Notices(logging.Handler):
    """Collects the ckgen logger's notices (dispatcher fallbacks to untuned configs)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


# the order columns run in: the most telling first (the budget may end a row early)
RUN_ORDER = ("eager", "ck_eager", "compile", "ck_compile", "ck_compile_ckpool", "ck_compile_ro", "compile_ro")


def run_row(row: Row, args, device, dtype, deadline: float) -> None:
    import torch

    import ckgen.torch as ct

    base, src = build(row, dtype, device)
    if src != "local":
        row.notes.append(f"model: {src}")
    fmt = torch.channels_last if row.layout == "nhwc" else torch.contiguous_format
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(row.shape, device=device, generator=gen).to(dtype).contiguous(memory_format=fmt)
    conv = copy.deepcopy(base)
    report = ct.convert(conv, max_pool_indices=args.max_pool_indices)
    conv_ckpool = None
    if "ck_compile_ckpool" in args.columns:
        conv_ckpool = copy.deepcopy(base)
        ct.convert(conv_ckpool, max_pool_indices=args.max_pool_indices, max_pool_under_compile="ckgen")
    row.notes.append("convert: " + ", ".join(f"{k} x{v}" for k, v in sorted(report.counts().items())))
    used = report.adapters()
    if used:
        row.notes.append("adapters: " + ", ".join(f"{k} x{v}" for k, v in sorted(used.items())))
    try:
        row.numerics = numerics(base, conv, x, dtype)
        n = row.numerics
        row.notes.append(f"numerics: converted vs nn (float32 reference) relative L2 {n['ck_vs_ref']:.2e} vs "
                         f"{n['nn_vs_ref']:.2e} (tolerance {n['tolerance']:.2e}): {'pass' if n['ok'] else 'FAIL'}; "
                         f"converted vs nn {n['ck_vs_nn']:.2e}")
    except Exception as e:  # noqa: BLE001
        row.notes.append(f"numerics check failed: {e.__class__.__name__}: {e}")
    print(f"  {row.notes[-1]}", flush=True)
    handler = _Notices()
    logging.getLogger("ckgen").addHandler(handler)
    ct.reset_fallbacks()
    live: dict = {}  # column -> its step, kept for the interleaved host timing
    torch._dynamo.reset()  # once per row: a reset between columns would make the earlier ones recompile
    try:
        for col in sorted(args.columns, key=RUN_ORDER.index):
            if time.perf_counter() > deadline:
                row.cells[col] = {"error": "skipped: time budget spent"}
                continue
            t_col = time.perf_counter()
            try:
                model = copy.deepcopy(conv_ckpool if col == "ck_compile_ckpool"
                                      else conv if col.startswith("ck_") else base)
                if col in ("eager", "ck_eager"):
                    fn = model
                else:
                    print(f"  {col:14s} compiling ...", flush=True)
                    kw = {"backend": args.backend}
                    if col.endswith("_ro"):
                        kw["mode"] = "reduce-overhead"
                    if col.startswith("ck_"):
                        kw["fullgraph"] = True
                    fn = torch.compile(model, **kw)
                step = make_step(fn, model, x, row.mode)
                row.cells[col] = measure(step, device, args.min_steps, args.min_seconds, args.profile_steps,
                                         args.warmup)
                live[col] = step
            except Exception as e:  # noqa: BLE001 - one column's failure is data
                msg = f"{e.__class__.__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                row.cells[col] = {"error": msg}
                if args.verbose:
                    traceback.print_exc()
            finally:
                row.cells.setdefault(col, {})["wall_s"] = time.perf_counter() - t_col
                fn = model = step = None  # noqa: F841
            c = row.cells[col]
            print(f"  {col:14s} " + (f"host {c['host_ms']:8.3f} ms  gpu {c['gpu_ms']:8.3f} ms  "
                                     f"gn {c['gn_share']:.0%} pool {c['pool_share']:.0%}  "
                                     f"(first step {c['first_s']:.1f} s)" if "host_ms" in c else c.get("error", "")),
                  flush=True)
        if args.interleave and len(live) > 1 and time.perf_counter() < deadline:
            res = interleaved_host_ms(live, device, args.interleave, args.min_steps, gpu=device.type == "cuda")
            for col, v in res.items():
                c = row.cells[col]
                c["host_ms_seq"], c["gpu_ms_seq"] = c["host_ms"], c["gpu_ms"]
                if isinstance(v, tuple):
                    c["host_ms"], c["gpu_ms"], c["gn_share"], c["pool_share"] = v
                else:
                    c["host_ms"] = v
                c["rounds"] = args.interleave
            print("  interleaved medians, host / GPU ms: " + ", ".join(
                f"{c} {row.cells[c]['host_ms']:.2f} / {row.cells[c]['gpu_ms']:.2f}" for c in live), flush=True)
    finally:
        logging.getLogger("ckgen").removeHandler(handler)
        live.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    untuned = sorted({m for m in handler.messages if "runs PyTorch's op" not in m})
    if untuned:
        row.notes.append(f"ckgen dispatcher: {len(untuned)} problem(s) not tuned on this GPU (nearest/default "
                         f"configs), e.g. {untuned[0][:200]}")
    fb = ct.fallbacks()
    if fb:
        row.notes.append("fell back to PyTorch: " + "; ".join(f"{op} ({why}) x{n}" for (op, why), n in fb.items()))


def _out(y):
    y = y[0] if isinstance(y, (tuple, list)) else y
    return getattr(y, "sample", getattr(y, "logits", y))


def numerics(base, conv, x, dtype) -> dict:
    """The converted model against the nn model, both in eval mode on x, measured against the nn
    model in float32 (the dtype's own noise is the yardstick: see the module docstring)."""
    import torch

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    with torch.no_grad():
        a, b = copy.deepcopy(base).eval(), copy.deepcopy(conv).eval()
        ya, yb = _out(a(x)).double(), _out(b(x)).double()
        del a, b
        ref = copy.deepcopy(base).float().eval()
        yr = _out(ref(x.float())).double()
        del ref
    nn_vs_ref, ck_vs_ref, ck_vs_nn = rel(ya, yr), rel(yb, yr), rel(yb, ya)
    tol = 2 * nn_vs_ref + (1e-4 if dtype == torch.float32 else 1e-3)
    return {"nn_vs_ref": nn_vs_ref, "ck_vs_ref": ck_vs_ref, "ck_vs_nn": ck_vs_nn, "tolerance": tol,
            "ok": bool(ck_vs_ref <= tol)}


# ---------------------------------------------------------------------------------------------
# tuning (optional) and report
# ---------------------------------------------------------------------------------------------
def tune_rows(rows: list[Row], trials: int, device, dtype_name: str) -> None:
    """Tune the GroupNorm problems of the ResBlock rows that the DB lacks (fwd with swish, bwd)."""
    import ckgen
    from ckgen.runtime import db as dbmod
    from ckgen import settings
    from ckgen.ops import get_op
    from ckgen.runtime.target import device_info
    from ckgen.tuner.tune import TuneRequest, db_entry, tune_problem

    info = device_info(device.index or 0)
    for row in rows:
        if row.name != "resblocks":
            continue
        N, C, H, W = row.shape
        ops = ["groupnorm_fwd"] + (["groupnorm_bwd"] if row.mode == "train" else [])
        for name in ops:
            kw = dict(N=N, C=C, H=H, W=W, G=32, dtype=dtype_name, layout=row.layout, activation="swish")
            if ckgen.explain(name, arch=info.target.arch, **kw).source == "tuned":
                continue
            op = get_op(name)
            print(f"tuning {name} {op.parse_problem(**kw).key()} ({trials} trials)", flush=True)
            r = tune_problem(TuneRequest.on(op, op.parse_problem(**kw), info, trials=trials, storage=None, seed=0), info)
            dbmod.save_entries(settings.user_db_path(), [db_entry(r, info)])
            ckgen.reload_db()


def _cellv(row: Row, col: str, key: str) -> str:
    c = row.cells.get(col, {})
    if "error" in c:
        return "skip" if c["error"].startswith("skipped") else "error"
    return _fmt(c.get(key))


def _fmt(v, spec=".2f", empty="-"):
    return empty if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def write_report(rows: list[Row], args, meta: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    from reports import report_stem  # bench/reports.py

    stem = report_stem("models", meta["device"])
    cols = list(args.columns)

    def cell(row, col, key):
        c = row.cells.get(col, {})
        return c.get(key) if "error" not in c else None

    def speed(row, a, b, key):  # b's time / a's time: > 1 means a is faster
        ta, tb = cell(row, a, key), cell(row, b, key)
        return tb / ta if ta and tb else None

    lines = [f"# Model-level benchmark on {meta['device']}", "",
             f"torch {meta['torch']}, ckgen {meta['ckgen']}, {meta['dtype']}, {meta['date']}; "
             f"`{meta['command']}`", "",
             "ms per step: host-inclusive (wall clock, synchronized; what a training loop sees) / GPU-only "
             "(sum of device kernel times, torch.profiler). train = forward + backward of a mean loss; infer = "
             "forward under no_grad. ck_* = after `ckgen.torch.convert` (GroupNorm+SiLU and ReLU+MaxPool2d fused). "
             "Columns: " + ", ".join(cols) + ". Times: medians of interleaved rounds (see bench/models.py). "
             "A speedup a vs b is b's time / a's: > 1 means the converted column is faster.", ""]
    # speedups shown: (converted column, what it is compared with), where both ran
    pairs = [(a, b) for a, b in (("ck_eager", "eager"), ("ck_compile", "compile"), ("ck_compile_ro", "compile_ro"),
                                 ("ck_compile_ro", "compile"), ("ck_compile", "eager")) if a in cols and b in cols]
    if ("ck_compile_ro", "compile_ro") in pairs:
        pairs.remove(("ck_compile_ro", "compile"))
    for key, title in (("host_ms", "Host-inclusive ms per step"), ("gpu_ms", "GPU-only ms per step (device kernels)")):
        lines += [f"## {title}", "",
                  "| row | " + " | ".join(cols) + "".join(f" | {a} vs {b}" for a, b in pairs) + " |",
                  "|---|" + "---:|" * (len(cols) + len(pairs))]
        for r in rows:
            if r.skipped:
                continue
            vals = [_cellv(r, c, key) for c in cols]
            lines.append(f"| {r.label} | " + " | ".join(vals)
                         + "".join(f" | {_fmt(speed(r, a, b, key))}x" for a, b in pairs) + " |")
        lines.append("")
    if any(r.numerics for r in rows):
        lines += ["## Numerics (eval mode, the row's input; relative L2 error against the nn model in float32)", "",
                  "| row | nn (dtype) | converted | tolerance | converted vs nn | |", "|---|---:|---:|---:|---:|---|"]
        for r in rows:
            n = r.numerics
            if n:
                lines.append(f"| {r.label} | {n['nn_vs_ref']:.2e} | {n['ck_vs_ref']:.2e} | {n['tolerance']:.2e} | "
                             f"{n['ck_vs_nn']:.2e} | {'pass' if n['ok'] else 'FAIL'} |")
        lines.append("")
    lines += ["## Share of GPU time in GroupNorm / pooling kernels (before -> after)", "",
              "| row | " + " | ".join(f"{c} GN / pool" for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for r in rows:
        if r.skipped:
            continue
        vals = [f"{_fmt(cell(r, c, 'gn_share'), '.0%')} / {_fmt(cell(r, c, 'pool_share'), '.0%')}" for c in cols]
        lines.append(f"| {r.label} | " + " | ".join(vals) + " |")
    lines += ["", "## Notes", ""]
    for r in rows:
        if r.skipped:
            lines.append(f"- {r.label}: skipped ({r.skipped})")
            continue
        errs = [f"{c}: {r.cells[c]['error']}" for c in cols if "error" in r.cells.get(c, {})
                and not r.cells[c]["error"].startswith("skipped")]
        skipped = [c for c in cols if r.cells.get(c, {}).get("error", "").startswith("skipped")]
        if skipped:
            errs.append(f"not run (time budget): {', '.join(skipped)}")
        errs = [e if e.startswith("not run") else f"error {e}" for e in errs]
        firsts = ", ".join(f"{c} {r.cells[c]['first_s']:.1f}s" for c in cols if "first_s" in r.cells.get(c, {}))
        lines.append(f"- {r.label}: " + "; ".join(r.notes + ([f"first step (compile): {firsts}"] if firsts else [])
                                                   + errs))
    md = out / f"{stem}.md"
    md.write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    try:
        plot(rows, cols, out / f"{stem}.png", meta)
    except ImportError:
        print("no plot: matplotlib is not installed (the tables stand)", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - a plotting problem: the tables stand
        print(f"no plot: {e.__class__.__name__}: {e}", file=sys.stderr)
    return md


def plot(rows: list[Row], cols: list[str], path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if not r.skipped and r.cells.get("eager", {}).get("host_ms")]
    if not done:
        return
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(done) * len(cols) / 3), 9), sharex=True)
    width = 0.8 / len(cols)
    for ax, key, title in ((axes[0], "host_ms", "host-inclusive"), (axes[1], "gpu_ms", "GPU-only")):
        for i, c in enumerate(cols):
            vals = []
            for r in done:
                t0, t = r.cells["eager"].get(key), r.cells.get(c, {}).get(key)
                vals.append(t0 / t if t0 and t and not math.isnan(t) and not math.isnan(t0) else 0.0)
            ax.bar([j + (i - (len(cols) - 1) / 2) * width for j in range(len(done))], vals, width, label=c)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel(f"speedup over eager ({title})")
        ax.legend(ncol=len(cols), fontsize=8)
    axes[1].set_xticks(range(len(done)))
    axes[1].set_xticklabels([r.label for r in done], rotation=30, ha="right", fontsize=8)
    fig.suptitle(f"ckgen.torch.convert, {meta['dtype']}, {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def row_selected(row: Row, spec: str) -> bool:
    """--rows: comma-separated items, each a row name (exactly) or a regular expression searched in
    the row's label."""
    items = [i.strip() for i in spec.split(",") if i.strip()]
    names = {r.name for r in plan(False, False, "all")}
    return any(row.name == i if i in names else re.search(i, row.label) is not None for i in items)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="the quick rows, eager/ck_eager/compile/ck_compile, few rounds, a 330 s budget (about 6 "
                         "minutes with compilation on an H200)")
    ap.add_argument("--suite", default="models", choices=["models", "blocks", "all"],
                    help="models: diffusers and timm models (default); blocks: ResBlock stacks, ResNet-50, VGG-16")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds; columns and rows after it are skipped (default 1800; --quick 330)")
    ap.add_argument("--columns", default=None, help=f"comma-separated, of {','.join(COLUMNS + EXTRA_COLUMNS)}")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--max-pool-indices", default="stored", choices=["stored", "recompute"])
    ap.add_argument("--min-steps", type=int, default=10)
    ap.add_argument("--min-seconds", type=float, default=0.5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--interleave", type=int, default=5,
                    help="rounds of interleaved host timing over a row's columns (0: each column's own run only)")
    ap.add_argument("--tune-trials", type=int, default=0, help="tune untuned GroupNorm problems of the rows first")
    ap.add_argument("--rows", default=None,
                    help="comma-separated row names (sd15-unet, sdxl-blocks, vae-decode, vae-encode, resnet50_gn, "
                         "resnet26d, resblocks, resnet50, vgg16) or regular expressions matched against the labels "
                         "(e.g. 'nhwc train')")
    ap.add_argument("--out", default=None)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    default_cols = MODEL_COLUMNS if args.suite == "models" else COLUMNS
    args.columns = tuple(args.columns.split(",")) if args.columns else (
        tuple(c for c in default_cols if c in QUICK_COLUMNS) if args.quick else default_cols)
    bad = [c for c in args.columns if c not in COLUMNS + EXTRA_COLUMNS]
    if bad:
        ap.error(f"--columns: unknown {bad}")
    budget = args.budget if args.budget is not None else (330.0 if args.quick else 1800.0)
    if args.quick:  # few steps and rounds: the compilations take most of the budget
        args.min_steps, args.min_seconds = min(args.min_steps, 5), min(args.min_seconds, 0.25)
        args.warmup, args.profile_steps, args.interleave = min(args.warmup, 2), 1, min(args.interleave, 3)

    try:
        import torch
    except ImportError:
        print("bench/models.py needs PyTorch (pip install 'ckgen[torch]')", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/models.py: no CUDA device (use --smoke --device cpu to check the script)", file=sys.stderr)
        return 2
    import ckgen
    import ckgen.torch  # noqa: F401 - registers the ops

    torch.backends.cudnn.benchmark = True
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"device": name, "torch": torch.__version__, "ckgen": ckgen.__version__, "dtype": args.dtype,
            "date": time.strftime("%Y-%m-%d"), "command": "python bench/models.py " + " ".join(sys.argv[1:]),
            "columns": list(args.columns), "budget_s": budget}
    rows = plan(args.quick, args.smoke, args.suite)
    if args.rows:
        try:  # named rows are picked from both suites
            rows = [r for r in plan(args.quick, args.smoke, "all") if row_selected(r, args.rows)]
        except re.error as e:
            ap.error(f"--rows: not a row name nor a regular expression: {e}")
        if not rows:
            ap.error(f"--rows: {args.rows!r} matches no row; rows: "
                     f"{', '.join(r.label for r in plan(args.quick, args.smoke, 'all'))}")
    print(f"bench/models.py: {len(rows)} row(s), columns {', '.join(args.columns)}, budget {budget:.0f} s", flush=True)
    if args.tune_trials > 0 and device.type == "cuda":
        tune_rows(rows, args.tune_trials, device, args.dtype)
    t0 = time.perf_counter()
    for row in rows:
        spent = time.perf_counter() - t0
        if spent > budget:
            row.skipped = f"time budget of {budget:.0f} s spent"
            continue
        print(f"{row.label} ({spent:.0f} s so far)", flush=True)
        lib = MODEL_ROWS.get(row.name, ("", ""))[1]
        if lib:
            try:
                __import__(lib)
            except Exception as e:  # noqa: BLE001 - the library is missing or broken: the row is skipped
                row.skipped = f"{lib} is not importable ({e.__class__.__name__}: {e}); pip install 'ckgen[models]'"
                print(f"  skipped: {row.skipped}", flush=True)
                continue
        try:
            run_row(row, args, device, dtype, t0 + budget)
        except Exception as e:  # noqa: BLE001 - a row that cannot even be built: recorded, next row
            row.notes.append(f"row failed: {e.__class__.__name__}: {e}")
            if args.verbose:
                traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out or os.environ.get("OUT") or Path(__file__).with_name("results"))
    md = write_report(rows, args, meta, out)
    print(md.read_text())
    print(f"wrote {md} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
