"""Drop-in modules: nn.GroupNorm, nn.MaxPool2d and nn.AvgPool2d with ckgen's kernels.

Each subclasses its nn module, so it takes the same arguments, has the same parameters,
buffers and state_dict keys, passes `isinstance(m, nn.GroupNorm)` checks and prints the same;
only `forward` differs (see `ckgen.torch.functional` for what falls back to PyTorch).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _nn_module

from . import functional as CF

# The hooks that see or change what a module computes; a fused pair holds only while neither
# module has one (a forward hook on the norm would see the SiLU's output, one on the SiLU would
# not run).
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# torch's hooks on every module (`nn.modules.module.register_module_forward_hook`, ...): they see
# each module's output, so they turn a fusion off as a module's own hooks do.
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _carry_over(old: nn.Module, new: nn.Module) -> nn.Module:
    """The old module's training flag and hooks, on the new one."""
    new.train(old.training)
    for name in _HOOK_DICTS:
        if hasattr(old, name):
            setattr(new, name, getattr(old, name))
    return new


def hooked(m: nn.Module) -> bool:
    """Has `m` hooks that see or change what it computes (HOOKS)?"""
    return any(getattr(m, h, None) for h in HOOKS)


def global_hooks() -> bool:
    """Are hooks registered for every module (torch's global module hooks)?"""
    return any(getattr(_nn_module, h, None) for h in _GLOBAL_HOOKS)


class Fusion:
    """A GroupNorm fused with the SiLU after it, as `convert` made it: the norm (at `norm_name`
    of `norm_owner`; None for a module that is its own norm, such as GroupNormAct) and the module
    at `act_name` of `act_owner` (the SiLU's placeholder, or a SiLU kept because it also acts
    elsewhere). A model can be edited after convert (a new activation, a replaced norm, hooks):
    `holds()` says whether the pair is still what was fused, and the fused modules ask it at
    every call, running the unfused computation when it is not. Plain attributes, not
    submodules: the state_dict, the module tree and `.to()` do not see them; copies and pickles
    keep the pairing (the memo maps each module once)."""

    def __init__(self, norm_owner: Optional[nn.Module], norm_name: str, norm: Optional[nn.Module],
                 act_owner: nn.Module, act_name: str, act: nn.Module) -> None:
        self.norm_owner, self.norm_name, self.norm = norm_owner, norm_name, norm
        self.act_owner, self.act_name, self.act = act_owner, act_name, act

    def holds(self) -> bool:
        """Both modules are where convert put them, neither has hooks, and no global hooks are set."""
        if global_hooks():
            return False
        if self.norm is not None and (self.norm_owner._modules.get(self.norm_name) is not self.norm
                                      or hooked(self.norm)):
            return False
        return self.act_owner._modules.get(self.act_name) is self.act and not hooked(self.act)


class GroupNorm(nn.GroupNorm):
    """nn.GroupNorm(num_groups, num_channels, eps=1e-5, affine=True) running ckgen's GroupNorm
    forward and backward kernels (the backward saves x, gamma, mean and rstd)."""

    activation: Optional[str] = None
    # Set on a norm fused with a SiLU of the model (convert, GroupNormAct): the activation runs
    # only while the pairing holds.
    fusion: Optional[Fusion] = None

    def applies_activation(self) -> bool:
        """Does this call apply `activation`: it has one, and it is not a fusion the model's
        edits undid (`Fusion.holds`)?"""
        return self.activation is not None and (self.fusion is None or self.fusion.holds())

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - nn's argument name
        act = self.activation if self.applies_activation() else None
        return CF.group_norm(input, self.num_groups, self.weight, self.bias, self.eps, activation=act)

    @classmethod
    def from_module(cls, m: nn.GroupNorm) -> "GroupNorm":
        """A ckgen module sharing `m`'s parameters (the same Parameter objects), mode and hooks."""
        with torch.device("meta"):
            new = cls(m.num_groups, m.num_channels, m.eps, m.affine)
        new.weight, new.bias = m.weight, m.bias  # None with affine=False
        return _carry_over(m, new)


