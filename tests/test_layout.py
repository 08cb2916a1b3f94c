"""The layout of the house: the package's layers and which module may import which, where the op
families live, where templates and tuning spaces are read from (no GPU needed)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "ckgen"

#: The package's layers, lowest first (docs/architecture.md, "Layers"). A module may import the
#: modules of its own layer and of the layers below it, never one above; every module is in one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("ckgen._version", "ckgen.types", "ckgen.settings", "ckgen.resources", "ckgen.files", "ckgen.parsecache",
              "ckgen.space", "ckgen.codegen", "ckgen.instance", "ckgen.ops")),
    ("model", ("ckgen.model",)),
    ("runtime", ("ckgen.runtime",)),
    ("tuning", ("ckgen.tuner",)),
    ("offline", ("ckgen.offline",)),
    ("interfaces", ("ckgen.cli", "ckgen.torch", "ckgen.__main__", "ckgen")),
]


def package_modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of the package under `root`, by dotted name (a package by its own name)."""
    out = {}
    for p in (root / "ckgen").rglob("*.py"):
        rel = p.relative_to(root).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (never run: no edge of the graph)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def ckgen_imports(path: Path, modules: dict[str, Path] | None = None, root: Path = REPO) -> set[str]:
    """The modules of the package that `path` imports, at module level or inside functions, as
    dotted names. `from ckgen.x import y` imports ckgen.x.y where that is a module, else ckgen.x;
    importing a module also runs its packages' __init__, but that is the package's entry, not an
    edge. Imports under `if TYPE_CHECKING:` do not count."""
    mods = package_modules(root) if modules is None else modules
    rel = path.relative_to(root).with_suffix("")
    package = list(rel.parts[:-1])  # a module's package; an __init__'s is its own
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "ckgen"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "ckgen":
                found |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names}
    out = set()
    for m in found:
        while m not in mods and "." in m:
            m = m.rsplit(".", 1)[0]
        out.add(m)
    return out


def module_graph() -> dict[str, set[str]]:
    mods = package_modules()
    return {name: ckgen_imports(path, mods) - {name} for name, path in mods.items()}


def layer_of(module: str) -> int:
    best, level = "", -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            if (module == pre or module.startswith(pre + ".")) and len(pre) > len(best):
                best, level = pre, i
    return level


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_layer() -> None:
    assert [m for m in package_modules() if layer_of(m) < 0] == []


def test_no_module_imports_a_higher_layer() -> None:
    bad = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
           for m, deps in sorted(module_graph().items()) for d in sorted(deps) if layer_of(d) > layer_of(m)]
    assert bad == []


def test_the_runtime_never_imports_tuning() -> None:
    """Online tuning reaches the dispatcher through the hook it registers (`dispatch.set_untuned_hook`)."""
    graph = module_graph()
    low = [m for m in graph if LAYERS[layer_of(m)][0] in ("core", "model", "runtime")]
    assert [(m, d) for m in low for d in graph[m] if layer_of(d) >= layer_of("ckgen.tuner")] == []


def test_no_import_cycles() -> None:
    """No two modules import each other, directly or through others (imports in functions count)."""
    assert cycles(module_graph()) == []


def test_the_checks_see_what_they_check(tmp_path: Path) -> None:
    """The graph holds function-level imports and relative ones, leaves out TYPE_CHECKING ones,
    and a cycle or an upward import is found: the checks above cannot pass vacuously."""
    graph = module_graph()
    assert "ckgen.runtime.dispatch" in graph["ckgen.runtime.api.groupnorm"]
    assert "ckgen.runtime.dispatch" in graph["ckgen.tuner.tune"]  # inside a function
    (tmp_path / "ckgen" / "runtime").mkdir(parents=True)
    for name in ("ckgen/__init__.py", "ckgen/runtime/__init__.py", "ckgen/tuner.py"):
        (tmp_path / name).write_text("")
    f = tmp_path / "ckgen" / "runtime" / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import settings\n"
                 "def f():\n    from .. import tuner\n")
    mods = package_modules(tmp_path)
    assert ckgen_imports(f, mods, tmp_path) == {"ckgen.tuner"}
    assert layer_of("ckgen.tuner") > layer_of("ckgen.runtime.m")
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_version_is_pyprojects() -> None:
    tomllib = pytest.importorskip("tomllib")
    from ckgen._version import __version__

    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == __version__


