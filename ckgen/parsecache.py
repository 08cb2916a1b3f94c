"""A cache of what ckgen made of its large data files, for the next process.

The packaged instance DB (YAML, ~1 MB) and cost model (JSON, ~2.3 MB) cost an unseen problem's
first call over half a second of CPU to parse and check: the DB's entries are built by PyYAML's
constructor and each problem key is parsed by its op, the model's residual tables are ~250,000
JSON numbers. The readers (ckgen/runtime/db.py, ckgen/model/parsed.py) keep what they made of a file in
`<cache dir>/<kind>-parsed/<key>.json`, in a form that loads in a few ms, and take it from there
the next time the same bytes are read.

The key is the sha256 of the file's bytes and of what interprets them (ckgen's Python sources,
the reader's format version and whatever else the reader names), so a file changed in one byte,
or read by another ckgen, has another key, and a file that failed to read has none (nothing is
kept from a failed read). The data file stays the one source of truth: a cache file is written
atomically, best effort (an unwritable folder is no error), read only as a regular file of at
most MAX_BYTES, and the reader checks its structure before use and ignores it if it fails.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
import time
from pathlib import Path

KEEP = 16  # cache files kept per kind; a write removes the least recently written beyond these
MAX_BYTES = 256 * 2**20  # a cache file read at most (the packaged DB's is ~0.8 MB, the model's ~1.5 MB)
STALE_TEMP_S = 3600.0  # a temp file this old is a dead writer's
_sources_digest: list[bytes] = []  # ckgen's sources' sha256, computed once per process


def folder(kind: str) -> Path:
    from . import settings

    return settings.cache_dir() / f"{kind}-parsed"


def code_digest() -> bytes:
    """The sha256 of ckgen's Python sources (relative path and bytes of each, in path order);
    empty if they cannot be read (then nothing is cached). ~2 ms, once per process."""
    if not _sources_digest:
        h = hashlib.sha256()
        root = Path(__file__).resolve().parent
        try:
            for f in sorted(root.rglob("*.py")):
                h.update(f.relative_to(root).as_posix().encode() + b"\0")
                data = f.read_bytes()
                h.update(len(data).to_bytes(8, "little") + data)
            _sources_digest.append(h.digest())
        except OSError:
            _sources_digest.append(b"")
    return _sources_digest[0]


def key(kind: str, raw: bytes, *reader: str) -> str | None:
    """The cache key of a file's bytes `raw` as read by this ckgen's `kind` reader (`reader`:
    what else decides what it makes of them, e.g. a format version); None: no cache."""
    code = code_digest()
    if not code:
        return None
    h = hashlib.sha256("\0".join((kind, *reader)).encode() + b"\0")
    h.update(code)
    h.update(raw)
    return h.hexdigest()


def read(kind: str, k: str) -> bytes | None:
    """The bytes of the cache file of key k, None if there is none or it cannot be read (`read_file`)."""
    return read_file(folder(kind) / f"{k}.json")


def private(st: os.stat_result) -> bool:
    """Is what `st` describes this user's and writable by no one else? (Always true where there
    are no user ids.) A file that holds code (compiled templates) is run only when it is."""
    if not hasattr(os, "geteuid"):  # pragma: no cover - Windows
        return True
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def read_file(path: Path, max_bytes: int = MAX_BYTES, owner_only: bool = False) -> bytes | None:
    """The bytes of the file at `path`, None if there is none or it cannot be read as a regular
    file of at most `max_bytes` (opened without blocking: a FIFO put there waits for no one), or,
    with `owner_only`, it is not `private` (checked on the open file, not on its name)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes or (owner_only and not private(st)):
            return None
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 22, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks) if size <= max_bytes else None
    except OSError:
        return None
    finally:
        os.close(fd)


def write(kind: str, k: str, text: str) -> None:
    """Keep `text` (ASCII) as the cache file of key k (`write_file`)."""
    with contextlib.suppress(Exception):
        write_file(folder(kind), f"{k}.json", text.encode("ascii"))


def new_temp(folder: Path, prefix: str, mode: int = 0o666) -> tuple[int, Path]:
    """A new file `<prefix><hex>.tmp` in `folder`, opened for writing (the DB saves, the kernel
    cache and these caches write one, then rename it into place). Created with mode 0666 by
    default, so the umask applies as to any new file: tempfile's 0600 would make each file
    private to its writer, and a folder shared by two users fail for the second."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = folder / f"{prefix}{secrets.token_hex(8)}.tmp"
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue


def write_file(where: Path, name: str, data: bytes, keep: int | None = None, mode: int = 0o666) -> None:
    """Keep `data` as the file `name` (ending in .json or .cache) in the folder `where`: a temp
    file (created with `mode`, less the umask) renamed into place, then the folder pruned to its
    `keep` (default KEEP) most recently written such files. Best effort: any error leaves the
    folder as it was."""
    with contextlib.suppress(Exception):
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = new_temp(where, ".parsed-", mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, where / name)
        finally:
            tmp.unlink(missing_ok=True)
        _prune(where, KEEP if keep is None else keep)


def forget(kind: str, k: str) -> None:
    """Remove the cache file of key k (its reader found it spoiled)."""
    with contextlib.suppress(OSError):
        (folder(kind) / f"{k}.json").unlink()


def _prune(where: Path, keep: int) -> None:
    """Keep the `keep` most recently written cache files; remove the others and dead writers' temp files."""
    now, files = time.time(), []
    for n in os.listdir(where):
        f = where / n
        with contextlib.suppress(OSError):
            mtime = f.stat().st_mtime
            if n.endswith((".json", ".cache")):
                files.append((mtime, f))
            elif n.endswith(".tmp") and now - mtime > STALE_TEMP_S:
                f.unlink()
    for _, f in sorted(files, reverse=True)[keep:]:
        with contextlib.suppress(OSError):
            f.unlink()
