"""convert(model): swap nn.GroupNorm / nn.MaxPool2d / nn.AvgPool2d (and the GroupNorm modules of
timm, diffusers and LDM/sgm) for ckgen's modules in place, fuse GroupNorm + SiLU where the
structure shows it, and say what was done, why, and which adapter matched.

    report = ckgen.torch.convert(model)                      # every op
    report = ckgen.torch.convert(model, ops=["groupnorm_swish", "maxpool2d"])
    report = ckgen.torch.convert(unet, patterns=[FusePattern(ResBlock, norm="norm1", act="act1")])
    print(report)

Adapters (`ckgen.torch.adapters`): a module whose class an adapter names (exactly, by qualified
name) and whose structure the adapter's check accepts is converted by that adapter: timm's
GroupNorm, GroupNorm1 and GroupNormAct, diffusers' ResnetBlock2D and the conv_norm_out +
conv_act pair of its UNets and VAE, LDM/sgm's GroupNorm32 and ResBlock. Users register their own
(`register_adapter`, or `convert(model, adapters=[...])`; docs/extending-convert.md).

Fusion (op "relu_maxpool2d"): an nn.ReLU directly followed by an nn.MaxPool2d (return_indices=False)
inside an nn.Sequential becomes an nn.Identity and a ReLUMaxPool2d, which pools first and applies
the ReLU to the pooled output (the same values and gradients: ReLU is monotonic), so the
full-size ReLU pass and its backward disappear (VGG's features, any conv-ReLU-pool stack).

Fusion (op "groupnorm_swish"): a GroupNorm (or a GroupNorm equivalent an adapter names)
directly followed by an nn.SiLU inside an nn.Sequential, a (norm, act) pair of a block named by
a `FusePattern`, or a pair an adapter fuses, becomes a GroupNormSwish and the SiLU a
SiLUPlaceholder (an nn.Identity while the fusion holds): indices and attribute names stay, so the
state_dict keys do not change. Each fused pair shares a `modules.Fusion`, asked at every call:
when the model was edited after convert (another activation or norm in a slot, hooks on either
module, global module hooks), the pair runs unfused, as it would have without convert.

Never fused: a module used in more than one place; a pair where either module has forward,
pre-forward or backward hooks (a forward hook on the GroupNorm would see the SiLU's output, a
pre-hook on the max pool would run before the ReLU); a pair in an nn.Sequential that its owner's
methods index, slice or iterate (`self.layers[0]`: the pair may not run back to back there);
a pattern whose traced forward (torch.fx) shows the SiLU taking anything but the norm's output.
The report says why. A pattern whose block neither traces nor reads as norm-then-SiLU in its
source is fused on the user's word, with a ConvertWarning. Replacement keeps the module's Parameter objects (an optimizer built before
convert keeps working), buffers, training mode and hooks.
"""
from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union

from torch import nn

from . import _source
from . import adapters as _adapters
from .adapters import Adapter
from .functional import check_under_compile
from .modules import (AvgPool2d, Fusion, GroupNorm, GroupNormAct, GroupNormSwish, MaxPool2d, ReLUMaxPool2d,
                      fuse_placeholder, hooked)

OPS = ("groupnorm", "groupnorm_swish", "maxpool2d", "avgpool2d", "relu_maxpool2d")
_CKGEN = (GroupNorm, MaxPool2d, AvgPool2d)


class ConvertWarning(UserWarning):
    """convert() fused something it could not check (a FusePattern whose block neither traces
    nor reads as norm-then-SiLU back to back): the user's word is all it has."""


@dataclass(frozen=True)
class FusePattern:
    """In every module matching `block` (a class, or a predicate on the module), the GroupNorm at
    attribute path `norm` is followed by the SiLU at `act`, and the SiLU is applied to nothing
    else: e.g. FusePattern(ResnetBlock, norm="norm1", act="act1"). The pair is checked on the
    block's torch.fx trace when it traces, else on its source (`_source.back_to_back`); a block
    that passes neither is fused on trust, with a ConvertWarning."""

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
    adapter: str = ""  # the adapter that matched ("nn.GroupNorm" etc. for torch.nn's own modules)


