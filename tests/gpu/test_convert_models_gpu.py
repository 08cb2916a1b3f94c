"""GPU tier of convert's adapters on real model libraries: small diffusers UNet2DConditionModel,
AutoencoderKL and ResnetBlock2D modules and timm ResNets (resnet50_gn's GroupNorms, resnet26d's
AvgPool2d shortcuts), converted on CUDA in bf16 channels-last, held to the nn model's own
accuracy against a float64 reference, eager, under torch.compile(fullgraph=True) and
mode="reduce-overhead"; and the ops on strided CUDA inputs (the copy to a dense layout).

Skips where diffusers or timm is missing; every test checks that ckgen's kernels ran
(`ckgen.torch.fallbacks()` stays empty).

    python -m pytest -m gpu tests/gpu/test_convert_models_gpu.py
"""
from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ckgen.torch as ct  # noqa: E402

CL = torch.channels_last
# err(converted) <= 2 * err(nn) + floor, both relative errors against the float64 model (floors:
# output or loss, gradients): bf16 rounding is the only intended difference
FLOOR = {torch.bfloat16: (1e-2, 3e-2), torch.float32: (1e-4, 2e-3)}


@pytest.fixture(autouse=True)
def _no_fallback():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    ct.reset_fallbacks()
    yield
    assert ct.fallbacks() == {}, f"calls fell back to PyTorch: {ct.fallbacks()}"


def _diffusers():
    return pytest.importorskip("diffusers")


def _timm():
    from _torchvision_standin import SKIP_NO_TIMM, import_timm

    timm = import_timm()
    if timm is None:
        pytest.skip(SKIP_NO_TIMM)
    return timm


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _out(y):
    y = y[0] if isinstance(y, (tuple, list)) else y
    return getattr(y, "sample", y)


def _step(model, fn, inputs):
    """One training step's output and parameter gradients (a mean-square loss)."""
    for p in model.parameters():
        p.grad = None
    torch.compiler.cudagraph_mark_step_begin()
    y = _out(fn(*inputs))
    y.float().square().mean().backward()
    return y.detach().clone(), [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters()]


def _errors(run, ref):
    (y, grads), (yr, gr) = run, ref
    return _rel(y, yr), max(_rel(a, b) for a, b in zip(grads, gr) if a is not None and b is not None)


def _check(model, inputs, dtype=torch.bfloat16, mode=None, patterns=(), steps=2):
    """Convert a copy of `model` (on CUDA, dtype, channels-last), run it (eager, or compiled with
    `mode`: "default" / "reduce-overhead") for `steps` training steps, and hold its output and
    gradients to 2x the nn model's error against the float64 model, plus a floor."""
    model = model.cuda().to(dtype).to(memory_format=CL)
    mine = copy.deepcopy(model)
    report = ct.convert(mine, patterns=patterns)
    ref = copy.deepcopy(model).double()
    cast = [t.cuda().to(dtype).contiguous(memory_format=CL) if t.is_floating_point() and t.dim() == 4
            else t.cuda().to(dtype) if t.is_floating_point() else t.cuda() for t in inputs]
    ref_run = _step(ref, ref, [t.double() if t.is_floating_point() else t for t in cast])
    nn_run = _step(model, model, cast)
    fn = mine if mode is None else torch.compile(mine, fullgraph=True, mode=None if mode == "default" else mode)
    for _ in range(steps):  # the compiled graph (and its CUDA graphs) warm up, then the last step counts
        ck_run = _step(mine, fn, cast)
    got, base = _errors(ck_run, ref_run), _errors(nn_run, ref_run)
    fo, fg = FLOOR[dtype]
    assert got[0] <= 2 * base[0] + fo and got[1] <= 2 * base[1] + fg, \
        f"converted ({mode or 'eager'}): (output, grad) errors {got} vs nn's {base}\n{report}"
    return report, mine


# ---------------------------------------------------------------------------------------------
# diffusers
# ---------------------------------------------------------------------------------------------
def _unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(64, 128),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=64, attention_head_dim=8, norm_num_groups=32)


class _UNetStep(nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, x, t, text):
        return self.unet(x, t, encoder_hidden_states=text).sample


