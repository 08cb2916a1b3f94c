"""Render kernels from Jinja templates. Templates see the problem's compile-time traits,
the config and the target, nothing else."""
from __future__ import annotations

import contextlib
import hashlib
import marshal
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from functools import lru_cache
from typing import Any

import jinja2

from .resources import templates_dir

TEMPLATE_DIR = templates_dir()  # templates/ at the repo root; ckgen/templates in a wheel


@dataclass(frozen=True)
class KernelSource:
    name: str  # the kernel symbol, file stem and DB instance name
    code: str
    sha256: str
    template: str


OPTIONS = dict(undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
BYTECODE_KEEP = 64  # compiled templates kept in the cache folder (a few per ckgen, Jinja and Python)


# The head of a compiled-template file: the format, then the template source's checksum (Jinja's
# bucket checksum) on its own line, then the code (marshal). No pickle: Jinja's own format
# unpickles the checksum, and a planted file would run code on load.
_BYTECODE_MAGIC = b"ckgen-jinja-bytecode 1\n"


class TemplateBytecode(jinja2.BytecodeCache):
    """Compiled templates kept in `<cache dir>/jinja-<uid>` for the next process: compiling the
    templates an unseen problem's first pick renders costs ~80 ms of CPU, loading them ~1 ms.

    A compiled template is code that a render runs, so only this user's files are loaded: the
    folder is per user, created 0700, and used only while it is a real folder of this user's that
    no one else can write to (as Jinja's FileSystemBytecodeCache checks its folder); a file is
    loaded only if it is this user's and writable by no one else (checked on the open file), and
    its format holds no pickle. A cache dir shared by several users (the docs' shared kernel
    cache) then keeps one such folder per user.

    Jinja names a template's file by its name and path and checks the template source's sha1
    on load; the file name here also carries the Jinja and Python versions and the environment's
    options (`tag`), which the compiled code depends on too. Best effort: the cache folder is
    looked up on each use (it follows $CKGEN_CACHE_DIR), a file that cannot be read as a
    regular file, or read back as compiled code, is compiled anew, and an unusable folder is no
    error (templates are then compiled in every process)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    @staticmethod
    def folder() -> Path:
        from . import settings

        uid = os.geteuid() if hasattr(os, "geteuid") else None
        return settings.cache_dir() / ("jinja" if uid is None else f"jinja-{uid}")

    def _private_folder(self) -> Path | None:
        """The folder, made if missing; None unless it is a folder (not a link) of this user's
        that no one else can write to (one of this user's with looser modes is made 0700)."""
        from . import parsecache

        folder = self.folder()
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o700)
            st = os.lstat(folder)
            if stat.S_ISDIR(st.st_mode) and hasattr(os, "geteuid") and st.st_uid == os.geteuid() \
                    and stat.S_IMODE(st.st_mode) != 0o700:
                os.chmod(folder, 0o700)
                st = os.lstat(folder)
        except OSError:
            return None
        return folder if stat.S_ISDIR(st.st_mode) and parsecache.private(st) else None

    def _name(self, bucket: jinja2.bccache.Bucket) -> str:
        return f"{self.tag}-{bucket.key}.cache"

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        from . import parsecache

        folder = self._private_folder()
        data = parsecache.read_file(folder / self._name(bucket), owner_only=True) if folder else None
        head = _BYTECODE_MAGIC + bucket.checksum.encode() + b"\n"
        if data is None or not data.startswith(head):
            return  # none, another format, or compiled from another source: compiled anew
        try:
            bucket.code = marshal.loads(data[len(head):])
        except (EOFError, ValueError, TypeError):
            bucket.reset()

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        from . import parsecache

        folder = self._private_folder()
        if folder is None or bucket.code is None:
            return
        try:
            data = _BYTECODE_MAGIC + bucket.checksum.encode() + b"\n" + marshal.dumps(bucket.code)
        except ValueError:  # code marshal cannot write
            return
        parsecache.write_file(folder, self._name(bucket), data, keep=BYTECODE_KEEP, mode=0o600)


def bytecode_tag() -> str:
    """What compiled templates depend on besides their source: Jinja's and Python's versions and
    the environment's options."""
    what = f"{jinja2.__version__}|{sys.version}|{sorted((k, getattr(v, '__name__', v)) for k, v in OPTIONS.items())}"
    return hashlib.sha256(what.encode()).hexdigest()[:16]


@lru_cache(maxsize=None)
def environment(folder: str | None = None) -> jinja2.Environment:
    """The Jinja environment of ckgen's templates/, or of an op's own template folder (`folder`,
    OpSpec.template_dir), which is searched first, then ckgen's (its `common/` includes)."""
    path = [str(TEMPLATE_DIR)] if folder is None else [folder, str(TEMPLATE_DIR)]
    return jinja2.Environment(loader=jinja2.FileSystemLoader(path),
                              bytecode_cache=TemplateBytecode(bytecode_tag()), **OPTIONS)


# the template folders of the registered plug-in ops (OpSpec.template_dir; ckgen.ops.register
# keeps it): templates_digest covers them too
PLUGIN_TEMPLATE_DIRS: set[str] = set()


def templates_digest() -> str:
    """sha256 over every template file (ckgen's, then the registered plug-ins' folders): a study
    or cache keyed on it never mixes template versions."""
    return _digest(tuple(sorted(PLUGIN_TEMPLATE_DIRS)))


@lru_cache(maxsize=None)
def _digest(extra: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for folder in (TEMPLATE_DIR, *map(Path, extra)):
        for path in sorted(folder.rglob("*.j2")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def render(template: str, name: str, context: dict[str, Any], folder: str | Path | None = None) -> KernelSource:
    """The kernel source of `template` (in ckgen's templates/, or in `folder`: an op's own) for
    the instance `name`, from the op's render context."""
    header = f"// generated by ckgen from templates/{template}, do not edit\n"
    env = environment() if folder is None else environment(str(Path(folder).resolve()))
    body = env.get_template(template).render(name=name, **context)
    code = header + body
    return KernelSource(name, code, hashlib.sha256(code.encode()).hexdigest(), template)