@dataclass
class ConvertReport:
    """What convert() replaced and what it left, each with the reason and the adapter."""

    replaced: list[Entry] = field(default_factory=list)
    left: list[Entry] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """{"GroupNorm -> GroupNormSwish": 12, ...} for the replaced modules."""
        return dict(Counter(f"{e.kind} -> {e.result}" for e in self.replaced))

    def adapters(self) -> dict[str, int]:
        """{adapter name: number of entries it made} over replaced and left entries."""
        return dict(Counter(e.adapter for e in self.replaced + self.left if e.adapter))

    def __str__(self) -> str:
        lines = [f"ckgen.torch.convert: {len(self.replaced)} replaced, {len(self.left)} left"]
        for title, rows in (("replaced", self.replaced), ("left", self.left)):
            if rows:
                lines.append(f"{title}:")
                for e in rows:
                    what = f"{e.kind} -> {e.result}" if e.result else e.kind
                    by = f" [{e.adapter}]" if e.adapter else ""
                    lines.append(f"  {e.name or '<model>'}: {what}{by} ({e.reason})")
        return "\n".join(lines)

    def _add(self, replaced: bool, name: str, m: nn.Module, result: str, reason: str, adapter: str = "") -> None:
        (self.replaced if replaced else self.left).append(Entry(name, type(m).__name__, result, reason, adapter))

    def _in_module_order(self, order: dict[str, int]) -> None:
        """Entries in the order of the model's modules (`order`: path -> index), as a reader walks
        the model; the passes that made them (fusions first) do not show."""
        for rows in (self.replaced, self.left):
            rows.sort(key=lambda e: order.get(e.name, len(order)))


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _slot(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    """(the module holding the submodule at `path`, its name there)."""
    parent_path, _, leaf = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), leaf


