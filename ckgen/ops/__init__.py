"""Op registry: every op is declared once, as an OpSpec, and registered here.

ckgen's own ops are registered on import; an op defined elsewhere (a plug-in: its OpSpec names
its template folder and tuning space file) joins them with `register(op)`. The CLI, tuner, DB,
dispatcher, library, records and `ckgen bench` then find it by name like the others."""
from __future__ import annotations

from .groupnorm import GroupNormFwd
from .groupnorm_bwd import GroupNormBwd, GroupNormBwdData, GroupNormBwdGammaBeta
from .pool import AvgPool2dBwd, AvgPool2dFwd, MaxPool2dBwd, MaxPool2dFwd
from .spec import OpSpec

# in registration order: the CLI adds the op families' problem options in this order
_REGISTRY: dict[str, OpSpec] = {spec.name: spec for spec in (
    GroupNormFwd(), GroupNormBwd(), GroupNormBwdData(), GroupNormBwdGammaBeta(),
    MaxPool2dFwd(), MaxPool2dBwd(), AvgPool2dFwd(), AvgPool2dBwd())}


def register(op: OpSpec, *, replace: bool = False) -> OpSpec:
    """Add `op` (an OpSpec instance) to the registry under `op.name` and return it. Checked here:
    an OpSpec with a name, a template file and a tuning space that reads (with its default
    config valid). A name already registered is a ValueError unless `replace` (an op of ckgen's
    own cannot be replaced)."""
    import re
    from pathlib import Path

    from ..resources import templates_dir

    if not isinstance(op, OpSpec):
        raise TypeError(f"register: expected an OpSpec instance, got {type(op).__name__}")
    name = getattr(op, "name", None)
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"register: op name {name!r} must be lower-case letters, digits and _ (a letter first)")
    if name in _REGISTRY and (not replace or name in _BUILTIN):
        raise ValueError(f"register: an op named {name!r} is already registered")
    folder = Path(op.template_dir) if op.template_dir is not None else templates_dir()
    if not (folder / op.template).is_file():
        raise ValueError(f"register: {name}: no template {op.template!r} in {folder}")
    _check_template(op)
    try:
        op.space  # reads and checks the tuning space: a broken one fails here, not at the first pick
    except ValueError as e:
        raise ValueError(f"register: {name}: {e}") from None
    _REGISTRY[name] = op
    _plugin_template_dirs()
    return op


def _check_template(op: OpSpec) -> None:
    """The op's template compiles (Jinja's syntax), in the environment its renders use: a broken
    one fails at register, naming the file and line, not at the first render. (What it includes
    is compiled at the first render.)"""
    from pathlib import Path

    import jinja2

    from ..codegen import environment

    env = environment() if op.template_dir is None else environment(str(Path(op.template_dir).resolve()))
    try:
        env.get_template(op.template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"register: {op.name}: template {e.filename or op.template}, line {e.lineno}: "
                         f"{e.message}") from None


def unregister(name: str) -> None:
    """Remove a registered plug-in op (ckgen's own stay)."""
    if name in _BUILTIN:
        raise ValueError(f"unregister: {name!r} is one of ckgen's own ops")
    if name not in _REGISTRY:
        raise ValueError(f"unregister: no op {name!r} is registered")
    del _REGISTRY[name]
    _plugin_template_dirs()


def _plugin_template_dirs() -> None:
    """Tell codegen the registered plug-ins' template folders (its templates_digest covers them)."""
    from pathlib import Path

    from ..codegen import PLUGIN_TEMPLATE_DIRS

    PLUGIN_TEMPLATE_DIRS.clear()
    PLUGIN_TEMPLATE_DIRS.update(str(Path(op.template_dir).resolve()) for op in _REGISTRY.values()
                                if op.template_dir is not None)


def get_op(name: str) -> OpSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"op: unknown {name!r}; known ops: {', '.join(sorted(_REGISTRY))}") from None


def all_ops() -> list[OpSpec]:
    """Every registered op, by name."""
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def registered_ops() -> list[OpSpec]:
    """Every registered op, in registration order (ckgen's own first)."""
    return list(_REGISTRY.values())


_BUILTIN = frozenset(_REGISTRY)

__all__ = ["OpSpec", "all_ops", "get_op", "register", "registered_ops", "unregister"]
