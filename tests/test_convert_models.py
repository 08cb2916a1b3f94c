"""CPU tier of convert's adapters: timm's GroupNorm modules, diffusers' ResnetBlock2D and
conv_norm_out + conv_act pairs (tiny UNet and VAE), LDM/sgm's GroupNorm32 and ResBlock, the
source checks behind them, and the user registry. Each converted module runs through ckgen's
custom ops (their CPU kernels: PyTorch's computation in float32) and is compared with the library's
own module, outputs and gradients.

diffusers comes with the test extra; timm is optional (`pip install --no-deps timm`, which keeps
the CPU torch): its tests skip where it is missing. timm needs torchvision, whose PyPI builds do
not load next to torch's CPU wheel: see tests/_torchvision_standin.py. LDM/sgm are not packages on PyPI: their classes are written here
as those repositories define them (same module names, attributes and forwards)."""
from __future__ import annotations

import copy
import sys
import types

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ckgen.torch as ct  # noqa: E402
from ckgen.torch import _source  # noqa: E402
from ckgen.torch import adapters as A  # noqa: E402
from ckgen.torch import functional as CF  # noqa: E402

CL = torch.channels_last


@pytest.fixture(autouse=True)
def route_cpu(monkeypatch):
    """CPU tensors go through ckgen's custom ops (their CPU kernels) instead of nn's op."""
    monkeypatch.setattr(CF, "_ROUTE_CPU", True)
    monkeypatch.setenv("CKGEN_QUIET", "1")
    ct.reset_fallbacks()
    yield
    ct.reset_fallbacks()


def _diffusers():
    return pytest.importorskip("diffusers")


def _timm():
    from _torchvision_standin import SKIP_NO_TIMM, import_timm

    timm = import_timm()
    if timm is None:
        pytest.skip(SKIP_NO_TIMM)
    return timm


def _same_training_step(model, ref, *inputs, out=lambda o: o, atol=1e-5, rtol=1e-4, modules=None):
    """model(*inputs) == ref(*inputs), and every gradient (inputs and parameters) equal;
    `modules`: the (converted, reference) modules whose parameters to compare when model and
    ref are functions."""
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    xr = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    y, yr = out(model(*xs)), out(ref(*xr))
    torch.testing.assert_close(y, yr, atol=atol, rtol=rtol)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    for a, b in zip(xs, xr):
        if a.is_floating_point():
            torch.testing.assert_close(a.grad, b.grad, atol=atol, rtol=rtol)
    mine, theirs = modules or (model, ref)
    pr = dict(theirs.named_parameters())
    for n, p in mine.named_parameters():
        if p.grad is None and pr[n].grad is None:
            continue
        torch.testing.assert_close(p.grad, pr[n].grad, atol=atol, rtol=rtol, msg=n)
    return y


def _by_name(report):
    return {e.name: e for e in report.replaced}, {e.name: e for e in report.left}


# ---------------------------------------------------------------------------------------------
# the source checks
# ---------------------------------------------------------------------------------------------
class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.act, self.conv = nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv2d(4, 4, 1)


class BackToBack(_Pair):
    def forward(self, x, flag: bool = True):
        if flag:
            x = self.norm(x)
        else:
            x = self.norm(x * 2)
        x = self.act(x)
        return self.conv(x)


class ActTwice(_Pair):
    def forward(self, x):
        x = self.act(self.norm(x))
        return self.act(self.conv(x))


class IfWithoutElse(_Pair):
    def forward(self, x, flag: bool = True):
        if flag:
            x = self.norm(x)
        x = self.act(x)
        return self.conv(x)


class OtherVar(_Pair):
    def forward(self, x):
        h = self.norm(x)
        h = self.act(x)
        return self.conv(h)


class InLoop(_Pair):
    def forward(self, x):
        for _ in range(2):
            x = self.norm(x)
            x = self.act(x)
        return x


class LoopAround(_Pair):
    def forward(self, x):
        for _ in range(2):
            x = self.act(x)
            x = self.norm(x)
        return x


def test_back_to_back_reads_the_forward():
    assert _source.back_to_back(BackToBack, "norm", "act") is None
    assert _source.back_to_back(InLoop, "norm", "act") is None, "back to back in every iteration"
    for cls, word in ((ActTwice, "other than"), (IfWithoutElse, "something else"), (OtherVar, "not followed"),
                      (LoopAround, "not followed")):
        why = _source.back_to_back(cls, "norm", "act")
        assert why and word in why, (cls.__name__, why)