def _set(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, leaf = _slot(model, path)
    parent._modules[leaf] = new



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


class _Run:
    """One convert() call's state: the model, the report, what was done, and the rules."""

    def __init__(self, model: nn.Module, want: set, pool_kw: dict, extra: tuple[Adapter, ...]) -> None:
        self.model, self.want, self.pool_kw, self.extra = model, want, pool_kw, extra
        self.report = ConvertReport()
        # How many places hold each module object: a shared module cannot be fused in one place only.
        self.uses = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
        self.done: set[int] = set()  # ids of modules already handled (fused, or reported)
        self.no_fuse: dict[int, str] = {}  # ids of GroupNorms an adapter keeps unfused -> why

    # -- what a module is -------------------------------------------------------------------
    def gn_adapter(self, m: nn.Module) -> Optional[str]:
        """The adapter name under which m counts as a GroupNorm (replaced and fused like
        nn.GroupNorm), or None: "nn.GroupNorm" for nn's own, "ckgen" for ckgen's unfused one,
        else a GroupNorm-equivalent adapter whose check accepts m."""
        t = type(m)
        if t is nn.GroupNorm:
            return "nn.GroupNorm"
        if t is GroupNorm:
            return "ckgen"
        a = _adapters.find(m, self.extra)
        if a is not None and a.groupnorm and isinstance(m, nn.GroupNorm) and a.why_not(m) is None:
            return a.name
        return None

    # -- fusion ------------------------------------------------------------------------------
    def why_not_pair(self, a: nn.Module, b: nn.Module, a_kind: str, b_kind: str, dropped: bool = True
                     ) -> Optional[str]:
        """Why a pair cannot be fused whatever its kinds (None: it can): a module used in more
        than one place (the second only matters if it is dropped), or hooks on either."""
        if self.uses[id(a)] > 1 or (dropped and self.uses[id(b)] > 1):
            return f"the {a_kind} or the {b_kind} is used in more than one place"
        for m, kind in ((a, a_kind), (b, b_kind)):
            if hooked(m):
                return f"the {kind} has hooks (fused, they would see or run at another point)"
        return None

    def fuse_gn(self, path: str, gn: nn.Module, act_path: str, act: nn.Module, how: str, adapter: str = "",
                drop_act: bool = True) -> bool:
        """GroupNorm at `path` + SiLU at `act_path` -> GroupNormSwish (+ a SiLUPlaceholder when
        drop_act; else the SiLU stays and the norm's Fusion names it). Reports either way; True when fused."""
        if "groupnorm_swish" not in self.want:
            return False
        why = self.no_fuse.get(id(gn))
        if why is None:
            why = self.why_not_pair(gn, act, "GroupNorm", "SiLU", dropped=drop_act)
        gn_by = self.gn_adapter(gn)
        if why is None and gn_by is None:
            why = (f"{type(gn).__name__} is a subclass of nn.GroupNorm that no adapter names (its forward may differ)"
                   if isinstance(gn, nn.GroupNorm) else f"{type(gn).__name__} is not a GroupNorm")
        if why is None and type(act) is not nn.SiLU:
            why = f"the activation is {type(act).__name__}, not nn.SiLU"
        if why:
            self.report._add(False, path, gn, "", f"not fused with {act_path}: {why}", adapter)
            return False
        new_gn = GroupNormSwish.from_module(gn)
        _set(self.model, path, new_gn)
        self.report._add(True, path, gn, "GroupNormSwish", f"fused with the SiLU {act_path} ({how})", adapter or gn_by)
        self.done.update((id(gn), id(new_gn)))
        # The pair is checked at every call (Fusion.holds): an edit of the model after convert
        # (another activation, a replaced norm, hooks, global hooks) runs unfused, as it would
        # have run without convert.
        (norm_owner, norm_name), (act_owner, act_name) = _slot(self.model, path), _slot(self.model, act_path)
        if drop_act:
            new_act = fuse_placeholder(new_gn, act_owner, act_name, norm_owner, norm_name)
            _set(self.model, act_path, new_act)
            self.report._add(True, act_path, act, type(new_act).__name__, f"fused into {path}", adapter)
            self.done.update((id(act), id(new_act)))
        else:
            new_gn.fusion = Fusion(norm_owner, norm_name, new_gn, act_owner, act_name, act)
        return True

    def fuse_relu_pool(self, relu_path: str, relu: nn.Module, pool_path: str, pool: nn.Module) -> None:
        why = self.why_not_pair(relu, pool, "ReLU", "MaxPool2d")
        if why is None and pool.return_indices:
            why = "the MaxPool2d returns indices (those of relu(x) can differ)"
        if why:
            self.report._add(False, relu_path, relu, "", f"not fused with {pool_path}: {why}", "nn.ReLU")
            self.done.add(id(relu))
            return
        new_relu, new_pool = nn.Identity(), ReLUMaxPool2d.from_module(pool, **self.pool_kw)
        _set(self.model, relu_path, new_relu)
        _set(self.model, pool_path, new_pool)
        self.report._add(True, relu_path, relu, "Identity", f"fused into {pool_path}", "nn.ReLU")
        self.report._add(True, pool_path, pool, "ReLUMaxPool2d",
                         f"fused with the ReLU {relu_path} (consecutive in an nn.Sequential): pools first",
                         "nn.MaxPool2d")
        self.done.update((id(relu), id(pool), id(new_relu), id(new_pool)))

    def sequential_opened(self, name: str) -> Optional[str]:
        """Why pairs inside the nn.Sequential at `name` may not run back to back (None: they
        do): its owner's methods (torch.nn's containers aside) read it other than by calling it
        whole, e.g. `self.out_layers[0]` (LDM's ResBlock with use_scale_shift_norm)."""
        if not name:
            return None
        parent_path, _, attr = name.rpartition(".")
        parent = self.model.get_submodule(parent_path) if parent_path else self.model
        if type(parent).__module__.startswith("torch.nn"):
            return None  # nn.Sequential / ModuleList / ModuleDict: called or iterated in order
        uses = _source.attr_uses(type(parent), attr)
        if uses is None:
            return None  # no source: taken on trust, as before the check existed
        opened = [u for u in uses if u.kind == "other"]
        if opened:
            return (f"{type(parent).__name__}.{opened[0].method} uses {opened[0].what!r}, not only "
                    f"self.{attr}(...): the pair may not run back to back")
        return None


class Site:
    """What an adapter's `apply(module, site)` works with: the matched module (`site.module`),
    its path in the model (`site.path`), and the steps below. Paths are relative to the module
    ("norm1", "in_layers.0"; "" is the module itself). Every step checks what convert's own
    rules check and records itself in the report under the adapter's name."""

    def __init__(self, run: _Run, path: str, module: nn.Module, adapter: Adapter) -> None:
        self._run, self.path, self.module, self.adapter = run, path, module, adapter

    def want(self, op: str) -> bool:
        """Is `op` (one of OPS) among those this convert() call applies?"""
        return op in self._run.want

    def _get(self, attr: str) -> nn.Module:
        return self.module.get_submodule(attr) if attr else self.module

    def fuse(self, norm: str, act: str, how: str = "") -> bool:
        """The GroupNorm at `norm` then the nn.SiLU at `act`, which the block's forward applies
        back to back and to nothing else: a GroupNormSwish and a SiLUPlaceholder. True if fused."""
        gn, a = self._get(norm), self._get(act)
        return self._run.fuse_gn(_join(self.path, norm), gn, _join(self.path, act), a,
                                 how or "adapter", self.adapter.name)

    def fuse_norm_only(self, norm: str, act: str, how: str = "") -> bool:
        """The GroupNorm at `norm` becomes a GroupNormSwish; the SiLU at `act` stays (it may act
        elsewhere too): the block's forward must then skip it after this norm (`set_class`).
        Not done where `act` has hooks (they would fire fewer times) or isn't an nn.SiLU."""
        gn, a = self._get(norm), self._get(act)
        return self._run.fuse_gn(_join(self.path, norm), gn, _join(self.path, act), a, how or "adapter",
                                 self.adapter.name, drop_act=False)

    def no_fuse(self, norm: str, reason: str) -> None:
        """The GroupNorm at `norm` is not fused by convert's later rules (nn.Sequential pairs,
        FusePatterns); it is still replaced by ckgen's GroupNorm on its own."""
        gn = self._get(norm)
        self._run.no_fuse[id(gn)] = reason
        self._run.report._add(False, _join(self.path, norm), gn, "", f"not fused: {reason}", self.adapter.name)

    def keep(self, attr: str, reason: str) -> None:
        """Leave the module at `attr` as it is (later rules skip it), with the reason."""
        m = self._get(attr)
        self._run.report._add(False, _join(self.path, attr), m, "", reason, self.adapter.name)
        self._run.done.add(id(m))

    def replace(self, attr: str, new: nn.Module, reason: str) -> None:
        """Put `new` at `attr` (or in the module's place: attr="")."""
        old = self._get(attr)
        path = _join(self.path, attr)
        if not path:
            raise ValueError("Site.replace: the model itself cannot be replaced in place")
        _set(self._run.model, path, new)
        self._run.report._add(True, path, old, type(new).__name__, reason, self.adapter.name)
        self._run.done.update((id(old), id(new)))

    def set_class(self, cls: type, reason: str) -> None:
        """Give the module a new class (a subclass of its own with another forward): its
        attributes, submodules, parameters and state_dict stay."""
        if not issubclass(cls, type(self.module)):
            raise TypeError(f"Site.set_class: {cls.__name__} is not a subclass of {type(self.module).__name__}")
        old_name = type(self.module).__name__
        self.module.__class__ = cls
        self._run.report.replaced.append(Entry(self.path, old_name, f"{cls.__module__}.{cls.__qualname__}", reason,
                                               self.adapter.name))

    def replace_groupnorm_act(self) -> None:
        """The module (nn.GroupNorm's attributes plus `drop` and `act` modules, as timm's
        GroupNormAct) becomes ckgen's GroupNormAct, its SiLU fused when that is allowed."""
        m = self.module
        if not self.path:
            self._run.report._add(False, "", m, "", "the model itself: convert its parent", self.adapter.name)
            return
        run = self._run
        fuse, why = False, None
        if "groupnorm_swish" in run.want and type(m.act) is nn.SiLU:
            if type(m.drop) is not nn.Identity:
                why = f"drop ({type(m.drop).__name__}) runs between the norm and the SiLU"
            elif run.uses[id(m.act)] > 1:
                why = "the SiLU is used in more than one place"
            elif hooked(m.act) or hooked(m.drop):
                why = "the SiLU has hooks"
            else:
                fuse = True
        if "groupnorm" not in run.want and not fuse:
            run.report._add(False, self.path, m, "", "'groupnorm' not in ops", self.adapter.name)
            run.done.add(id(m))
            return
        new = GroupNormAct.from_module(m, fuse_swish=fuse)
        after = [type(x).__name__ for x in (m.drop, m.act) if type(x) is not nn.Identity]
        act = "SiLU fused" if fuse else (f"then {', '.join(after)}" if after else "no activation") + (
            f" (not fused: {why})" if why else "")
        self.replace("", new, f"ckgen GroupNorm, {act}; same Parameter objects")


def convert(model: nn.Module, ops: Optional[Iterable[str]] = None, patterns: Iterable[FusePattern] = (),
            max_pool_indices: str = "stored", max_pool_under_compile: str = "inductor",
            adapters: Iterable[Adapter] = ()) -> ConvertReport:
    """Replace model's nn.GroupNorm / nn.MaxPool2d / nn.AvgPool2d (and the modules the adapters
    name) with ckgen's modules, in place.

    ops: which of "groupnorm", "groupnorm_swish" (the GroupNorm + SiLU fusion), "maxpool2d",
    "avgpool2d", "relu_maxpool2d" (the ReLU + MaxPool2d fusion) to apply (default: all). patterns:
    FusePatterns for blocks whose GroupNorm + SiLU are not consecutive in an nn.Sequential.
    max_pool_indices: the MaxPool2d `indices` option ("stored" or "recompute").
    max_pool_under_compile: the MaxPool2d `under_compile` option, what torch.compile traces for
    the max pools ("inductor": PyTorch's op, which Inductor fuses with the ReLU before it;
    "ckgen": ckgen's op). adapters: Adapters for this call, tried before the registered ones
    (`ckgen.torch.register_adapter`). Returns a ConvertReport; the model is changed in place."""
    want = set(OPS if ops is None else ops)
    bad = want - set(OPS)
    if bad:
        raise ValueError(f"ops: unknown {sorted(bad)}; choose from {list(OPS)}")
    if max_pool_indices not in ("stored", "recompute"):
        raise ValueError(f"max_pool_indices: expected 'stored' or 'recompute', got {max_pool_indices!r}")
    check_under_compile(max_pool_under_compile, "max_pool_under_compile")
    extra = tuple(adapters)
    for a in extra:
        if not isinstance(a, Adapter):
            raise TypeError(f"adapters: expected Adapter objects, got {type(a).__name__}")
    run = _Run(model, want, {"indices": max_pool_indices, "under_compile": max_pool_under_compile}, extra)
    report = run.report
    order = {name: k for k, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}

    # 1. Block adapters (diffusers' ResnetBlock2D, LDM's ResBlock, timm's GroupNormAct, ...):
    # parents before children, each module once.
    for name, m in list(model.named_modules()):
        if id(m) in run.done:
            continue
        a = _adapters.find(m, extra)
        if a is None or a.groupnorm:
            continue
        why = a.why_not(m)
        if why:
            report._add(False, name, m, "", f"left as it is: {why}", a.name)
            continue
        a.apply(m, Site(run, name, m, a))

    # 2. GroupNorm + SiLU (and ReLU + MaxPool2d): consecutive in an nn.Sequential, then the
    # user's block patterns.
    patterns = list(patterns)
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Sequential):
            kids = list(m._modules.items())
            opened: Optional[str] = None
            checked = False
            for (ka, a), (kb, b) in zip(kids, kids[1:]):
                if id(a) in run.done or id(b) in run.done or id(a) in run.no_fuse:
                    continue  # handled, or kept unfused by an adapter (which reported why)
                relu_pool = "relu_maxpool2d" in want and type(a) is nn.ReLU and type(b) is nn.MaxPool2d
                gn_silu = ("groupnorm_swish" in want and isinstance(a, nn.GroupNorm)
                           and not isinstance(a, GroupNormSwish) and type(b) is nn.SiLU)
                if not (relu_pool or gn_silu):
                    continue
                if not checked:
                    opened, checked = run.sequential_opened(name), True
                pre = f"{name}." if name else ""
                if opened:
                    report._add(False, pre + ka, a, "", f"not fused with {pre + kb}: {opened}")
                    if relu_pool:
                        run.done.add(id(a))
                    continue
                if relu_pool:
                    run.fuse_relu_pool(pre + ka, a, pre + kb, b)
                else:
                    run.fuse_gn(pre + ka, a, pre + kb, b, "consecutive in an nn.Sequential")
        for pat in patterns:
            if not pat.matches(m):
                continue
            pre = f"{name}." if name else ""
            try:
                gn, act = m.get_submodule(pat.norm), m.get_submodule(pat.act)
            except AttributeError as e:
                report._add(False, name, m, "", f"pattern ({pat.norm}, {pat.act}) does not apply: {e}")
                continue
            if id(gn) in run.done:
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
            how = "user pattern, checked on the torch.fx trace"
            if check is not None and "." not in pat.norm + pat.act \
                    and _source.back_to_back(type(m), pat.norm, pat.act) is None:
                check, how = None, "user pattern, checked on the block's source (torch.fx cannot trace it)"
            if check is not None:
                how = f"user pattern; {check}, fused on trust"
            if run.fuse_gn(pre + pat.norm, gn, pre + pat.act, act, how) and check is not None:
                # Fused on the user's word alone: if the block uses the SiLU or the norm's output
                # elsewhere, the model now computes something else. Say so where it is seen.
                warnings.warn(f"ckgen.torch.convert: {check}; {pre + pat.norm} + {pre + pat.act} fused on trust: "
                              f"check that {type(m).__name__}'s forward applies {pat.act} to {pat.norm}'s output "
                              "and to nothing else", ConvertWarning, stacklevel=2)

    # 3. Module-by-module replacement (a module shared by several parents becomes one new module).
    memo: dict[int, nn.Module] = {}
    for name, m in list(model.named_modules(remove_duplicate=False)):
        if id(m) in run.done and id(m) not in memo:
            continue
        t = type(m)
        new: Optional[nn.Module] = None
        by = ""
        if id(m) in memo:
            new = memo[id(m)]
        elif isinstance(m, _CKGEN):
            report._add(False, name, m, "", "already a ckgen module")
            run.done.add(id(m))
            continue
        elif t is nn.MaxPool2d:
            by = "nn.MaxPool2d"
            if "maxpool2d" in want:
                new = MaxPool2d.from_module(m, **run.pool_kw)
            else:
                report._add(False, name, m, "", "'maxpool2d' not in ops", by)
        elif t is nn.AvgPool2d:
            by = "nn.AvgPool2d"
            if "avgpool2d" in want:
                new = AvgPool2d.from_module(m)
            else:
                report._add(False, name, m, "", "'avgpool2d' not in ops", by)
        elif isinstance(m, nn.GroupNorm) and run.gn_adapter(m) is not None:
            by = run.gn_adapter(m)
            if "groupnorm" in want:
                new = GroupNorm.from_module(m)
            else:
                report._add(False, name, m, "", "'groupnorm' not in ops", by)
        else:
            reason, by = _left_reason(m, extra)
            if reason:
                report._add(False, name, m, "", reason, by)
            run.done.add(id(m))
            continue
        if new is None:
            run.done.add(id(m))
            continue
        if not name:
            report._add(False, name, m, "", f"the model itself is an {t.__name__}: convert its parent, or use "
                                            f"ckgen.torch.{type(new).__name__}.from_module(model)", by)
            run.done.add(id(m))
            continue
        first = id(m) not in memo
        memo[id(m)] = new
        _set(model, name, new)
        reason = ("same Parameter objects" if any(True for _ in m.parameters()) else "same arguments") if first \
            else "a shared module: the same ckgen module as at its first use"
        report._add(True, name, m, type(new).__name__, reason, by)
    report._in_module_order(order)
    return report