def test_types_is_the_bottom_module() -> None:
    assert ckgen_imports(PKG / "types.py") == set()


@pytest.mark.parametrize("module", ["space.py", "codegen.py", "settings.py", "resources.py"])
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
    from ckgen.ops.pool import avg, base, bwd, max as maxmod, problem

    assert pool.MaxPool2dFwd is maxmod.MaxPool2dFwd and pool.MaxPool2dBwd is maxmod.MaxPool2dBwd
    assert pool.AvgPool2dFwd is avg.AvgPool2dFwd and pool.AvgPool2dBwd is avg.AvgPool2dBwd
    assert pool.PoolProblem is problem.PoolProblem and pool.maxpool2d_reference is problem.maxpool2d_reference
    for name in ("maxpool2d_fwd", "maxpool2d_bwd", "avgpool2d_fwd", "avgpool2d_bwd"):
        assert isinstance(get_op(name), base._PoolOp)
    for name in pool.__all__:
        assert hasattr(pool, name), name
    for mod in (problem, base, bwd, maxmod, avg):  # no module of the family holds it all again
        assert len(Path(mod.__file__).read_text().splitlines()) < 450, mod.__name__


# ------------------------------------------------------------------ data folders and packaging


def test_data_folders_live_at_the_repo_root() -> None:
    from ckgen.resources import templates_dir, tuning_spaces_dir

    import ckgen

    assert not (PKG / "templates").exists() and not (PKG / "tuning_spaces").exists()
    # the checkout's folders, unless this run imports an installed ckgen (`pytest` after `pip install .`)
    root = REPO if Path(ckgen.__file__).resolve().parent == PKG else Path(ckgen.__file__).resolve().parent
    assert templates_dir() == root / "templates" and tuning_spaces_dir() == root / "tuning_spaces"
    assert (REPO / "templates" / "common" / "prelude.cuh.j2").is_file()
    assert not list(PKG.glob("data/*.lock")), "lock files are not committed (.gitignore has *.lock)"


def test_data_dir_prefers_the_packaged_folder(tmp_path: Path, monkeypatch) -> None:
    """In a wheel the folders sit inside the package; that copy wins over anything beside it."""
    from importlib import resources

    from ckgen import resources as res

    pkg = tmp_path / "ckgen"
    (pkg / "templates").mkdir(parents=True)
    monkeypatch.setattr(resources, "files", lambda name: pkg)
    res.data_dir.cache_clear()
    try:
        assert res.data_dir("templates") == pkg / "templates"
        assert res.data_dir("tuning_spaces") == REPO / "tuning_spaces"  # not packaged: the checkout's
        with pytest.raises(ValueError, match="not one of"):
            res.data_dir("../etc")
    finally:
        res.data_dir.cache_clear()


def test_pyproject_lists_every_package() -> None:
    """The mapped data folders rule out packages.find: the explicit list must name every package."""
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.relative_to(REPO).parts) for p in PKG.rglob("*") if (p / "__init__.py").is_file()} | {"ckgen"}
    found |= {"ckgen.data", "ckgen.templates", "ckgen.templates.common", "ckgen.tuning_spaces"}
    assert set(cfg["packages"]) == found
    assert cfg["package-dir"] == {"ckgen.templates": "templates", "ckgen.tuning_spaces": "tuning_spaces"}
    subdirs = {p.name for p in (REPO / "templates").iterdir() if p.is_dir()}
    assert subdirs == {"common"}, "a new templates/ subfolder needs its own entry in packages and package-data"