def test_fingerprint_ignores_layout_comments_and_docstrings_not_code():
    a = _source.source_fingerprint("def f(self, x):\n    'doc'\n    return x + 1  # why\n")
    b = _source.source_fingerprint("def f(self,x):\n\n    return (x\n            + 1)\n")
    c = _source.source_fingerprint("def f(self, x):\n    return x + 2\n")
    assert a == b != c


def test_a_class_with_an_adapters_name_but_another_forward_is_left_alone():
    """Recognition is by qualified name *and* source: a same-named GroupNorm subclass whose
    forward is not timm's (here it adds 1) keeps its own forward."""
    def forward(self, x):
        return nn.functional.group_norm(x, self.num_groups, self.weight, self.bias, self.eps) + 1

    Fake = type("GroupNorm", (nn.GroupNorm,), {"forward": forward, "__module__": "timm.layers.norm"})
    Fake.__qualname__ = "GroupNorm"
    model = nn.Sequential(Fake(2, 8), nn.SiLU())
    report = ct.convert(model)
    assert type(model[0]) is Fake and type(model[1]) is nn.SiLU, str(report)
    _, left = _by_name(report)
    assert "not a form this adapter knows" in left["0"].reason and left["0"].adapter == "timm.GroupNorm"


def test_a_sequential_its_owner_indexes_is_not_fused():
    """LDM-style forks apply out_layers[0], then a scale and shift, then out_layers[1:]: fusing
    the Sequential's GroupNorm with its SiLU would put the SiLU before the scale and shift."""

    class ScaleShift(nn.Module):
        def __init__(self):
            super().__init__()
            self.out_layers = nn.Sequential(nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 8, 1))
            self.plain = nn.Sequential(nn.GroupNorm(2, 8), nn.SiLU())

        def forward(self, x):
            h = self.out_layers[0](x) * 2 + 1
            return self.out_layers[1:](h) + self.plain(x)

    model = ScaleShift()
    ref = copy.deepcopy(model)
    report = ct.convert(model)
    _, left = _by_name(report)
    assert type(model.out_layers[0]) is ct.GroupNorm and type(model.out_layers[1]) is nn.SiLU
    assert "self.out_layers[0]" in left["out_layers.0"].reason
    assert type(model.plain[0]) is ct.GroupNormSwish, "a Sequential called whole is fused"
    _same_training_step(model, ref, torch.randn(2, 8, 5, 5))


def test_user_adapter_registry():
    class MyBlock(nn.Module):  # norm -> SiLU in the forward, not in a Sequential
        def __init__(self):
            super().__init__()
            self.norm, self.act, self.conv = nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            h = self.norm(x)
            h = self.act(h)
            return x + self.conv(h)

    def apply(block, site):
        site.fuse("norm", "act", "MyBlock's forward")

    adapter = ct.Adapter("test.MyBlock", A.qualname(MyBlock), apply=apply,
                         check=lambda m: _source.back_to_back(type(m), "norm", "act"))
    model = nn.Sequential(MyBlock(), MyBlock())
    ref = copy.deepcopy(model)
    once = copy.deepcopy(model)
    # per call
    rep = ct.convert(once, adapters=[adapter])
    assert type(once[0].norm) is ct.GroupNormSwish and rep.adapters()["test.MyBlock"] == 4
    # registered
    ct.register_adapter(adapter)
    try:
        with pytest.raises(ValueError, match="registered"):
            ct.register_adapter(adapter)
        assert adapter in ct.registered_adapters()
        report = ct.convert(model)
    finally:
        assert ct.unregister_adapter("test.MyBlock") is adapter
    assert adapter not in ct.registered_adapters()
    replaced, _ = _by_name(report)
    assert replaced["0.norm"].adapter == "test.MyBlock" and replaced["0.act"].result == "SiLUPlaceholder"
    assert "[test.MyBlock]" in str(report)
    _same_training_step(model, ref, torch.randn(2, 8, 6, 6))
    plain = copy.deepcopy(ref)
    ct.convert(plain)
    assert type(plain[0].norm) is ct.GroupNorm and type(plain[0].act) is nn.SiLU, "unregistered: no fusion"


