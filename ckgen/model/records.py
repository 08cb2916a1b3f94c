"""Tuning records: every measured (problem, config) of every tuning run, kept as data for the
config cost model (ckgen/model/).

A record is one JSON object per line (JSON Lines):

    {"op": ..., "vendor": ..., "arch": ..., "device": ..., "problem": <problem key>,
     "features": {<problem features, for reading; the model recomputes them from the key>},
     "config": {...}, "ok": true, "time_us": 12.3,            # ok: verified and timed
     "reason": "...",                                          # ok = false: why it failed
     "phase": "trial" | "final" | "sweep" | "winner" | "default" | "bench",
     "source": where it came from, "date": ISO 8601,
     "kernel_version": the kernels' version it was timed with (KERNEL_VERSION)}

`ckgen tune` appends a record per measured trial and per final-round re-timing to the records
file beside the user DB (`user_records_path`), under a file lock, so concurrent tuners lose no
line. The package ships `ckgen/data/records.jsonl.gz`, built from the repo's measurements by
`tools/build_records.py` (ckgen/offline/shipped.py says what goes in).

Reading is tolerant: a malformed line (a line nested too deeply to parse too) is skipped, with
one warning per file. A record written before records carried `kernel_version` gets it from
`legacy_kernel_version` as it is read (the one place that looks at a record's date for that).
Nothing here imports CuPy."""
from __future__ import annotations

import datetime as _dt
import gzip
import importlib.resources
import json
import errno
import math
import os
import stat
import warnings
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator

import filelock

from .. import files
from ..ops import get_op
from ..ops.spec import Config, OpSpec, Problem, Target

PHASES = ("trial", "final", "sweep", "winner", "default", "bench")
# The `source` label of a record from one of the repo's exhaustive sweeps (the files of
# tests/data/sweeps/): a fixed label, not the files' path (another label changes every sweep
# record of the shipped ckgen/data/records.jsonl.gz)
SWEEP_SOURCE = "bench/results/sweeps/"
LOCK_TIMEOUT_S = 60.0
# Bytes of a records file read at most (and of a .gz one unpacked): a record takes ~400 bytes, so
# over a million of them; a larger file (or /dev/zero at the path) is warned about, not read.
MAX_RECORDS_BYTES = 512 * 2**20

# The version of the kernels a record was timed with, in every record as "kernel_version". Raise
# it when a template change alters what a config of the tuning spaces does (not merely how fast),
# so that the cost model can fit records of either version by the rule they ran:
#   1: the NCHW GroupNorm backward's sums walked a channel in rows as wide as the channel (up to
#      the block);
#   2: in rows as narrow as sweep a channel in one step (`OpSpec.chain_steps`, narrow_rows).
KERNEL_VERSION = 2
# The migration rule for legacy records, which carry no kernel_version (those written before it
# existed: old user records files, the repo's tuning-run records): a record dated from this time
# on was timed with version 2 kernels, an older one (or an undated one) with version 1. Used by
# `legacy_kernel_version` alone; never by a record that says its version.
LEGACY_V2_FROM_DATE = "2026-11-27T18:00"


class RecordsWarning(UserWarning):
    """Lines of a records file were skipped (malformed); the rest is in use."""


def user_records_path() -> Path:
    """The records file beside the user DB: `<db name>.records.jsonl`."""
    from .. import settings

    db = settings.user_db_path()
    return db.with_name(f"{db.stem}.records.jsonl")


def packaged_records_path() -> Path:
    return Path(str(importlib.resources.files("ckgen") / "data" / "records.jsonl.gz"))


def problem_features(op: OpSpec, p: Problem) -> dict[str, Any]:
    """What decides these kernels, of the problem alone (stored with each record for reading):
    the op's `problem_features`."""
    return op.problem_features(p)


def legacy_kernel_version(rec: dict[str, Any]) -> int:
    """The migration of a legacy record (one without "kernel_version"): the kernels' version
    from its date, by LEGACY_V2_FROM_DATE. `read` applies it to every record it reads that lacks
    the field; a record that has it keeps it."""
    return 2 if str(rec.get("date") or "") >= LEGACY_V2_FROM_DATE else 1