def test_sdist_and_its_wheel_carry_the_data(tmp_path: Path) -> None:
    """The sdist holds templates/ and tuning_spaces/, the license and every file the long
    description (README.md) links; the wheel built from it maps the data folders into the package
    and carries the license. Building warns of nothing (setuptools' deprecations have end dates).
    CI's tools/package-check also installs that wheel into a fresh venv and runs it."""
    import re
    import shutil
    import subprocess
    import sys
    import tarfile
    import zipfile

    pytest.importorskip("setuptools.build_meta")
    src = tmp_path / "src"
    (src / "bench" / "results").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "CHANGELOG.md"):
        shutil.copy(REPO / name, src / name)
    for report in (REPO / "bench" / "results").glob("*.md"):
        shutil.copy(report, src / "bench" / "results" / report.name)
    for name in ("ckgen", "templates", "tuning_spaces", "docs"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.lock"))
    code = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=src, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "deprecat" not in (r.stdout + r.stderr).lower(), r.stderr[-2000:]
    sdist = tmp_path / "dist" / r.stdout.strip().splitlines()[-1]
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    for f in ("templates/groupnorm_fwd.cu.j2", "templates/common/prelude.cuh.j2", "tuning_spaces/avgpool2d_bwd.yaml",
              "ckgen/data/instances.yaml", "ckgen/resources.py", "LICENSE"):
        assert f in names, f
    links = set(re.findall(r"\]\(([^)#:]+)\)", (REPO / "README.md").read_text()))
    assert links and "docs/architecture.md" in links
    assert links <= names, f"the sdist lacks what README.md links: {sorted(links - names)}"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "wheel"), str(sdist)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = (tmp_path / "wheel").glob("ckgen-*.whl")
    inside = set(zipfile.ZipFile(whl).namelist())
    want = {f"ckgen/templates/{p.relative_to(REPO / 'templates')}" for p in (REPO / "templates").rglob("*.j2")}
    want |= {f"ckgen/tuning_spaces/{p.name}" for p in (REPO / "tuning_spaces").glob("*.yaml")}
    want |= {f"ckgen/data/{p.name}" for p in (REPO / "ckgen" / "data").iterdir() if not p.name.endswith(".lock")}
    want |= {"ckgen/data/instances.yaml", "ckgen/ops/pool/max.py", "ckgen/types.py"}
    assert want <= inside, sorted(want - inside)
    assert not any(n.startswith(("templates/", "tuning_spaces/")) for n in inside)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in inside), "the wheel lacks the license"
    metadata = zipfile.ZipFile(whl).read(next(n for n in inside if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata


# ------------------------------------------------------------------ the GPU tier's install


def _requirement_names(reqs: list[str]) -> set[str]:
    import re

    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}


def test_gpu_test_extra_covers_the_gpu_tier_and_keeps_a_cuda_torch() -> None:
    """`pip install ".[gpu-test]"` installs everything tests/gpu imports, and pins no torch
    release (test's torch==2.13.0 is the CPU build: it must not replace a CUDA torch)."""
    import sys

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["gpu-test"]
    assert not [r for r in extra if r.lower().startswith("torch") and "==" in r], extra
    have = _requirement_names(extra) | _requirement_names(project["dependencies"])
    dist = {"cupy": "cupy-cuda13x", "yaml": "pyyaml", "torch": "torch", "pytest": "pytest", "numpy": "numpy",
            "hypothesis": "hypothesis", "jinja2": "jinja2", "optuna": "optuna", "rich": "rich"}
    for path in sorted((REPO / "tests" / "gpu").glob("*.py")):
        tree = ast.parse(path.read_text())
        mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        mods |= {n.args[0].value.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and getattr(n.func, "attr", "") == "importorskip" and n.args and isinstance(n.args[0], ast.Constant)}
        local = {f.stem for f in (REPO / "tests").glob("*.py")}  # helpers beside the tests (_torchvision_standin)
        # timm is optional on purpose (its tests skip without it): its torchvision pins a torch release,
        # which pip would install over the GPU machine's CUDA torch (pyproject.toml, gpu-test)
        optional = {"timm"}
        for m in mods - set(sys.stdlib_module_names) - {"ckgen", "__future__", "tests"} - local - optional:
            assert dist.get(m, m) in have, f"{path.name} imports {m}, which .[gpu-test] does not install"
    readme = (REPO / "README.md").read_text()
    assert 'pip install ".[gpu-test]"' in readme and "python3 -m pytest -m gpu" in readme


def test_timm_is_added_without_replacing_the_cpu_torch() -> None:
    """The timm tests' skip reason and the README give one install route, and it keeps the test
    extra's CPU torch: timm without its dependencies (the `models` extra would pull a CUDA torch);
    the others it needs come with the test extra."""
    from _torchvision_standin import SKIP_NO_TIMM, TIMM_INSTALL

    assert TIMM_INSTALL == "pip install --no-deps timm" and TIMM_INSTALL in SKIP_NO_TIMM
    assert f"python3 -m {TIMM_INSTALL}" in " ".join((REPO / "README.md").read_text().split())
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "timm" not in _requirement_names(extras["test"])  # its torchvision pins a torch release