def test_group_norm_takes_3d_inputs_as_4d_views():
    """diffusers' Attention normalizes (N, C, H*W) tokens: ckgen runs them as (N, C, L, 1)."""
    gn = nn.GroupNorm(4, 16, eps=1e-6)
    mine = ct.GroupNorm.from_module(copy.deepcopy(gn))
    tokens = torch.randn(2, 30, 16)  # (N, L, C) as the attention processor holds them
    y = _same_training_step(lambda t: mine(t.transpose(1, 2)), lambda t: gn(t.transpose(1, 2)), tokens,
                            modules=(mine, gn))
    assert y.shape == (2, 16, 30) and ct.fallbacks() == {}


# ---------------------------------------------------------------------------------------------
# LDM / sgm (not on PyPI: the classes as those repositories define them, under their module names)
# ---------------------------------------------------------------------------------------------
def _ldm_classes(pkg: str):
    class GroupNorm32(nn.GroupNorm):
        def forward(self, x):
            return super().forward(x.float()).type(x.dtype)

    class ResBlock(nn.Module):
        def __init__(self, channels, emb_channels, out_channels=None, use_scale_shift_norm=False, updown=False):
            super().__init__()
            self.out_channels = out_channels or channels
            self.use_scale_shift_norm, self.updown = use_scale_shift_norm, updown
            self.in_layers = nn.Sequential(GroupNorm32(4, channels), nn.SiLU(),
                                           nn.Conv2d(channels, self.out_channels, 3, padding=1))
            self.h_upd = self.x_upd = nn.AvgPool2d(2) if updown else nn.Identity()
            self.emb_layers = nn.Sequential(
                nn.SiLU(), nn.Linear(emb_channels, 2 * self.out_channels if use_scale_shift_norm else self.out_channels))
            self.out_layers = nn.Sequential(GroupNorm32(4, self.out_channels), nn.SiLU(), nn.Dropout(p=0.0),
                                            nn.Conv2d(self.out_channels, self.out_channels, 3, padding=1))
            self.skip_connection = nn.Identity() if self.out_channels == channels else \
                nn.Conv2d(channels, self.out_channels, 1)

        def forward(self, x, emb):
            return self._forward(x, emb)

        def _forward(self, x, emb):
            if self.updown:
                in_rest, in_conv = self.in_layers[:-1], self.in_layers[-1]
                h = in_rest(x)
                h = self.h_upd(h)
                x = self.x_upd(x)
                h = in_conv(h)
            else:
                h = self.in_layers(x)
            emb_out = self.emb_layers(emb).type(h.dtype)
            while len(emb_out.shape) < len(h.shape):
                emb_out = emb_out[..., None]
            if self.use_scale_shift_norm:
                out_norm, out_rest = self.out_layers[0], self.out_layers[1:]
                scale, shift = torch.chunk(emb_out, 2, dim=1)
                h = out_norm(h) * (1 + scale) + shift
                h = out_rest(h)
            else:
                h = h + emb_out
                h = self.out_layers(h)
            return self.skip_connection(x) + h

    GroupNorm32.__module__ = f"{pkg}.modules.diffusionmodules.util"
    ResBlock.__module__ = f"{pkg}.modules.diffusionmodules.openaimodel"
    GroupNorm32.__qualname__, ResBlock.__qualname__ = "GroupNorm32", "ResBlock"
    return GroupNorm32, ResBlock