class SiLUPlaceholder(nn.Identity):
    """What `convert` puts where it took out a SiLU fused into the GroupNorm before it: passes its
    input on while that fusion holds (`Fusion.holds`), and applies the SiLU itself when it does
    not (global hooks, hooks on either module, the norm replaced), so the model computes what it
    did before convert. Without a fusion it is an nn.Identity."""

    fusion: Optional[Fusion] = None

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        if self.fusion is None or self.fusion.holds():
            return input
        return F.silu(input)


def fuse_placeholder(norm: GroupNorm, owner: nn.Module, name: str, norm_owner: Optional[nn.Module] = None,
                     norm_name: str = "") -> SiLUPlaceholder:
    """A SiLUPlaceholder for the SiLU at `name` of `owner`, paired with `norm` (at `norm_name` of
    `norm_owner`; None: the norm is the owner itself) by one Fusion. The caller puts it in place."""
    placeholder = SiLUPlaceholder()
    placeholder.fusion = norm.fusion = Fusion(norm_owner, norm_name, norm if norm_owner is not None else None,
                                              owner, name, placeholder)
    return placeholder


class GroupNormSwish(GroupNorm):
    """GroupNorm then SiLU (swish), fused: one ckgen kernel forward, one backward (the backward
    recomputes the swish input from x, mean, rstd, gamma and beta). Same arguments, parameters
    and state_dict keys as nn.GroupNorm, so `nn.Sequential(GroupNorm, SiLU)` converts to
    `nn.Sequential(GroupNormSwish, Identity)` with an unchanged state_dict."""

    activation = "swish"

    def extra_repr(self) -> str:
        return super().extra_repr() + ", activation=swish"


class GroupNormAct(GroupNorm):
    """GroupNorm, then `drop`, then `act` (modules): timm's GroupNormAct / GroupNorm1Act with
    ckgen's GroupNorm. With an nn.SiLU act and no drop (nn.Identity), the SiLU runs inside the
    GroupNorm kernels (`activation="swish"`) and `act` is a SiLUPlaceholder (an nn.Identity while
    the fusion holds: a new `act` or a hook afterwards turns it off); any other act (ReLU,
    GELU, ...) or drop runs as its own module after ckgen's GroupNorm. The attribute names
    (weight, bias, drop, act) are timm's, so the state_dict keys do not change."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 drop: Optional[nn.Module] = None, act: Optional[nn.Module] = None, fuse_swish: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__(num_groups, num_channels, eps, affine, device=device, dtype=dtype)
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.Identity()
        if fuse_swish:
            if type(self.act) not in (nn.SiLU, nn.Identity) or type(self.drop) is not nn.Identity:
                raise ValueError("fuse_swish: needs an nn.SiLU act and no drop (nn.Identity)")
            self._fuse()

    def _fuse(self) -> None:
        """The SiLU into the norm's kernels; `act` becomes its placeholder, so a later
        `m.act = ...` (or a hook) runs as it would on timm's module."""
        self.activation = "swish"
        self.act = fuse_placeholder(self, self, "act")

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return self.act(self.drop(super().forward(input)))

    def extra_repr(self) -> str:
        return super().extra_repr() + (", activation=swish" if self.activation == "swish" else "")

    @classmethod
    def from_module(cls, m: nn.GroupNorm, fuse_swish: bool = False) -> "GroupNormAct":
        """From a module with nn.GroupNorm's attributes and `drop` and `act` submodules (timm's
        GroupNormAct): the same Parameter objects, drop and act modules (act an nn.Identity when
        fused), mode and hooks."""
        with torch.device("meta"):
            new = cls(m.num_groups, m.num_channels, m.eps, m.affine)
        new.weight, new.bias = m.weight, m.bias
        new.drop, new.act = m.drop, m.act
        if fuse_swish:
            if type(m.act) is not nn.SiLU or type(m.drop) is not nn.Identity:
                raise ValueError("fuse_swish: needs an nn.SiLU act and no drop (nn.Identity)")
            new._fuse()
        return _carry_over(m, new)


class MaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d with ckgen. `indices` ("stored" or "recompute") chooses what the backward
    uses when the input needs a gradient: int64 indices written by the forward (PyTorch's way,
    and the faster backward), or the argmax recomputed from x (no index tensor: less memory and
    less forward traffic). Inference writes no indices unless return_indices=True.
    `under_compile` ("inductor", the default, or "ckgen") is what torch.compile traces: PyTorch's
    max pool, which Inductor fuses with its neighbours, or ckgen's op (see
    `ckgen.torch.functional.max_pool2d`). Eager calls run ckgen either way."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False, *, indices: str = "stored", under_compile: str = "inductor") -> None:
        super().__init__(kernel_size, stride, padding, dilation, return_indices, ceil_mode)
        if indices not in ("stored", "recompute"):
            raise ValueError(f"indices: expected 'stored' or 'recompute', got {indices!r}")
        self.indices = indices
        self.under_compile = CF.check_under_compile(under_compile)

    def forward(self, input: Tensor):  # noqa: A002
        return CF.max_pool2d(input, self.kernel_size, self.stride, self.padding, self.dilation,
                             ceil_mode=self.ceil_mode, return_indices=self.return_indices, indices=self.indices,
                             under_compile=self.under_compile)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", indices={self.indices}, under_compile={self.under_compile}"

    @classmethod
    def from_module(cls, m: nn.MaxPool2d, indices: str = "stored", under_compile: str = "inductor") -> "MaxPool2d":
        new = cls(m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices, m.ceil_mode, indices=indices,
                  under_compile=under_compile)
        return _carry_over(m, new)


class ReLUMaxPool2d(MaxPool2d):
    """nn.ReLU followed by nn.MaxPool2d, computed as the max pool then the ReLU on its output:
    max(relu(x)) == relu(max(x)) in every window (ReLU is monotonic; padding never wins a
    window), and so are the gradients (a window whose max is <= 0 gets none either way). The
    ReLU then reads and writes the pooled tensor (a quarter of x for a 2x2 pool) instead of x,
    forward and backward. Same arguments as nn.MaxPool2d, no parameters; return_indices=False
    only (the indices of relu(x)'s windows can differ where several elements are <= 0)."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False, *, indices: str = "stored", under_compile: str = "inductor") -> None:
        if return_indices:
            raise ValueError("return_indices: ReLUMaxPool2d returns no indices (those of relu(x) can differ)")
        super().__init__(kernel_size, stride, padding, dilation, False, ceil_mode, indices=indices,
                         under_compile=under_compile)

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        if self.under_compile == "inductor" and torch.compiler.is_compiling():
            # the unfused nn graph (ReLU, then the pool): Inductor fuses the two into one kernel
            return F.max_pool2d(torch.relu(input), self.kernel_size, self.stride, self.padding, self.dilation,
                                ceil_mode=self.ceil_mode)
        return torch.relu(super().forward(input))

    def extra_repr(self) -> str:
        return "relu first, " + super().extra_repr()


class AvgPool2d(nn.AvgPool2d):
    """nn.AvgPool2d with ckgen (the backward saves nothing)."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return CF.avg_pool2d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                             self.count_include_pad, self.divisor_override)

    @classmethod
    def from_module(cls, m: nn.AvgPool2d) -> "AvgPool2d":
        new = cls(m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad, m.divisor_override)
        return _carry_over(m, new)


__all__ = ["AvgPool2d", "Fusion", "GroupNorm", "GroupNormAct", "GroupNormSwish", "MaxPool2d", "ReLUMaxPool2d",
           "SiLUPlaceholder"]
