"""Reading and writing ckgen's own files safely: only regular files, read without blocking and up
to a bound, and written whole (a temp file, fsynced, renamed into place).

A path ckgen reads (a records file, a cost model, a kernel-cache entry) can name anything: a FIFO,
whose open waits for a writer for ever; a device such as /dev/zero, which never ends; a file far
larger than any ckgen writes. `read_regular` opens without blocking, checks what it opened (not
the name, which could change in between) and stops at `max_bytes`. A file written in place can be
left cut by a full disk or a crash; `write_atomic` leaves either the old file or the new one.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path


class UnusableFile(OSError):
    """A path that names something other than a regular file, or a file over the bound."""


def kind(mode: int) -> str:
    """What a file that is not a regular file is, for a message."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def read_regular(path: Path | str, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path`. FileNotFoundError if there is none, another
    OSError if it cannot be opened, UnusableFile (an OSError) if it is not a regular file or
    holds more than `max_bytes` (a file growing while read stops at the bound too)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnusableFile(f"{path} is {kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise UnusableFile(f"{path} is {st.st_size:,} bytes, over the {max_bytes:,} read at most")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 22, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise UnusableFile(f"{path} is over the {max_bytes:,} bytes read at most")
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_atomic(path: Path | str, data: bytes) -> None:
    """Replace the file at `path` with `data`: a temp file beside it (the existing file's mode,
    else the umask's), fsynced, renamed onto it, then the folder fsynced (best effort). On any
    error the temp file is removed and `path` is as it was."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, flags, 0o666)
    try:
        try:
            with contextlib.suppress(FileNotFoundError):
                mode = stat.S_IMODE(os.stat(path).st_mode)
                if hasattr(os, "fchmod"):
                    os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # the rename itself (not possible on every platform)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