@pytest.mark.parametrize("pkg", ["ldm", "sgm"])
@pytest.mark.parametrize("scale_shift", [False, True])
@pytest.mark.parametrize("updown", [False, True])
def test_ldm_resblock_and_groupnorm32(pkg, scale_shift, updown):
    GroupNorm32, ResBlock = _ldm_classes(pkg)
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("block", ResBlock(8, 16, 12, use_scale_shift_norm=scale_shift, updown=updown))

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = model
            self.norm = GroupNorm32(4, 12)

        def forward(self, x, emb):
            return self.norm(self.blocks[0](x, emb))

    net = Wrap()
    ref = copy.deepcopy(net)
    report = ct.convert(net)
    replaced, left = _by_name(report)
    blk = net.blocks.block
    assert type(blk.in_layers[0]) is ct.GroupNormSwish and type(blk.in_layers[1]) is ct.SiLUPlaceholder
    assert replaced["blocks.block.in_layers.0"].adapter == "ldm.ResBlock"
    if scale_shift:
        assert type(blk.out_layers[0]) is ct.GroupNorm and type(blk.out_layers[1]) is nn.SiLU
        assert "use_scale_shift_norm" in left["blocks.block.out_layers.0"].reason
    else:
        assert type(blk.out_layers[0]) is ct.GroupNormSwish and type(blk.out_layers[1]) is ct.SiLUPlaceholder
    assert type(net.norm) is ct.GroupNorm and replaced["norm"].adapter == "ldm.GroupNorm32"
    x = torch.randn(2, 8, 8, 8).contiguous(memory_format=CL)
    _same_training_step(net, ref, x, torch.randn(2, 16))
    assert ct.fallbacks() == {}


