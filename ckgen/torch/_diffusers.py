"""diffusers' ResnetBlock2D with ckgen's forward: the `diffusers.ResnetBlock2D` adapter
(ckgen.torch.adapters) sets converted blocks' class to this subclass.

Imported only by that adapter, i.e. when a model holds a diffusers ResnetBlock2D (diffusers is
then importable). The class lives at module level so that converted models pickle and deepcopy.
"""
from __future__ import annotations

import torch
from diffusers.models.resnet import ResnetBlock2D as _DiffusersResnetBlock2D
from diffusers.utils import deprecate

from .modules import GroupNormSwish


def _applies_silu(norm: torch.nn.Module) -> bool:
    """Does `norm` apply the block's SiLU itself: a fused norm whose fusion still holds (the
    nonlinearity convert fused is still there, unhooked: `Fusion.holds`)?"""
    return isinstance(norm, GroupNormSwish) and norm.applies_activation()

_SCALE_DEPRECATED = ("The `scale` argument is deprecated and will be ignored. Please remove it, as passing it will "
                     "raise an error in the future. `scale` should directly be passed while calling the underlying "
                     "pipeline component i.e., via `cross_attention_kwargs`.")


class ResnetBlock2D(_DiffusersResnetBlock2D):
    """diffusers' ResnetBlock2D whose norm1 (and, unless time_embedding_norm is "scale_shift",
    norm2) may be a ckgen GroupNormSwish: the SiLU then runs inside the GroupNorm kernels and the forward
    does not apply `nonlinearity` after it. Everything else is diffusers' forward (as of
    diffusers 0.38-0.42): a norm applies the SiLU only while its fusion holds (the
    nonlinearity convert fused is still the block's, and no hooks are on either: `Fusion.holds`),
    else the forward applies `nonlinearity` after it; up/downsampling, the time embedding (through the shared
    `nonlinearity` unless skip_time_act), "default" and "scale_shift" conditioning, dropout,
    conv_shortcut (its input made contiguous in training, as diffusers does) and
    output_scale_factor; a norm2 that is not fused (scale_shift, hooks) is followed by
    `nonlinearity` as in diffusers. Same attributes, parameters and state_dict as the diffusers block, and
    an instance of it."""

    def forward(self, input_tensor: torch.Tensor, temb: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecate("scale", "1.0.0", _SCALE_DEPRECATED)

        fused1 = _applies_silu(self.norm1)
        hidden_states = self.norm1(input_tensor)
        if not fused1:
            hidden_states = self.nonlinearity(hidden_states)

        if self.upsample is not None:
            # diffusers' workaround: upsample_nearest_nhwc fails with large batch sizes
            if hidden_states.shape[0] >= 64:
                input_tensor = input_tensor.contiguous()
                hidden_states = hidden_states.contiguous()
            input_tensor = self.upsample(input_tensor)
            hidden_states = self.upsample(hidden_states)
        elif self.downsample is not None:
            input_tensor = self.downsample(input_tensor)
            hidden_states = self.downsample(hidden_states)

        hidden_states = self.conv1(hidden_states)

        if self.time_emb_proj is not None:
            if not self.skip_time_act:
                temb = self.nonlinearity(temb)
            temb = self.time_emb_proj(temb)[:, :, None, None]

        fused2 = False
        if self.time_embedding_norm == "default":
            if temb is not None:
                hidden_states = hidden_states + temb
            fused2 = _applies_silu(self.norm2)
            hidden_states = self.norm2(hidden_states)
        elif self.time_embedding_norm == "scale_shift":
            if temb is None:
                raise ValueError(
                    f" `temb` should not be None when `time_embedding_norm` is {self.time_embedding_norm}")
            time_scale, time_shift = torch.chunk(temb, 2, dim=1)
            hidden_states = self.norm2(hidden_states)
            hidden_states = hidden_states * (1 + time_scale) + time_shift
        else:
            fused2 = _applies_silu(self.norm2)
            hidden_states = self.norm2(hidden_states)

        if not fused2:
            hidden_states = self.nonlinearity(hidden_states)

        hidden_states = self.dropout(hidden_states)
        hidden_states = self.conv2(hidden_states)

        if self.conv_shortcut is not None:
            if self.training:
                input_tensor = input_tensor.contiguous()
            input_tensor = self.conv_shortcut(input_tensor)

        return (input_tensor + hidden_states) / self.output_scale_factor


def resnet_block_2d_class(base: type) -> type:
    """The ckgen class for a block of class `base` (diffusers' ResnetBlock2D)."""
    if base is not _DiffusersResnetBlock2D:
        raise TypeError(f"expected diffusers' ResnetBlock2D, got {base.__module__}.{base.__qualname__}")
    return ResnetBlock2D


__all__ = ["ResnetBlock2D", "resnet_block_2d_class"]
