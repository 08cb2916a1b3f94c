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
        assert all(f.read_bytes().startswith(codegen._BYTECODE_MAGIC) for f in files)


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


# ------------------------------------------------------------------ files another user can write


class _Payload:
    """Unpickling this touches `marker`: what a file planted in a cache would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _plant(files: list[Path], marker: Path, owner: int | None) -> None:
    """Replace each cache file by one Jinja's bytecode loader would unpickle (its checksum slot
    holds the payload): another user's and writable by anyone, or (owner None) this user's own
    private file, as an old ckgen's Jinja-format file would be."""
    import pickle

    for f in files:
        f.write_bytes(jinja2.bccache.bc_magic + pickle.dumps(_Payload(marker), 2))
        f.chmod(0o600 if owner is None else 0o666)
        if owner is not None:
            os.chown(f, owner, -1)


@pytest.mark.parametrize("owner", ["this user", "another user"])
def test_no_cache_file_is_unpickled(fresh, tmp_path: Path, owner: str) -> None:
    """Jinja's bucket unpickles the checksum of a cache file: a file planted in the cache (in a
    folder another user can write, or left by an old ckgen) ran code during a plain render."""
    if owner == "another user" and os.geteuid() != 0:
        pytest.skip("making a file another user's needs root")
    want = _sources()
    files = _cached_files()
    assert files
    marker = tmp_path / "ran"
    _plant(files, marker, 65534 if owner == "another user" else None)
    _fresh_environment()
    assert _sources() == want
    assert not marker.exists(), "a cache file's pickle was loaded"


def test_the_cache_folder_is_private_to_its_user(fresh) -> None:
    """The folder follows no umask (0775 under umask 002 let a group plant files): it is 0700
    and this user's, and a folder that is not (a link, another user's, open to others) is not
    used."""
    import stat

    old = os.umask(0o002)
    try:
        _sources()
    finally:
        os.umask(old)
    folder = codegen.TemplateBytecode.folder()
    st = os.lstat(folder)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    for f in _cached_files():
        assert stat.S_IMODE(f.stat().st_mode) & 0o022 == 0
