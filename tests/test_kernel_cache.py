"""The on-disk kernel cache (ckgen/runtime/compile.py), CPU tier: NVRTC is replaced by a stub, so these run
without CuPy. Files take the umask's mode (a cache shared by two users), an unreadable entry is
compiled again, and a cache folder that cannot take a cubin costs one warning, not the call."""
from __future__ import annotations

import hashlib
import os
import stat
import warnings
from pathlib import Path

import pytest

import ckgen
from ckgen.runtime import compile as ckcompile
from ckgen.runtime import spill
from ckgen.codegen import KernelSource
from ckgen.ops.spec import Target

SM90 = Target.named("sm_90")


def _elf(body: bytes) -> bytes:
    """A 64-bit ELF header without sections, then `body`: what the cache's check of a cubin's
    structure accepts (a real cubin is not needed: nothing here loads it)."""
    return b"\x7fELF\x02\x01\x01" + bytes(57) + body


FAKE = _elf(b"not-a-real-cubin")


def _src(name: str = "ckgen_test_kernel") -> KernelSource:
    code = f"// {name}\n"
    return KernelSource(name, code, hashlib.sha256(code.encode()).hexdigest(), "test.cu.j2")


@pytest.fixture
def nvrtc(monkeypatch):
    """compile_offline replaced by a stub that counts its calls (no NVRTC needed)."""
    calls = []

    def fake(src, target):
        calls.append(src.name)
        return ckcompile.Binary(src.name, target.arch, FAKE, "")

    monkeypatch.setattr(ckcompile, "compile_offline", fake)
    monkeypatch.setattr(ckcompile, "_warned", set(), raising=False)
    return calls


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "kernels"
    monkeypatch.setenv("CKGEN_KERNEL_CACHE", str(folder))
    return folder


def _deny_reads(path: Path, monkeypatch) -> None:
    """Make the file at `path` unreadable to this process, as another user's 0600 file is: chmod
    000, and where that does not bite (root reads anything), os.open refuses that inode as the
    kernel would refuse another user (a replaced file is a new inode, readable again)."""
    path.chmod(0)
    if os.geteuid() != 0:
        return
    ino = path.stat().st_ino
    real_open = os.open

    def guarded(p, flags, *args, **kw):
        try:  # that path's inode (a freed inode number is given to the next new file)
            same = os.fspath(p) == os.fspath(path) and os.stat(p).st_ino == ino
        except OSError:
            same = False
        if same and not flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, flags, *args, **kw)

    monkeypatch.setattr(os, "open", guarded)


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_cached_cubins_take_the_umask_mode(nvrtc, cache, umask):
    """tempfile.mkstemp made every cubin 0600: the second user of a shared cache could not read
    the first one's kernels. Now a cubin is created as any file is (0666 less the umask)."""
    old = os.umask(umask)
    try:
        path = ckcompile.ensure_cubin(_src(), SM90)
    finally:
        os.umask(old)
    assert path.read_bytes() == FAKE
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp")]


def test_unreadable_cache_entry_is_compiled_again_and_replaced(nvrtc, cache, monkeypatch):
    src = _src()
    path = ckcompile.cubin_path(src, SM90.arch)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"another user's private cubin")
    _deny_reads(path, monkeypatch)
    got = ckcompile.ensure_cubin(src, SM90)
    assert nvrtc == [src.name]  # a miss: compiled again
    assert got == path and got.read_bytes() == FAKE  # and the entry replaced
    assert ckcompile.cubin_bytes(src, SM90) == FAKE
    assert nvrtc == [src.name]  # now a hit