def kernel_version(rec: dict[str, Any]) -> int:
    """The version of the kernels `rec` was timed with: its "kernel_version", else (a legacy record
    made without `make_record` or `read`) the legacy migration's."""
    v = rec.get("kernel_version")
    return v if isinstance(v, int) and not isinstance(v, bool) else legacy_kernel_version(rec)


def make_record(op: OpSpec, p: Problem, target: Target, device: str, config: Config, *, ok: bool,
                time_us: float | None = None, reason: str = "", phase: str = "trial", source: str = "tune",
                date: str | None = None, kernel_version: int = KERNEL_VERSION) -> dict[str, Any]:
    """A record of one measurement. `kernel_version`: the kernels it was timed with (default:
    today's; a record of an older measurement says its own)."""
    rec: dict[str, Any] = {"op": op.name, "vendor": target.vendor, "arch": target.arch, "device": device,
                           "problem": p.key(), "features": problem_features(op, p), "config": config.as_dict(),
                           "ok": bool(ok), "phase": phase, "source": source,
                           "date": date or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                           "kernel_version": int(kernel_version)}
    if ok:
        rec["time_us"] = round(float(time_us), 4)  # type: ignore[arg-type]
    else:
        rec["reason"] = reason[:300]
    return rec


def _checked(rec: Any) -> dict[str, Any]:
    """`rec` if it is a usable record (ValueError otherwise); its problem key is canonical."""
    if not isinstance(rec, dict):
        raise ValueError("not an object")
    for k in ("op", "arch", "device", "problem"):
        if not isinstance(rec.get(k), str) or not rec[k]:
            raise ValueError(f"field {k!r} missing or not a string")
    op = get_op(rec["op"])
    Target.named(rec["arch"])
    rec["problem"] = op.problem_from_key(rec["problem"]).key()
    cfg = rec.get("config")
    if not isinstance(cfg, dict) or not all(isinstance(v, (int, float, str)) and not isinstance(v, bool)
                                            for v in cfg.values()):
        raise ValueError("field 'config' is not a mapping of scalars")
    if not isinstance(rec.get("ok"), bool):
        raise ValueError("field 'ok' is not a bool")
    v = rec.get("kernel_version")
    if v is None:  # a legacy record: migrated once, here
        rec["kernel_version"] = legacy_kernel_version(rec)
    elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError("field 'kernel_version' is not a positive integer")
    elif v > KERNEL_VERSION:  # timed with kernels this ckgen does not have: says nothing of its own
        raise ValueError(f"kernel_version {v} is newer than this ckgen's kernels ({KERNEL_VERSION})")
    if rec["ok"]:
        t = rec.get("time_us")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError("field 'time_us' is not a positive number")
    return rec


def read(path: Path | str) -> list[dict[str, Any]]:
    """The records of a file (.jsonl, or .jsonl.gz); missing file: none. Malformed lines are
    skipped with one RecordsWarning for the file."""
    path = Path(path)
    try:
        raw = files.read_regular(path, MAX_RECORDS_BYTES)
        if path.suffix == ".gz":
            raw = _gunzip(path, raw)
    except FileNotFoundError:
        return []
    except (OSError, EOFError, zlib.error) as e:  # a FIFO, a device, too large, not gzip
        warnings.warn(f"ckgen records {path}: not readable ({e}); not used", RecordsWarning, stacklevel=2)
        return []
    out, bad, first = [], 0, ""
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(_checked(json.loads(line)))
        except (ValueError, TypeError, KeyError, ArithmeticError) as e:
            bad += 1
            first = first or f"line {n}: {str(e)[:200]}"
        except RecursionError:  # nested deeper than the parser can recurse: a malformed line like any other
            bad += 1
            first = first or f"line {n}: nested too deeply to parse"
    if bad:
        warnings.warn(f"ckgen records {path}: skipped {bad} malformed line(s) (first: {first})",
                      RecordsWarning, stacklevel=2)
    return out


