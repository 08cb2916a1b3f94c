"""The layout of the house: which module may import which, where the op families live, where
templates and tuning spaces are read from (no GPU needed)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "ckgen"


def ckgen_imports(path: Path) -> set[str]:
    """Every ckgen module `path` imports (module level or inside functions), as dotted names."""
    rel = path.relative_to(REPO).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "ckgen"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "ckgen":
                out.add(mod)
                out |= {f"{mod}.{a.name}" for a in node.names}  # `from . import db` imports ckgen.db
    return out


def test_types_is_the_bottom_module() -> None:
    assert ckgen_imports(PKG / "types.py") == set()


@pytest.mark.parametrize("module", ["space.py", "codegen.py", "settings.py"])
def test_lower_layers_do_not_import_ops(module: str) -> None:
    imports = ckgen_imports(PKG / module)
    assert not any(m == "ckgen.ops" or m.startswith("ckgen.ops.") for m in imports), imports


def test_spec_reexports_the_value_types() -> None:
    from ckgen import types
    from ckgen.ops import spec

    for name in ("Config", "Support", "Target", "Launch", "Tolerance", "DTYPES", "LAYOUTS", "INT32_MAX"):
        assert getattr(spec, name) is getattr(types, name), name


def test_pool_family_is_split_and_reexported() -> None:
    """ops/pool/ is split where the seams are; `ckgen.ops.pool` still names everything it did."""
    from ckgen.ops import get_op, pool
    from ckgen.ops.pool import avg, base, max as maxmod, problem

    assert pool.MaxPool2dFwd is maxmod.MaxPool2dFwd and pool.MaxPool2dBwd is maxmod.MaxPool2dBwd
    assert pool.AvgPool2dFwd is avg.AvgPool2dFwd and pool.AvgPool2dBwd is avg.AvgPool2dBwd
    assert pool.PoolProblem is problem.PoolProblem and pool.maxpool2d_reference is problem.maxpool2d_reference
    for name in ("maxpool2d_fwd", "maxpool2d_bwd", "avgpool2d_fwd", "avgpool2d_bwd"):
        assert isinstance(get_op(name), base._PoolOp)
    for name in pool.__all__:
        assert hasattr(pool, name), name
    for mod in (problem, base, maxmod, avg):  # no module of the family holds it all again
        assert len(Path(mod.__file__).read_text().splitlines()) < 450, mod.__name__