def test_groupnorm32_rounds_like_the_original_in_bf16():
    """GroupNorm32 (float32 parameters, a bf16 input, as under autocast) computes in float32 and
    casts back; ckgen computes the statistics in float32 with the parameters cast to bf16 and
    rounds once: within bf16 rounding (a few units of its 8-bit mantissa)."""
    GroupNorm32, _ = _ldm_classes("sgm")
    ref = GroupNorm32(4, 16)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    model = nn.Sequential(copy.deepcopy(ref))
    ct.convert(model)
    x = torch.randn(2, 16, 6, 6).to(torch.bfloat16)
    torch.testing.assert_close(model(x), ref(x), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# timm
# ---------------------------------------------------------------------------------------------
def test_timm_fingerprints_are_known():
    """The installed timm's GroupNorm classes are forms the adapters know (a timm release that
    changes them fails here, to be read and added)."""
    _timm()
    from timm.layers import GroupNorm, GroupNorm1, GroupNorm1Act, GroupNormAct

    for cls, known in ((GroupNorm, A.TIMM_GROUPNORM), (GroupNorm1, A.TIMM_GROUPNORM1),
                       (GroupNormAct, A.TIMM_GROUPNORM_ACT), (GroupNorm1Act, A.TIMM_GROUPNORM_ACT)):
        assert _source.class_fingerprint(cls) in known, cls


@pytest.mark.parametrize("layout", ["nhwc"])
def test_timm_resnet50_gn(layout):
    timm = _timm()
    torch.manual_seed(0)
    # resnet50_gn's layers, one Bottleneck per stage (the test's time: 53 GroupNorms take 15 s on 2 cores)
    ref = timm.create_model("resnet50_gn", pretrained=False, num_classes=10, layers=(1, 1, 1, 1))
    model = copy.deepcopy(ref)
    report = ct.convert(model)
    n = sum(1 for m in ref.modules() if A.qualname(type(m)) == "timm.layers.norm.GroupNorm")
    assert n == 17 and report.adapters()["timm.GroupNorm"] == n, str(report)
    assert sum(type(m) is ct.GroupNorm for m in model.modules()) == n
    x = torch.randn(2, 3, 32, 32)
    if layout == "nhwc":
        model, ref, x = model.to(memory_format=CL), ref.to(memory_format=CL), x.contiguous(memory_format=CL)
    _same_training_step(model, ref, x, atol=1e-4, rtol=1e-3)
    assert ct.fallbacks() == {}


@pytest.mark.parametrize("kind,kw,fused", [
    ("GroupNormAct", dict(num_groups=4, act_layer="silu"), True),
    ("GroupNormAct", dict(num_groups=4, act_layer="relu"), False),
    ("GroupNormAct", dict(num_groups=4, apply_act=False), False),
    ("GroupNormAct", dict(num_groups=4, act_layer="leaky_relu", act_kwargs={"negative_slope": 0.2}), False),
    ("GroupNormAct", dict(num_groups=4, act_layer="silu", drop_layer=lambda: nn.Dropout(0.0)), False),
    ("GroupNormAct", dict(group_size=8, act_layer=nn.SiLU, inplace=True), True),
    ("GroupNorm1Act", dict(act_layer="silu"), True),
    ("GroupNorm1Act", dict(act_layer="gelu"), False),
])
def test_timm_groupnorm_act(kind, kw, fused):
    _timm()
    import timm.layers as L

    torch.manual_seed(0)
    mod = getattr(L, kind)(16, **kw)
    with torch.no_grad():
        mod.weight.normal_()
        mod.bias.normal_()
    model = nn.Sequential(nn.Conv2d(3, 16, 1), mod)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    report = ct.convert(model)
    replaced, _ = _by_name(report)
    assert type(model[1]) is ct.GroupNormAct and replaced["1"].adapter == "timm.GroupNormAct"
    assert (model[1].activation == "swish") is fused
    assert type(model[1].act) is (ct.SiLUPlaceholder if fused else type(mod.act))
    assert model[1].drop is mod.drop and list(model.state_dict()) == keys
    assert model[1].weight is mod.weight
    _same_training_step(model, ref, torch.randn(2, 3, 5, 7))


@pytest.mark.parametrize("cls_name,groups", [("GroupNorm", 4), ("GroupNorm1", 1)])
def test_timm_groupnorm_fuses_with_a_silu_after_it(cls_name, groups):
    _timm()
    import timm.layers as L

    norm = getattr(L, cls_name)(16, groups) if cls_name == "GroupNorm" else L.GroupNorm1(16)
    model = nn.Sequential(norm, nn.SiLU(), nn.Conv2d(16, 4, 1), L.GroupNorm(4, 2) if False else nn.Identity())
    ref = copy.deepcopy(model)
    report = ct.convert(model)
    replaced, _ = _by_name(report)
    assert type(model[0]) is ct.GroupNormSwish and model[0].num_groups == groups
    assert replaced["0"].adapter == f"timm.{cls_name}"
    _same_training_step(model, ref, torch.randn(2, 16, 4, 4))


# ---------------------------------------------------------------------------------------------
# diffusers
# ---------------------------------------------------------------------------------------------
def test_diffusers_fingerprints_are_known():
    _diffusers()
    from diffusers.models.resnet import ResnetBlock2D

    assert _source.class_fingerprint(ResnetBlock2D) in A.DIFFUSERS_RESNET_BLOCK_2D


_BLOCKS = {
    "default": dict(in_channels=8, temb_channels=16),
    "no temb": dict(in_channels=8, temb_channels=None),
    "scale_shift": dict(in_channels=8, temb_channels=16, time_embedding_norm="scale_shift"),
    "shortcut, out 12": dict(in_channels=8, out_channels=12, temb_channels=16, output_scale_factor=2.0),
    "up": dict(in_channels=8, temb_channels=16, up=True),
    "down": dict(in_channels=8, temb_channels=16, down=True),
    "fir up": dict(in_channels=8, temb_channels=16, up=True, kernel="fir"),
    "sde_vp down": dict(in_channels=8, temb_channels=16, down=True, kernel="sde_vp"),
    "skip_time_act": dict(in_channels=8, temb_channels=16, skip_time_act=True),
    "dropout (train)": dict(in_channels=8, temb_channels=16, dropout=0.3),
    "groups_out": dict(in_channels=8, out_channels=16, temb_channels=16, groups_out=8),
    "group, no temb (VAE decoder)": dict(in_channels=8, temb_channels=None, time_embedding_norm="group"),
}


@pytest.mark.parametrize("case", list(_BLOCKS))
def test_diffusers_resnet_block2d(case):
    _diffusers()
    from diffusers.models.resnet import ResnetBlock2D

    from ckgen.torch import _diffusers as CD

    torch.manual_seed(0)
    ref = ResnetBlock2D(groups=4, **_BLOCKS[case]).train()
    holder = nn.ModuleDict({"block": copy.deepcopy(ref)})
    report = ct.convert(holder)
    blk = holder["block"]
    replaced, left = _by_name(report)
    assert type(blk) is CD.ResnetBlock2D and isinstance(blk, ResnetBlock2D), str(report)
    assert replaced["block"].adapter == "diffusers.ResnetBlock2D"
    assert type(blk.norm1) is ct.GroupNormSwish
    scale_shift = case == "scale_shift"
    assert type(blk.norm2) is (ct.GroupNorm if scale_shift else ct.GroupNormSwish)
    assert type(blk.nonlinearity) is nn.SiLU and "kept for" in left["block.nonlinearity"].reason
    if scale_shift:
        assert "scale_shift" in left["block.norm2"].reason
    assert list(blk.state_dict()) == list(ref.state_dict())
    # channels-last, but NCHW for the upsampling blocks: torch's CPU backward of diffusers' plain
    # block with up=True crashes (SIGSEGV, torch 2.13 CPU) or returns wrong gradients on a
    # channels-last input, without ckgen in the model
    x = torch.randn(2, 8, 8, 8).contiguous(memory_format=torch.contiguous_format if "up" in case else CL)
    temb = torch.randn(2, 16) if ref.time_emb_proj is not None else None
    inputs = (x, temb) if temb is not None else (x,)
    run = (lambda m: (lambda *a: m(*a) if temb is not None else m(a[0], None)))
    torch.manual_seed(5)  # dropout: the same draws for both (the same shapes, in the same order)
    state = torch.get_rng_state()
    xs = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = run(blk)(*xs)
    torch.set_rng_state(state)
    xr = [t.detach().clone().requires_grad_(True) for t in inputs]
    yr = run(ref)(*xr)
    torch.testing.assert_close(y, yr, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    for a, b in zip(xs, xr):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)
    for (n, p), (_, q) in zip(blk.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=n)
    # eval mode, and a copy and a pickle of the converted block
    blk.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(run(copy.deepcopy(blk))(*inputs), run(ref)(*inputs), atol=1e-5, rtol=1e-4)
    if "fir" not in case:  # diffusers' FIR blocks hold a lambda: they do not pickle converted or not
        import pickle

        assert type(pickle.loads(pickle.dumps(blk))) is CD.ResnetBlock2D
    assert ct.fallbacks() == {}


def test_diffusers_resnet_block2d_left_alone():
    """Not converted: another nonlinearity (mish), hooks on the nonlinearity or a norm."""
    _diffusers()
    from diffusers.models.resnet import ResnetBlock2D

    mish = ResnetBlock2D(in_channels=8, temb_channels=16, groups=4, non_linearity="mish")
    hooked_act = ResnetBlock2D(in_channels=8, temb_channels=16, groups=4)
    hooked_act.nonlinearity.register_forward_hook(lambda *a: None)
    hooked_norm = ResnetBlock2D(in_channels=8, temb_channels=16, groups=4)
    hooked_norm.norm2.register_forward_pre_hook(lambda *a: None)
    holder = nn.ModuleList([mish, hooked_act, hooked_norm])
    ref = copy.deepcopy(holder)
    report = ct.convert(holder)
    _, left = _by_name(report)
    assert type(holder[0]) is ResnetBlock2D and type(holder[0].norm1) is ct.GroupNorm
    assert "Mish, not nn.SiLU" in left["0.norm1"].reason
    assert type(holder[1]) is ResnetBlock2D and "SiLU has hooks" in left["1.norm1"].reason
    assert type(holder[2]) is not ResnetBlock2D and type(holder[2].norm1) is ct.GroupNormSwish
    assert type(holder[2].norm2) is ct.GroupNorm and "GroupNorm has hooks" in left["2.norm2"].reason
    x, temb = torch.randn(2, 8, 6, 6), torch.randn(2, 16)
    for a, b in zip(holder, ref):
        torch.testing.assert_close(a(x, temb), b(x, temb), atol=1e-5, rtol=1e-4)


def _tiny_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=8, norm_num_groups=8)