@pytest.mark.parametrize("mode", [None, "default", "reduce-overhead"])
def test_diffusers_unet(mode):
    _diffusers()
    torch._dynamo.reset()
    torch.manual_seed(1)
    inputs = [torch.randn(2, 4, 16, 16), torch.tensor([10, 500]), torch.randn(2, 7, 64)]
    report, mine = _check(_UNetStep(_unet()), inputs, mode=mode)
    assert type(mine.unet.conv_norm_out) is ct.GroupNormSwish and type(mine.unet.conv_act) is ct.SiLUPlaceholder
    assert report.adapters()["diffusers.ResnetBlock2D"] > 0


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_diffusers_resnet_block(mode):
    _diffusers()
    from diffusers.models.resnet import ResnetBlock2D

    torch._dynamo.reset()
    torch.manual_seed(2)
    block = ResnetBlock2D(in_channels=64, out_channels=128, temb_channels=32, groups=32)
    holder = nn.ModuleDict({"b": block})

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = holder

        def forward(self, x, temb):
            return self.h["b"](x, temb)

    _check(Step(), [torch.randn(4, 64, 32, 32), torch.randn(4, 32)], mode=mode)


@pytest.mark.parametrize("mode", [None, "default"])
def test_diffusers_vae_decode(mode):
    """The decoder's ResnetBlock2D (time_embedding_norm "group"), its attention block's GroupNorm
    on 3-D tokens, conv_norm_out + conv_act."""
    _diffusers()
    from diffusers import AutoencoderKL

    torch._dynamo.reset()
    torch.manual_seed(3)
    vae = AutoencoderKL(block_out_channels=(64, 128), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=32)

    class Decode(nn.Module):
        def __init__(self):
            super().__init__()
            self.vae = vae

        def forward(self, z):
            return self.vae.decode(z).sample

    report, mine = _check(Decode(), [torch.randn(1, 4, 16, 16)], mode=mode)
    assert type(mine.vae.decoder.mid_block.attentions[0].group_norm) is ct.GroupNorm
    assert type(mine.vae.decoder.conv_norm_out) is ct.GroupNormSwish


# ---------------------------------------------------------------------------------------------
# timm
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [None, "default"])
def test_timm_resnet50_gn(mode):
    timm = _timm()
    torch._dynamo.reset()
    torch.manual_seed(4)
    model = timm.create_model("resnet50_gn", pretrained=False, num_classes=10, layers=(1, 1, 1, 1))
    report, _ = _check(model, [torch.randn(4, 3, 64, 64)], mode=mode)
    assert report.adapters()["timm.GroupNorm"] == 17


@pytest.mark.parametrize("mode", [None, "default", "reduce-overhead"])
def test_timm_resnet26d_compiles(mode):
    """resnet26d's shortcuts pool with AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False):
    convert + torch.compile must compile and train (Inductor hands the custom ops the strides it
    chooses)."""
    timm = _timm()
    torch._dynamo.reset()
    torch.manual_seed(5)
    model = timm.create_model("resnet26d", pretrained=False, num_classes=10)
    report, _ = _check(model, [torch.randn(8, 3, 128, 128)], mode=mode)
    assert report.adapters()["nn.AvgPool2d"] == 3


def test_timm_groupnorm_act_fuses_silu():
    _timm()
    from timm.layers import GroupNormAct

    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), GroupNormAct(64, 32, act_layer="silu"),
                          nn.Conv2d(64, 64, 3, padding=1), GroupNormAct(64, 32, act_layer="relu"))
    _, mine = _check(model, [torch.randn(4, 3, 32, 32)])
    assert mine[1].activation == "swish" and mine[3].activation is None


# ---------------------------------------------------------------------------------------------
# strided inputs on CUDA: the ops copy them to a dense layout
# ---------------------------------------------------------------------------------------------
def test_ops_take_strided_cuda_inputs():
    base = torch.randn(4, 64, 28, 28, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=CL)
    for x in (base[:, :, :14, :14], base[:, :, ::2, ::2], base.transpose(2, 3), base[:1].expand(4, -1, -1, -1)):
        dense = x.contiguous(memory_format=CL if x.stride(1) == 1 else torch.contiguous_format)
        y = torch.ops.ckgen.groupnorm_fwd(x, None, None, 32, 1e-5, "swish")[0]
        torch.testing.assert_close(y, torch.ops.ckgen.groupnorm_fwd(dense, None, None, 32, 1e-5, "swish")[0])
        p = torch.ops.ckgen.avgpool2d_fwd(x, [2, 2], [2, 2], [0, 0], True, False, None)
        torch.testing.assert_close(p, torch.ops.ckgen.avgpool2d_fwd(dense, [2, 2], [2, 2], [0, 0], True, False, None))
        m = torch.ops.ckgen.maxpool2d_fwd(x, [3, 3], [2, 2], [1, 1], [1, 1], False)
        torch.testing.assert_close(m, torch.nn.functional.max_pool2d(dense, 3, 2, 1))
