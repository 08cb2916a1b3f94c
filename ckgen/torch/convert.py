"""convert(model): swap nn.GroupNorm / nn.MaxPool2d / nn.AvgPool2d for ckgen's modules in
place, fuse GroupNorm + SiLU where the structure shows it, and say what was done and why.

    report = ckgen.torch.convert(model)                      # every op
    report = ckgen.torch.convert(model, ops=["groupnorm_swish", "maxpool2d"])
    report = ckgen.torch.convert(unet, patterns=[FusePattern(ResBlock, norm="norm1", act="act1")])
    print(report)

Fusion (op "relu_maxpool2d"): an nn.ReLU directly followed by an nn.MaxPool2d (return_indices=False)
inside an nn.Sequential becomes an nn.Identity and a ReLUMaxPool2d, which pools first and applies
the ReLU to the pooled output (the same values and gradients: ReLU is monotonic), so the
full-size ReLU pass and its backward disappear (VGG's features, any conv-ReLU-pool stack). Same
conditions as below: not a module used in more than one place, no hooks on the ReLU.

Fusion (op "groupnorm_swish"): a GroupNorm directly followed by an nn.SiLU inside an
nn.Sequential, or a (norm, act) pair of a block named by a `FusePattern`, becomes a
GroupNormSwish and the SiLU an nn.Identity: indices and attribute names stay, so the
state_dict keys do not change. A module used in more than one place, one with hooks on the SiLU,
or a pattern whose traced forward (torch.fx) shows the SiLU taking anything but the norm's
output, is not fused (the report says why). Replacement keeps the module's Parameter objects
(an optimizer built before convert keeps working), buffers, training mode and hooks.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union

from torch import nn

from .functional import check_under_compile
from .modules import AvgPool2d, GroupNorm, GroupNormSwish, MaxPool2d, ReLUMaxPool2d

OPS = ("groupnorm", "groupnorm_swish", "maxpool2d", "avgpool2d", "relu_maxpool2d")
_CKGEN = (GroupNorm, MaxPool2d, AvgPool2d)


@dataclass(frozen=True)
class FusePattern:
    """In every module matching `block` (a class, or a predicate on the module), the GroupNorm at
    attribute path `norm` is followed by the SiLU at `act`, and the SiLU is applied to nothing
    else: e.g. FusePattern(ResnetBlock, norm="norm1", act="act1"). The pair is checked on the
    block's torch.fx trace when it traces; a block that does not trace is taken on trust."""

    block: Union[type, Callable[[nn.Module], bool]]
    norm: str
    act: str

    def matches(self, m: nn.Module) -> bool:
        return isinstance(m, self.block) if isinstance(self.block, type) else bool(self.block(m))


@dataclass(frozen=True)
class Entry:
    name: str  # the module's path in the model ("" is the model itself)
    kind: str  # the module's class name before conversion
    result: str  # the new class name ("" when left as it was)
    reason: str


@dataclass
class ConvertReport:
    """What convert() replaced and what it left, each with the reason."""

    replaced: list[Entry] = field(default_factory=list)
    left: list[Entry] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """{"GroupNorm -> GroupNormSwish": 12, ...} for the replaced modules."""
        return dict(Counter(f"{e.kind} -> {e.result}" for e in self.replaced))

    def __str__(self) -> str:
        lines = [f"ckgen.torch.convert: {len(self.replaced)} replaced, {len(self.left)} left"]
        for title, rows in (("replaced", self.replaced), ("left", self.left)):
            if rows:
                lines.append(f"{title}:")
                for e in rows:
                    what = f"{e.kind} -> {e.result}" if e.result else e.kind
                    lines.append(f"  {e.name or '<model>'}: {what} ({e.reason})")
        return "\n".join(lines)

    def _add(self, replaced: bool, name: str, m: nn.Module, result: str, reason: str) -> None:
        (self.replaced if replaced else self.left).append(Entry(name, type(m).__name__, result, reason))


def _set(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    parent._modules[leaf] = new


def _is_gn(m: nn.Module) -> bool:
    """A plain nn.GroupNorm, or ckgen's unfused GroupNorm."""
    return type(m) is nn.GroupNorm or type(m) is GroupNorm


def _fx_check(block: nn.Module, norm: str, act: str) -> Optional[str]:
    """None if the block's traced forward applies `act` exactly once, to `norm`'s output only,
    and that output has no other user; "unverified: ..." if it does not trace; else the problem."""
    import torch.fx

    class _Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, _CKGEN) or super().is_leaf_module(m, qualname)

    try:
        graph = _Tracer().trace(block)
    except Exception as e:  # noqa: BLE001 - any tracing failure means "cannot check"
        return f"unverified: torch.fx cannot trace {type(block).__name__} ({e.__class__.__name__})"
    norm_nodes = [n for n in graph.nodes if n.op == "call_module" and n.target == norm]
    act_nodes = [n for n in graph.nodes if n.op == "call_module" and n.target == act]
    if len(norm_nodes) != 1 or len(act_nodes) != 1:
        return f"the traced forward calls {norm} {len(norm_nodes)}x and {act} {len(act_nodes)}x (need 1 each)"
    n, a = norm_nodes[0], act_nodes[0]
    if list(n.users) != [a] or a.args[:1] != (n,) or len(a.args) != 1 or a.kwargs:
        return f"in the traced forward, {act} is not applied to {norm}'s output alone"
    return None