def _edit_both(model, ref, edit):
    """The same edit to the converted model and to its reference."""
    edit(model)
    edit(ref)


def test_diffusers_block_edited_after_convert_runs_the_edit():
    """After convert, a new nonlinearity was ignored (the fused norms kept their SiLU) and a hook
    on it saw 1 call instead of 3: the block's forward now checks that the SiLU it fused is still
    there, unhooked, and runs the unfused path if not."""
    _diffusers()
    from diffusers.models.resnet import ResnetBlock2D

    torch.manual_seed(0)
    ref = ResnetBlock2D(in_channels=8, temb_channels=16, groups=4).eval()
    holder = nn.ModuleDict({"block": copy.deepcopy(ref)})
    ct.convert(holder)
    blk = holder["block"]
    x, temb = torch.randn(2, 8, 6, 6), torch.randn(2, 16)
    calls = {"mine": 0, "ref": 0}
    for m, k in ((blk, "mine"), (ref, "ref")):
        m.nonlinearity.register_forward_hook(lambda *a, k=k: calls.__setitem__(k, calls[k] + 1))
    with torch.no_grad():
        torch.testing.assert_close(blk(x, temb), ref(x, temb), atol=1e-5, rtol=1e-4)
    assert calls["mine"] == calls["ref"] == 3
    _edit_both(blk, ref, lambda m: setattr(m, "nonlinearity", nn.GELU()))
    with torch.no_grad():
        torch.testing.assert_close(blk(x, temb), ref(x, temb), atol=1e-5, rtol=1e-4)
    _edit_both(blk, ref, lambda m: setattr(m, "nonlinearity", nn.SiLU()))  # a SiLU again, but not the fused one
    with torch.no_grad():
        torch.testing.assert_close(blk(x, temb), ref(x, temb), atol=1e-5, rtol=1e-4)


