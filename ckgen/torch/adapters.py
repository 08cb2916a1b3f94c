"""Adapters: how `ckgen.torch.convert` recognizes the GroupNorm-bearing modules of model
libraries (timm, diffusers, LDM/sgm) and what it does with them; a registry users extend.

An `Adapter` names the classes it handles by qualified name (`module.ClassName`, matched
exactly: a subclass is a different class, its forward may differ) and may check the module's
structure (`check`: None when it applies, else the reason it does not, which the report shows).
Two kinds:

- apply=None: a GroupNorm equivalent. The module computes nn.GroupNorm's forward (timm's
  GroupNorm, LDM's GroupNorm32, ...), so convert replaces it with ckgen's GroupNorm, and fuses it
  with a SiLU after it, exactly as it does an nn.GroupNorm.
- apply(module, site): a block. `site` (a `convert.Site`) fuses and replaces the block's
  submodules with every check convert makes for its own rules (the op wanted, modules used in
  one place, no hooks) and records each step in the report under the adapter's name.

    import ckgen.torch as ct

    def my_block(block, site):                      # norm -> SiLU back to back in its forward
        site.fuse("norm", "act")

    ct.register_adapter(ct.Adapter("mylib.MyBlock", classes=("mylib.blocks.MyBlock",), apply=my_block))
    report = ct.convert(model)                      # or convert(model, adapters=[...]) for one call

See docs/extending-convert.md. The built-in adapters are below; each was written against the
library's source, and a check makes sure the class in hand still has that source (the forward's
fingerprint, or the attribute uses its conversion relies on).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from torch import nn

from . import _source

if TYPE_CHECKING:  # pragma: no cover
    from .convert import Site


def qualname(cls: type) -> str:
    """`module.QualifiedName` of a class, what `Adapter.classes` lists."""
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class Adapter:
    """name: shown in the report. classes: qualified class names matched exactly.
    apply: None for a GroupNorm equivalent, else `apply(module, site)`. check(module): None
    when the adapter applies, else why not (the module is then left as it is)."""

    name: str
    classes: tuple[str, ...]
    apply: Optional[Callable[[nn.Module, "Site"], None]] = None
    check: Optional[Callable[[nn.Module], Optional[str]]] = None

    def __post_init__(self) -> None:
        if isinstance(self.classes, str):
            object.__setattr__(self, "classes", (self.classes,))
        object.__setattr__(self, "classes", tuple(self.classes))

    @property
    def groupnorm(self) -> bool:
        """True for a GroupNorm equivalent (apply=None)."""
        return self.apply is None

    def matches(self, m: nn.Module) -> bool:
        return qualname(type(m)) in self.classes

    def why_not(self, m: nn.Module) -> Optional[str]:
        return self.check(m) if self.check is not None else None


_REGISTRY: list[Adapter] = []


def register_adapter(adapter: Adapter, replace: bool = False) -> Adapter:
    """Add `adapter` to those every convert() call uses (an adapter of the same name: ValueError,
    unless replace=True). Returns it."""
    if not isinstance(adapter, Adapter):
        raise TypeError(f"register_adapter: expected an Adapter, got {type(adapter).__name__}")
    for i, a in enumerate(_REGISTRY):
        if a.name == adapter.name:
            if not replace:
                raise ValueError(f"register_adapter: an adapter named {adapter.name!r} is registered "
                                 f"(replace=True to replace it)")
            _REGISTRY[i] = adapter
            return adapter
    _REGISTRY.append(adapter)
    return adapter


def unregister_adapter(name: str) -> Adapter:
    """Remove the registered adapter `name` (KeyError if there is none) and return it."""
    for i, a in enumerate(_REGISTRY):
        if a.name == name:
            return _REGISTRY.pop(i)
    raise KeyError(name)


def registered_adapters() -> list[Adapter]:
    """The registered adapters, built-in ones first, in the order convert() tries them."""
    return list(_REGISTRY)


def find(m: nn.Module, extra: Iterable[Adapter] = ()) -> Optional[Adapter]:
    """The adapter for m's class: a per-call one (convert's `adapters=`) before the registered."""
    q = qualname(type(m))
    for a in (*extra, *_REGISTRY):
        if q in a.classes:
            return a
    return None


def fingerprint_check(known: dict[str, str], method: str = "forward") -> Callable[[nn.Module], Optional[str]]:
    """A `check` that the class's `method` is one of the `known` forms ({fingerprint: where it
    comes from}, see `_source.fingerprint`)."""

    def check(m: nn.Module) -> Optional[str]:
        fp = _source.class_fingerprint(type(m), method)
        if fp is None:
            return f"the source of {type(m).__name__}.{method} cannot be read"
        if fp not in known:
            return (f"{type(m).__name__}.{method} is not a form this adapter knows (fingerprint {fp}; knows "
                    f"{', '.join(sorted(set(known.values())))})")
        return None

    return check


# ---------------------------------------------------------------------------------------------
# timm
# ---------------------------------------------------------------------------------------------
# Fingerprints of the forwards (ckgen.torch._source.fingerprint), and the timm versions they
# were read from. GroupNorm / GroupNorm1: F.group_norm (or timm's fast_group_norm, the same
# computation in the autocast dtype) of the module's own arguments.
TIMM_GROUPNORM = {"d6fbb87912d287e5": "timm 1.0.20-1.0.31", "87782dbe8661b50a": "timm 0.9.16-1.0.9"}
TIMM_GROUPNORM1 = {"0a95cb7ac8514a68": "timm 1.0.20-1.0.31", "5a4198274b3cdb2f": "timm 0.9.16-1.0.9"}
# GroupNormAct / GroupNorm1Act: the same group_norm, then self.drop, then self.act.
TIMM_GROUPNORM_ACT = {"aea75c85c340b5f7": "timm 0.9.16-1.0.31"}


def _timm_gn_act_check(m: nn.Module) -> Optional[str]:
    why = fingerprint_check(TIMM_GROUPNORM_ACT)(m)
    if why:
        return why
    if not isinstance(getattr(m, "drop", None), nn.Module) or not isinstance(getattr(m, "act", None), nn.Module):
        return f"{type(m).__name__} has no drop and act modules"
    return None


def _timm_gn_act(m: nn.Module, site: "Site") -> None:
    """timm's GroupNormAct: ckgen's GroupNormAct (the SiLU fused when act is an nn.SiLU and drop
    an nn.Identity; any other act or drop kept, after ckgen's GroupNorm)."""
    site.replace_groupnorm_act()


# ---------------------------------------------------------------------------------------------
# LDM / sgm (CompVis latent-diffusion and stable-diffusion, Stability-AI generative-models)
# ---------------------------------------------------------------------------------------------
# GroupNorm32: nn.GroupNorm computed in float32 and cast back to x's dtype. ckgen computes the
# statistics in float32 and rounds the output once to x's dtype (the affine parameters cast to
# x's dtype first): the same within x's dtype's rounding.
LDM_GROUPNORM32 = {_source.source_fingerprint('''
def forward(self, x):
    return super().forward(x.float()).type(x.dtype)
'''): "ldm/sgm util.GroupNorm32"}


def _ldm_resblock_check(m: nn.Module) -> Optional[str]:
    for attr in ("in_layers", "out_layers"):
        seq = getattr(m, attr, None)
        if not isinstance(seq, nn.Sequential) or len(seq) < 3:
            return f"{attr} is not an nn.Sequential of a norm, a SiLU and more"
    if not isinstance(getattr(m, "use_scale_shift_norm", None), bool):
        return "no use_scale_shift_norm flag"
    # in_layers is called whole, or as in_layers[:-1] (the norm and the SiLU) then in_layers[-1]
    uses = _source.attr_uses(type(m), "in_layers")
    if uses is None:
        return f"the source of {type(m).__name__}'s methods cannot be read"
    for u in uses:
        if u.kind != "call" and u.what not in ("self.in_layers[:-1]", "self.in_layers[-1]"):
            return f"{type(m).__name__}.{u.method} uses {u.what!r}"
    return None


def _ldm_resblock(m: nn.Module, site: "Site") -> None:
    """LDM/sgm openaimodel ResBlock: in_layers = (norm, SiLU, conv), out_layers = (norm, SiLU,
    dropout, conv). in_layers' pair is fused (the forward calls it whole, or its [:-1] and [-1]:
    the pair stays together). out_layers' pair is fused only without use_scale_shift_norm: with
    it, the forward applies out_layers[0], then the scale and shift, then out_layers[1:]."""
    site.fuse("in_layers.0", "in_layers.1", "the block's in_layers (norm, SiLU, ...)")
    if m.use_scale_shift_norm:
        site.no_fuse("out_layers.0", "use_scale_shift_norm: the forward scales and shifts between out_layers[0] "
                                     "and the SiLU")
        return
    uses = _source.attr_uses(type(m), "out_layers")
    opened = [u for u in uses or [] if u.kind != "call" and not _under_flag(type(m), u, "use_scale_shift_norm")]
    if uses is None or opened:
        why = "its methods cannot be read" if uses is None else f"{opened[0].method} uses {opened[0].what!r}"
        site.no_fuse("out_layers.0", f"out_layers is opened by {type(m).__name__}: {why}")
        return
    site.fuse("out_layers.0", "out_layers.1", "the block's out_layers without use_scale_shift_norm")


def _under_flag(cls: type, use: "_source.Use", flag: str) -> bool:
    """Is this use of an attribute inside an `if self.<flag>:` branch of its method?"""
    return f"self.{flag}" in use.guards


# ---------------------------------------------------------------------------------------------
# diffusers
# ---------------------------------------------------------------------------------------------
# ResnetBlock2D.forward as diffusers wrote it; the three differ only in whether and when the
# shortcut's input is made .contiguous() (the same values; ckgen's forward does what 0.38 does).
DIFFUSERS_RESNET_BLOCK_2D = {"3ceaf447634afaf3": "diffusers 0.38.0-0.42.1", "cd9866315b2507eb": "diffusers 0.35.2",
                             "d184f8d7b3b15118": "diffusers 0.30.3"}


def _resnet_block(m: nn.Module, site: "Site") -> None:
    """diffusers' ResnetBlock2D: norm1 -> nonlinearity and norm2 -> nonlinearity run as fused
    GroupNorm+SiLU modules, and the block's forward becomes ckgen's (`_diffusers.ResnetBlock2D`,
    the same computation that skips the nonlinearity after a fused norm; the shared nonlinearity
    still acts on the time embedding). With time_embedding_norm "scale_shift", norm2's output is
    scaled and shifted before the SiLU: norm2 stays unfused. ("default" adds the time embedding
    before norm2; any other value, such as the VAE decoder's "group" without a time embedding,
    takes diffusers' last branch, norm2 then the SiLU.)"""
    fused = [site.fuse_norm_only("norm1", "nonlinearity", "norm1 then the block's nonlinearity")]
    if m.time_embedding_norm != "scale_shift":
        fused.append(site.fuse_norm_only("norm2", "nonlinearity", "norm2 then the block's nonlinearity"))
    else:
        site.no_fuse("norm2", "time_embedding_norm='scale_shift': norm2's output is scaled and shifted before the "
                              "SiLU")
    if any(fused):
        from . import _diffusers

        site.set_class(_diffusers.resnet_block_2d_class(type(m)),
                       "forward skips the nonlinearity after a fused norm (the time embedding's stays)")
        site.keep("nonlinearity", "kept for what the fused norms do not cover (the time embedding"
                                  + (", norm2's scaled and shifted output" if m.time_embedding_norm == "scale_shift"
                                     else "")
                                  + ")")


def _norm_out_check(m: nn.Module) -> Optional[str]:
    if getattr(m, "conv_norm_out", None) is None or getattr(m, "conv_act", None) is None:
        return "no conv_norm_out / conv_act"
    return _source.back_to_back(type(m), "conv_norm_out", "conv_act")


def _norm_out(m: nn.Module, site: "Site") -> None:
    """UNet2DConditionModel, UNet2DModel, the VAE's Encoder and Decoder: the forward calls
    conv_norm_out then conv_act back to back (checked on its source): GroupNorm+SiLU fused into
    conv_norm_out, conv_act an nn.Identity."""
    site.fuse("conv_norm_out", "conv_act", "called back to back in the forward (checked on its source)")


BUILTIN = (
    Adapter("timm.GroupNorm", ("timm.layers.norm.GroupNorm",), check=fingerprint_check(TIMM_GROUPNORM)),
    Adapter("timm.GroupNorm1", ("timm.layers.norm.GroupNorm1",), check=fingerprint_check(TIMM_GROUPNORM1)),
    Adapter("timm.GroupNormAct", ("timm.layers.norm_act.GroupNormAct", "timm.layers.norm_act.GroupNorm1Act"),
            apply=_timm_gn_act, check=_timm_gn_act_check),
    Adapter("ldm.GroupNorm32", ("ldm.modules.diffusionmodules.util.GroupNorm32",
                                "sgm.modules.diffusionmodules.util.GroupNorm32"),
            check=fingerprint_check(LDM_GROUPNORM32)),
    Adapter("ldm.ResBlock", ("ldm.modules.diffusionmodules.openaimodel.ResBlock",
                             "sgm.modules.diffusionmodules.openaimodel.ResBlock"),
            apply=_ldm_resblock, check=_ldm_resblock_check),
    Adapter("diffusers.ResnetBlock2D", ("diffusers.models.resnet.ResnetBlock2D",),
            apply=_resnet_block, check=fingerprint_check(DIFFUSERS_RESNET_BLOCK_2D)),
    Adapter("diffusers.conv_norm_out+conv_act", ("diffusers.models.unets.unet_2d_condition.UNet2DConditionModel",
                                                 "diffusers.models.unets.unet_2d.UNet2DModel",
                                                 "diffusers.models.autoencoders.vae.Encoder",
                                                 "diffusers.models.autoencoders.vae.Decoder"),
            apply=_norm_out, check=_norm_out_check),
)
for _a in BUILTIN:
    register_adapter(_a)


__all__ = ["Adapter", "BUILTIN", "find", "fingerprint_check", "qualname", "register_adapter", "registered_adapters",
           "unregister_adapter"]