def test_entry_that_cannot_be_replaced_still_serves_the_kernel(nvrtc, cache, monkeypatch):
    """An unreadable entry that cannot be replaced either (here a folder in its place) is compiled
    and used from this process's own copy, with one warning."""
    src = _src()
    path = ckcompile.cubin_path(src, SM90.arch)
    path.mkdir(parents=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ckcompile.ensure_cubin(src, SM90)
        again = ckcompile.ensure_cubin(src, SM90)
        assert ckcompile.cubin_bytes(src, SM90) == FAKE
    assert got != path and got.read_bytes() == FAKE and again == got
    mine = [w for w in caught if issubclass(w.category, ckcompile.KernelCacheWarning)]
    assert len(mine) == 1 and str(path.parent) in str(mine[0].message)


def _unusable(kind: str, tmp_path: Path) -> Path:
    if kind == "file in place of the folder":
        (tmp_path / "kernels").write_text("not a folder")
        return tmp_path / "kernels"
    if kind == "parent cannot be created":
        (tmp_path / "afile").write_text("a file")
        return tmp_path / "afile" / "sub" / "kernels"
    folder = tmp_path / "kernels"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


UNUSABLE = ["file in place of the folder", "parent cannot be created",
            pytest.param("read-only", marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere"))]


@pytest.mark.parametrize("kind", UNUSABLE)
def test_unusable_cache_folder_warns_once_and_compiles_in_memory(nvrtc, tmp_path, monkeypatch, kind):
    monkeypatch.setenv("CKGEN_KERNEL_CACHE", str(_unusable(kind, tmp_path)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckcompile.cubin_bytes(_src("a"), SM90) == FAKE
        assert ckcompile.cubin_bytes(_src("b"), SM90) == FAKE
        assert ckcompile.ensure_cubin(_src("c"), SM90).read_bytes() == FAKE
        assert ckcompile.compile_many([_src("d"), _src("e")], SM90, workers=1) == {}
    mine = [w for w in caught if issubclass(w.category, ckcompile.KernelCacheWarning)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    assert "CKGEN_KERNEL_CACHE" in str(mine[0].message)


@pytest.mark.parametrize("kind", UNUSABLE)
def test_untuned_nhwc_pool_forward_dispatch_survives_an_unusable_cache(nvrtc, tmp_path, monkeypatch, model_on,
                                                                        kind):
    """The offline spill check of an untuned NHWC pooling forward compiles its pick into the kernel
    cache; an unusable cache crashed `ckgen.explain` (and the call) there. It checks in memory."""
    monkeypatch.setenv("CKGEN_KERNEL_CACHE", str(_unusable(kind, tmp_path)))
    monkeypatch.setattr(ckcompile, "nvrtc_missing", lambda: None)
    monkeypatch.setattr(spill, "_SPILLS", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = ckgen.explain("maxpool2d_fwd", N=2, C=40, H=37, W=29, kernel=3, stride=2, padding=1,
                               dtype="bf16", layout="nhwc", arch="sm_90")
    assert choice.source == "model" and nvrtc  # the spill check compiled (in memory)
    mine = [w for w in caught if issubclass(w.category, ckcompile.KernelCacheWarning)]
    assert len(mine) == 1


# ------------------------------------------------------------------ entries that are not what their name says


@pytest.fixture
def per_source(monkeypatch):
    """compile_offline replaced by a stub whose cubin names its source."""
    calls = []

    def fake(src, target):
        calls.append(src.name)
        return ckcompile.Binary(src.name, target.arch, _elf(src.sha256.encode()), "")

    monkeypatch.setattr(ckcompile, "compile_offline", fake)
    return calls


def test_an_entry_is_used_only_for_the_source_it_was_compiled_from(per_source, cache):
    """A cubin under another entry's name (a shared cache's writer swapping files, a copy) was
    loaded for that name's kernel: entries are checked against the full source hash and their
    bytes' hash, and one that fails is compiled again."""
    a, b = _src("a"), _src("b")
    ckcompile.ensure_cubin(a, SM90)
    pa, pb = ckcompile.cubin_path(a, SM90.arch), ckcompile.cubin_path(b, SM90.arch)
    pb.write_bytes(pa.read_bytes())  # a's cubin under b's name
    assert ckcompile.cubin_bytes(b, SM90) == _elf(b.sha256.encode()) and per_source == ["a", "b"]
    for f in pa.parent.iterdir():  # and a's record of it too
        if f.name.startswith(pa.name):
            f.with_name(f.name.replace(pa.name, pb.name)).write_bytes(f.read_bytes())
    assert ckcompile.cubin_bytes(b, SM90) == _elf(b.sha256.encode()) and per_source == ["a", "b", "b"]
    assert ckcompile.cubin_bytes(b, SM90) == _elf(b.sha256.encode()) and per_source == ["a", "b", "b"]  # a hit


@pytest.mark.parametrize("damage", ["empty", "truncated", "not ELF"])
def test_a_damaged_cubin_is_compiled_again(cache, damage, monkeypatch):
    """An empty or cut cubin (written without fsync before the rename, then a crash) was used for
    good. The entry's bytes are checked (their hash, and the ELF header and sections inside the
    file), and a bad entry is compiled again and replaced."""
    monkeypatch.setattr(ckcompile, "_warned", set(), raising=False)
    src = _src()
    real = ckcompile.compile_offline(src, SM90).cubin if ckcompile.nvrtc_missing() is None else None
    if real is None:
        pytest.skip("NVRTC is not available")
    path = ckcompile.ensure_cubin(src, SM90)
    whole = path.read_bytes()
    path.write_bytes({"empty": b"", "truncated": whole[: len(whole) * 2 // 3], "not ELF": b"x" * len(whole)}[damage])
    assert ckcompile.cubin_bytes(src, SM90) == whole
    assert path.read_bytes() == whole


def test_a_cut_cubin_fails_the_structure_check_alone():
    """Without its record, a cubin cut anywhere past its header is still refused: its sections
    or its section header table end beyond the file."""
    src = KernelSource("k", "extern \"C\" __global__ void k(float* x) { x[threadIdx.x] = 1.f; }\n",
                       hashlib.sha256(b"k").hexdigest(), "t.cu.j2")
    if ckcompile.nvrtc_missing() is not None:
        pytest.skip("NVRTC is not available")
    whole = ckcompile.compile_offline(src, SM90).cubin
    assert ckcompile.elf_whole(whole)
    assert not any(ckcompile.elf_whole(whole[:n]) for n in range(0, len(whole) - 400, 97))


def test_a_fifo_in_the_cache_does_not_hang(per_source, cache, no_hang):
    """A FIFO where an entry (or its record) should be: reading it waited for a writer for ever."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    src = _src()
    path = ckcompile.cubin_path(src, SM90.arch)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    with no_hang(5):
        assert ckcompile.cubin_bytes(src, SM90) == _elf(src.sha256.encode())
        assert ckcompile.compile_many([src], SM90, workers=1) == {}
        assert ckcompile.ensure_cubin(src, SM90).read_bytes() == _elf(src.sha256.encode())


def test_cubins_are_synced_before_the_rename(nvrtc, cache, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(ckcompile.os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    ckcompile.ensure_cubin(_src(), SM90)
    assert synced