def test_timm_groupnorm_act_edited_after_convert_runs_the_edit():
    """`m.act = nn.ReLU()` after convert stacked the ReLU on the fused SiLU."""
    _timm()
    import timm.layers as L

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 1), L.GroupNormAct(16, num_groups=4, act_layer="silu"))
    ref = copy.deepcopy(model)
    ct.convert(model)
    assert model[1].activation == "swish"
    _edit_both(model[1], ref[1], lambda m: setattr(m, "act", nn.ReLU()))
    _same_training_step(model, ref, torch.randn(2, 3, 5, 7))


def test_a_global_module_hook_sees_the_unfused_outputs():
    """A hook registered with register_module_forward_hook after convert saw the fused output
    where it expected the GroupNorm's; global hooks now turn fusion off as local ones do."""
    _diffusers()
    from diffusers.models.resnet import ResnetBlock2D

    torch.manual_seed(0)
    ref = nn.ModuleDict({"seq": nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(4, 8), nn.SiLU()),
                         "block": ResnetBlock2D(in_channels=8, temb_channels=16, groups=4)}).eval()
    model = copy.deepcopy(ref)
    ct.convert(model)
    assert type(model["seq"][1]) is ct.GroupNormSwish and type(model["block"].norm1) is ct.GroupNormSwish

    def run(m, x, temb):
        return m["block"](m["seq"](x), temb)

    x, temb = torch.randn(2, 3, 6, 6), torch.randn(2, 16)
    edit = nn.modules.module.register_module_forward_hook(
        lambda m, i, o: o * 2 + 1 if isinstance(m, nn.GroupNorm) else None)
    try:
        with torch.no_grad():
            torch.testing.assert_close(run(model, x, temb), run(ref, x, temb), atol=1e-5, rtol=1e-4)
    finally:
        edit.remove()
    with torch.no_grad():  # the hook gone, fused again
        torch.testing.assert_close(run(model, x, temb), run(ref, x, temb), atol=1e-5, rtol=1e-4)


def test_a_sequential_edited_after_convert_runs_the_edit():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv2d(8, 4, 1))
    model = copy.deepcopy(ref)
    ct.convert(model)
    assert type(model[1]) is ct.GroupNormSwish and isinstance(model[2], nn.Identity)
    _edit_both(model, ref, lambda m: m.__setitem__(2, nn.GELU()))
    _same_training_step(model, ref, torch.randn(2, 3, 5, 5))
    _edit_both(model, ref, lambda m: m.__setitem__(1, nn.BatchNorm2d(8)))  # the fused norm itself replaced
    _same_training_step(model.eval(), ref.eval(), torch.randn(2, 3, 5, 5))


class _Untraceable(nn.Module):
    """A block torch.fx cannot trace (a branch on a tensor's value) that applies its SiLU to more
    than the norm's output (`act(h) + h`)."""

    def __init__(self):
        super().__init__()
        self.norm, self.act = nn.GroupNorm(2, 4), nn.SiLU()

    def forward(self, x):
        h = self.norm(x)
        if h.sum() > 1e9:
            h = h * 0
        return self.act(h) + h


def test_a_pattern_fused_on_trust_warns():
    """A FusePattern whose block does not trace (nor reads as norm-then-act back to back in its
    source) was fused with only a report line; it now warns."""
    model = nn.Sequential(_Untraceable())
    with pytest.warns(UserWarning, match=r"unverified.*0\.norm"):
        report = ct.convert(model, patterns=[ct.FusePattern(_Untraceable, "norm", "act")])
    assert "unverified" in {e.name: e for e in report.replaced}["0.norm"].reason