def _left_reason(m: nn.Module, extra: tuple = ()) -> tuple[Optional[str], str]:
    """Why a related module is left alone (None: it is not related to what ckgen covers), and
    the adapter that says so."""
    if isinstance(m, nn.GroupNorm):
        a = _adapters.find(m, extra)
        if a is not None and a.groupnorm:
            return f"left as it is: {a.why_not(m)}", a.name
        return "a subclass of nn.GroupNorm that no adapter names (its forward may differ from nn.GroupNorm's)", ""
    if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
        return f"a subclass of nn.{'MaxPool2d' if isinstance(m, nn.MaxPool2d) else 'AvgPool2d'}", ""
    if isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d,
                      nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool3d)):
        return "adaptive pooling is not a ckgen op", ""
    if isinstance(m, (nn.MaxPool1d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool3d)):
        return "ckgen pools 2-D inputs only", ""
    if isinstance(m, (nn.LPPool2d, nn.FractionalMaxPool2d, nn.LPPool1d)):
        return "not a ckgen op", ""
    if type(m) is nn.SiLU:
        return "not right after a GroupNorm in an nn.Sequential, a FusePattern or an adapter (runs as PyTorch's " \
               "SiLU)", ""
    return None, ""


__all__ = ["Adapter", "ConvertReport", "ConvertWarning", "Entry", "FusePattern", "OPS", "Site", "convert"]