def _gunzip(path: Path, raw: bytes) -> bytes:
    """`raw` gunzipped, at most MAX_RECORDS_BYTES of it (a small file can unpack to any size)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = d.decompress(raw, MAX_RECORDS_BYTES)
    if d.unconsumed_tail:
        raise files.UnusableFile(f"{path} unpacks to over the {MAX_RECORDS_BYTES:,} bytes read at most")
    if not d.eof:
        raise EOFError("the gzip stream is cut short")
    return out


def append(path: Path | str, records: Iterable[dict[str, Any]]) -> None:
    """Append records to a .jsonl file under its lock (concurrent tuners lose no line). The
    appended lines always start a line of their own (`_mend_tail`). Only a regular file is
    appended to (OSError otherwise): opening a FIFO for writing would wait for a reader."""
    lines = "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in records)
    if not lines:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    with filelock.FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT_S):
        fd = os.open(path, flags, 0o666)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", str(path))
            _mend_tail(fd)
            data = memoryview(lines.encode("utf-8"))
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)


def _mend_tail(fd: int) -> None:
    """Make the file open at `fd` end with a newline (call under the lock). An append cut short
    (a full disk, a kill) leaves a partial last line, and the next append would be glued to it:
    both lines then fail to parse. A tail that is a whole record (cut just before its newline)
    gets its newline; any other tail is cut back to the last newline."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    start, step = size, 1 << 16
    while start > 0:  # back to the byte after the last newline (the tail is one line: a few hundred bytes)
        lo = max(0, start - step)
        nl = os.pread(fd, start - lo, lo).rfind(b"\n")
        if nl >= 0:
            start = lo + nl + 1
            break
        start = lo
    try:
        _checked(json.loads(os.pread(fd, size - start, start)))
    except (ValueError, TypeError, KeyError, ArithmeticError, RecursionError):
        os.ftruncate(fd, start)
        return
    os.write(fd, b"\n")


def write_gz(path: Path | str, records: Iterable[dict[str, Any]]) -> None:
    """Write records as gzipped JSON Lines, byte-for-byte deterministic (no name or time in the
    gzip header)."""
    text = "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in records)
    Path(path).write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))


_read_cache: dict[str, tuple[tuple[int, int], list[dict[str, Any]]]] = {}


def read_cached(path: Path | str) -> list[dict[str, Any]]:
    """`read(path)`, parsed once per version of the file (its mtime and size): the shipped records
    take about 2 s to parse, and a tuning run asks for them once per problem (its seeds). The list
    and its records are shared: do not change them."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return []
    version = (st.st_mtime_ns, st.st_size)
    got = _read_cache.get(str(path))
    if got is None or got[0] != version:
        got = _read_cache[str(path)] = (version, read(path))
    return got[1]


def all_records(include_user: bool = True) -> list[dict[str, Any]]:
    """The shipped records, then the user's (what `python -m ckgen.model fit` trains on and
    what the tuner's neighbour seeds come from); a new list of shared records (`read_cached`)."""
    out = list(read_cached(packaged_records_path()))
    if include_user:
        out += read_cached(user_records_path())
    return out


class Recorder:
    """What `tune.tune_problem` hands the search: appends a record per measured config."""

    def __init__(self, op: OpSpec, problem: Problem, target: Target, device: str, path: Path | None = None):
        self.op, self.problem, self.target, self.device = op, problem, target, device
        self.path = path or user_records_path()
        self.failed: str | None = None  # why the records file could not be written, if so

    def __call__(self, config: Config, time_us: float | None, reason: str = "", phase: str = "trial") -> None:
        rec = make_record(self.op, self.problem, self.target, self.device, config, ok=time_us is not None,
                          time_us=time_us, reason=reason, phase=phase)
        try:
            append(self.path, [rec])
        except (OSError, filelock.Timeout) as e:  # records are a by-product: never fail a tuning run
            if self.failed is None:
                self.failed = str(e)
                warnings.warn(f"ckgen records {self.path}: not written ({e}); tuning goes on",
                              RecordsWarning, stacklevel=2)


def by_problem(records: Iterable[dict[str, Any]]) -> Iterator[tuple[tuple[str, str, str], list[dict[str, Any]]]]:
    """Records grouped by (op, arch, problem), in first-seen order."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["op"], r["arch"], r["problem"]), []).append(r)
    yield from groups.items()