def test_diffusers_unet2d_condition():
    _diffusers()
    ref = _tiny_unet()
    model = copy.deepcopy(ref)
    report = ct.convert(model)
    replaced, _ = _by_name(report)
    assert type(model.conv_norm_out) is ct.GroupNormSwish and type(model.conv_act) is ct.SiLUPlaceholder
    assert replaced["conv_norm_out"].adapter == "diffusers.conv_norm_out+conv_act"
    blocks = report.counts()["ResnetBlock2D -> ckgen.torch._diffusers.ResnetBlock2D"]
    assert blocks == sum(1 for m in ref.modules() if type(m).__name__ == "ResnetBlock2D") == 8
    assert report.counts()["GroupNorm -> GroupNormSwish"] == 2 * blocks + 1
    assert report.adapters()["nn.GroupNorm"] == 4, "the transformer blocks' GroupNorms"
    x = torch.randn(2, 4, 8, 8).contiguous(memory_format=CL)
    t, enc = torch.tensor([3, 700]), torch.randn(2, 5, 16)
    _same_training_step(model, ref, x, t, enc, out=lambda o: o.sample)
    assert ct.fallbacks() == {}


@pytest.mark.parametrize("part", ["decode", "encode"])
def test_diffusers_autoencoder_kl(part):
    _diffusers()
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    ref = AutoencoderKL(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8)
    model = copy.deepcopy(ref)
    report = ct.convert(model)
    for coder in (model.encoder, model.decoder):
        assert type(coder.conv_norm_out) is ct.GroupNormSwish and type(coder.conv_act) is ct.SiLUPlaceholder
    attn = model.decoder.mid_block.attentions[0]
    assert type(attn.group_norm) is ct.GroupNorm, "the attention block's GroupNorm (3-D tokens)"
    from diffusers.models.resnet import ResnetBlock2D

    # every block converted, the decoder's too (their time_embedding_norm is "group", without a time embedding)
    assert not any(type(m) is ResnetBlock2D for m in model.modules()) and report.adapters()["diffusers.ResnetBlock2D"]
    if part == "decode":
        z = torch.randn(1, 4, 8, 8)
        _same_training_step(lambda t: model.decode(t).sample, lambda t: ref.decode(t).sample, z, atol=1e-4,
                            modules=(model.decoder, ref.decoder))
    else:
        x = torch.randn(1, 3, 16, 16)
        _same_training_step(lambda t: model.encode(t).latent_dist.mean, lambda t: ref.encode(t).latent_dist.mean, x,
                            atol=1e-4, modules=(model.encoder, ref.encoder))
    assert ct.fallbacks() == {}


def test_diffusers_decoder_with_spatial_norm_keeps_its_norm():
    _diffusers()
    from diffusers.models.autoencoders.vae import Decoder

    dec = Decoder(in_channels=4, out_channels=3, up_block_types=("UpDecoderBlock2D",), block_out_channels=(32,),
                  norm_num_groups=8, norm_type="spatial")
    holder = nn.ModuleDict({"dec": dec})
    report = ct.convert(holder)
    _, left = _by_name(report)
    assert type(dec.conv_norm_out).__name__ == "SpatialNorm" and type(dec.conv_act) is nn.SiLU
    assert "not a GroupNorm" in left["dec.conv_norm_out"].reason


def test_diffusers_resnet_block_compiles(route_cpu):
    """torch.compile(fullgraph=True) of a converted block: the class's forward traces, the ops
    are in the graph, the step matches eager."""
    _diffusers()
    from diffusers.models.resnet import ResnetBlock2D

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = ResnetBlock2D(in_channels=8, out_channels=12, temb_channels=16, groups=4)
    holder = nn.ModuleList([copy.deepcopy(ref)])
    ct.convert(holder)
    compiled = torch.compile(holder[0], fullgraph=True, backend="aot_eager")
    x, temb = torch.randn(2, 8, 6, 6).contiguous(memory_format=CL), torch.randn(2, 16)
    _same_training_step(compiled, ref, x, temb, modules=(holder[0], ref))