def convert(model: nn.Module, ops: Optional[Iterable[str]] = None, patterns: Iterable[FusePattern] = (),
            max_pool_indices: str = "stored", max_pool_under_compile: str = "inductor") -> ConvertReport:
    """Replace model's nn.GroupNorm / nn.MaxPool2d / nn.AvgPool2d with ckgen's modules, in place.

    ops: which of "groupnorm", "groupnorm_swish" (the GroupNorm + SiLU fusion), "maxpool2d",
    "avgpool2d", "relu_maxpool2d" (the ReLU + MaxPool2d fusion) to apply (default: all). patterns: FusePatterns for blocks whose GroupNorm + SiLU
    are not consecutive in an nn.Sequential. max_pool_indices: the MaxPool2d `indices` option
    ("stored" or "recompute"). max_pool_under_compile: the MaxPool2d `under_compile` option, what
    torch.compile traces for the max pools ("inductor": PyTorch's op, which Inductor fuses with the
    ReLU before it; "ckgen": ckgen's op). Returns a ConvertReport; the model itself is changed in
    place."""
    want = set(OPS if ops is None else ops)
    bad = want - set(OPS)
    if bad:
        raise ValueError(f"ops: unknown {sorted(bad)}; choose from {list(OPS)}")
    if max_pool_indices not in ("stored", "recompute"):
        raise ValueError(f"max_pool_indices: expected 'stored' or 'recompute', got {max_pool_indices!r}")
    check_under_compile(max_pool_under_compile, "max_pool_under_compile")
    pool_kw = {"indices": max_pool_indices, "under_compile": max_pool_under_compile}
    patterns = list(patterns)
    report = ConvertReport()
    # How many places hold each module object: a shared module cannot be fused in one place only.
    uses = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    done: set[int] = set()  # ids of modules already handled (fused, or reported)

    def shared_or_hooked(a: nn.Module, b: nn.Module, a_kind: str, b_kind: str, dropped: nn.Module) -> Optional[str]:
        """Why a pair cannot be fused whatever its kinds (None: it can): a module used in more
        than one place, or hooks on the one the fusion drops (it becomes an nn.Identity)."""
        if uses[id(a)] > 1 or uses[id(b)] > 1:
            return f"the {a_kind} or the {b_kind} is used in more than one place"
        if any(getattr(dropped, h, None) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")):
            return f"the {a_kind if dropped is a else b_kind} has hooks"
        return None

    def fuse(path: str, gn: nn.Module, act_path: str, act: nn.Module, how: str) -> None:
        if "groupnorm_swish" not in want:
            return
        why = shared_or_hooked(gn, act, "GroupNorm", "SiLU", act)
        if why is None and not _is_gn(gn):
            why = f"{type(gn).__name__} is a subclass of nn.GroupNorm (its forward may differ)"
        if why:
            report._add(False, path, gn, "", f"not fused with {act_path}: {why}")
            return
        new_gn, new_act = GroupNormSwish.from_module(gn), nn.Identity()
        _set(model, path, new_gn)
        _set(model, act_path, new_act)
        report._add(True, path, gn, "GroupNormSwish", f"fused with the SiLU {act_path} ({how})")
        report._add(True, act_path, act, "Identity", f"fused into {path}")
        done.update((id(gn), id(act), id(new_gn), id(new_act)))

    def fuse_relu_pool(relu_path: str, relu: nn.Module, pool_path: str, pool: nn.Module) -> None:
        why = shared_or_hooked(relu, pool, "ReLU", "MaxPool2d", relu)
        if why is None and pool.return_indices:
            why = "the MaxPool2d returns indices (those of relu(x) can differ)"
        if why:
            report._add(False, relu_path, relu, "", f"not fused with {pool_path}: {why}")
            done.add(id(relu))
            return
        new_relu, new_pool = nn.Identity(), ReLUMaxPool2d.from_module(pool, **pool_kw)
        _set(model, relu_path, new_relu)
        _set(model, pool_path, new_pool)
        report._add(True, relu_path, relu, "Identity", f"fused into {pool_path}")
        report._add(True, pool_path, pool, "ReLUMaxPool2d",
                    f"fused with the ReLU {relu_path} (consecutive in an nn.Sequential): pools first")
        done.update((id(relu), id(pool), id(new_relu), id(new_pool)))

    # 1. GroupNorm + SiLU (and ReLU + MaxPool2d): consecutive in an nn.Sequential, then the
    # user's block patterns.
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Sequential):
            kids = list(m._modules.items())
            for (ka, a), (kb, b) in zip(kids, kids[1:]):
                if ("relu_maxpool2d" in want and type(a) is nn.ReLU and type(b) is nn.MaxPool2d
                        and id(a) not in done and id(b) not in done):
                    pre = f"{name}." if name else ""
                    fuse_relu_pool(pre + ka, a, pre + kb, b)
                if (isinstance(a, nn.GroupNorm) and not isinstance(a, GroupNormSwish) and type(b) is nn.SiLU
                        and id(a) not in done and id(b) not in done):
                    pre = f"{name}." if name else ""
                    fuse(pre + ka, a, pre + kb, b, "consecutive in an nn.Sequential")
        for pat in patterns:
            if not pat.matches(m):
                continue
            pre = f"{name}." if name else ""
            try:
                gn, act = m.get_submodule(pat.norm), m.get_submodule(pat.act)
            except AttributeError as e:
                report._add(False, name, m, "", f"pattern ({pat.norm}, {pat.act}) does not apply: {e}")
                continue
            if id(gn) in done:
                continue
            if not isinstance(gn, nn.GroupNorm) or type(act) is not nn.SiLU:
                report._add(False, pre + pat.norm, gn, "",
                            f"pattern expects a GroupNorm and an nn.SiLU, found {type(gn).__name__} and "
                            f"{type(act).__name__}")
                continue
            check = _fx_check(m, pat.norm, pat.act) if "groupnorm_swish" in want else None
            if check is not None and not check.startswith("unverified"):
                report._add(False, pre + pat.norm, gn, "", f"pattern not fused: {check}")
                continue
            fuse(pre + pat.norm, gn, pre + pat.act, act, "user pattern" + (f"; {check}" if check else ", checked on "
                                                                           "the torch.fx trace"))

    # 2. Module-by-module replacement (a module shared by several parents becomes one new module).
    memo: dict[int, nn.Module] = {}
    for name, m in list(model.named_modules(remove_duplicate=False)):
        if id(m) in done and id(m) not in memo:
            continue
        t = type(m)
        new: Optional[nn.Module] = None
        if id(m) in memo:
            new = memo[id(m)]
        elif isinstance(m, _CKGEN):
            report._add(False, name, m, "", "already a ckgen module")
            done.add(id(m))
            continue
        elif t is nn.GroupNorm:
            if "groupnorm" in want:
                new = GroupNorm.from_module(m)
            else:
                report._add(False, name, m, "", "'groupnorm' not in ops")
        elif t is nn.MaxPool2d:
            if "maxpool2d" in want:
                new = MaxPool2d.from_module(m, **pool_kw)
            else:
                report._add(False, name, m, "", "'maxpool2d' not in ops")
        elif t is nn.AvgPool2d:
            if "avgpool2d" in want:
                new = AvgPool2d.from_module(m)
            else:
                report._add(False, name, m, "", "'avgpool2d' not in ops")
        else:
            reason = _left_reason(m)
            if reason:
                report._add(False, name, m, "", reason)
            done.add(id(m))
            continue
        if new is None:
            done.add(id(m))
            continue
        if not name:
            report._add(False, name, m, "", f"the model itself is an {t.__name__}: convert its parent, or use "
                                            f"ckgen.torch.{type(new).__name__}.from_module(model)")
            done.add(id(m))
            continue
        first = id(m) not in memo
        memo[id(m)] = new
        _set(model, name, new)
        reason = ("same Parameter objects" if any(True for _ in m.parameters()) else "same arguments") if first \
            else "a shared module: the same ckgen module as at its first use"
        report._add(True, name, m, type(new).__name__, reason)
    return report


def _left_reason(m: nn.Module) -> Optional[str]:
    """Why a related module is left alone (None: it is not related to what ckgen covers)."""
    if isinstance(m, nn.GroupNorm):
        return "a subclass of nn.GroupNorm (its forward may differ from nn.GroupNorm's)"
    if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
        return f"a subclass of nn.{'MaxPool2d' if isinstance(m, nn.MaxPool2d) else 'AvgPool2d'}"
    if isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d,
                      nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool3d)):
        return "adaptive pooling is not a ckgen op"
    if isinstance(m, (nn.MaxPool1d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool3d)):
        return "ckgen pools 2-D inputs only"
    if isinstance(m, (nn.LPPool2d, nn.FractionalMaxPool2d, nn.LPPool1d)):
        return "not a ckgen op"
    if type(m) is nn.SiLU:
        return "not right after a GroupNorm in an nn.Sequential or a FusePattern (runs as PyTorch's SiLU)"
    return None


__all__ = ["ConvertReport", "Entry", "FusePattern", "OPS", "convert"]
