"""The compiled-template cache (ckgen/codegen.py's TemplateBytecode), CPU tier: a fresh
environment loads what an earlier one compiled instead of compiling it, renders the same text as
an environment without the cache, and a spoiled, odd or unwritable cache folder changes nothing
but the time a render takes."""
from __future__ import annotations

import os
from pathlib import Path

import jinja2
import pytest

from ckgen import codegen
from ckgen.instance import render_instance
from ckgen.ops import all_ops
from ckgen.types import Target

SM90 = Target.named("sm_90")


def _sources() -> dict[str, str]:
    """Every op's default config rendered for a small problem of it."""
    out = {}
    for op in all_ops():
        if op.name.startswith("groupnorm"):
            p = op.parse_problem(N=2, C=64, H=9, W=7, G=8, dtype="fp16", layout="nchw")
        else:
            p = op.parse_problem(N=2, C=16, H=9, W=7, kernel=3, stride=2, dtype="fp16", layout="nchw")
        out[op.name] = render_instance(op, p, op.space.default, SM90, check=False).code
    return out


def _fresh_environment() -> None:
    codegen.environment.cache_clear()


@pytest.fixture
def fresh():
    _fresh_environment()
    yield
    _fresh_environment()


def _cached_files() -> list[Path]:
    return sorted(codegen.TemplateBytecode.folder().glob("*.cache"))


def _no_compiling(monkeypatch) -> None:
    def refuse(self, *a, **k):
        raise AssertionError("a template was compiled, not loaded from the cache")

    monkeypatch.setattr(jinja2.Environment, "compile", refuse)


def test_a_fresh_environment_loads_compiled_templates(fresh, monkeypatch) -> None:
    want = _sources()
    assert _cached_files(), "nothing was kept"
    _fresh_environment()
    with monkeypatch.context() as m:
        _no_compiling(m)
        assert _sources() == want


def test_rendered_text_is_the_uncached_environments(fresh) -> None:
    plain = jinja2.Environment(loader=jinja2.FileSystemLoader(str(codegen.TEMPLATE_DIR)), **codegen.OPTIONS)
    assert plain.bytecode_cache is None
    _sources()  # kept
    _fresh_environment()
    for name, code in _sources().items():  # loaded
        op = next(o for o in all_ops() if o.name == name)
        assert code.split("\n", 1)[1] == _render_with(plain, op)


def _render_with(env: jinja2.Environment, op) -> str:
    if op.name.startswith("groupnorm"):
        p = op.parse_problem(N=2, C=64, H=9, W=7, G=8, dtype="fp16", layout="nchw")
    else:
        p = op.parse_problem(N=2, C=16, H=9, W=7, kernel=3, stride=2, dtype="fp16", layout="nchw")
    c = op.space.default
    return env.get_template(op.template).render(name=op.instance_name(p, c), **op.render_context(p, c, SM90))


@pytest.mark.parametrize("spoil", ["garbage", "truncated", "empty", "fifo", "directory"])
def test_a_spoiled_cache_file_is_compiled_anew(fresh, spoil) -> None:
    want = _sources()
    files = _cached_files()
    for f in files:
        data = f.read_bytes()
        f.unlink()
        if spoil == "garbage":
            f.write_bytes(os.urandom(len(data)))
        elif spoil == "truncated":
            f.write_bytes(data[: len(data) // 2])
        elif spoil == "empty":
            f.write_bytes(b"")
        elif spoil == "fifo":
            if not hasattr(os, "mkfifo"):
                pytest.skip("no FIFOs here")
            os.mkfifo(f)
        else:
            f.mkdir()
    _fresh_environment()
    assert _sources() == want
    if spoil in ("garbage", "truncated", "empty"):  # rewritten by the compile
        _fresh_environment()
        assert [f.read_bytes()[:2] for f in files] == [b"j2"] * len(files)


def test_another_jinja_or_python_keeps_its_own_files(fresh, monkeypatch) -> None:
    _sources()
    first = set(_cached_files())
    monkeypatch.setattr(jinja2, "__version__", jinja2.__version__ + ".other")
    _fresh_environment()
    _sources()
    assert first < set(_cached_files())


def test_an_unusable_cache_folder_does_not_stop_a_render(fresh, tmp_path: Path, monkeypatch) -> None:
    want = _sources()
    (tmp_path / "not-a-folder").write_text("x")
    monkeypatch.setenv("CKGEN_CACHE_DIR", str(tmp_path / "not-a-folder"))
    _fresh_environment()
    assert _sources() == want


def test_the_cache_folder_follows_the_setting(fresh, tmp_path: Path, monkeypatch) -> None:
    _sources()
    monkeypatch.setenv("CKGEN_CACHE_DIR", str(tmp_path / "elsewhere"))
    _fresh_environment()
    _sources()
    assert _cached_files() and all(f.is_relative_to(tmp_path / "elsewhere") for f in _cached_files())


def test_the_cache_keeps_its_newest_files(fresh, monkeypatch) -> None:
    monkeypatch.setattr(codegen, "BYTECODE_KEEP", 2)
    _sources()
    assert len(_cached_files()) == 2
