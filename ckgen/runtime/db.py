"""The YAML instance database: tuned winners per (op, arch, problem).

Contract (see docs/architecture.md, "Instance database"):
  - The file is YAML read with the safe loader only (libyaml's C loader when PyYAML has it, else
    the pure-Python one) and written with the safe dumper (sorted keys, block style, non-ASCII
    escaped, no line folding: both dumpers write the same bytes, and every string reads back
    exactly); entries are sorted by (op, arch, problem) so diffs are stable. Before loading, the
    document's event stream is checked: nesting deeper than MAX_DEPTH or aliases expanding beyond MAX_NODES nodes make the
    file corrupt (the loaders would recurse without bound or a renderer would expand the bomb).
  - A file that cannot be read as a DB at all (bad YAML, wrong top level, other schema, hostile
    structure) raises DBCorruptError, with a bounded message, and is never overwritten. One
    malformed entry (a bad field, an unknown op, a problem key its op cannot parse) is skipped
    with one warning; the rest of the file stays usable.
  - One entry per (op, arch, problem); where two meet, the merge rule keeps one: a verified
    entry (renders to its source_sha256), then the faster, then the later real date (dates as
    aware datetimes; a missing, unreadable or future one ranks last). A save reports every new
    entry it did not keep.
  - Writes merge with what is on disk under a file lock and replace the file atomically
    (temp file + fsync + os.replace), keeping the file's mode, so concurrent tuners on one file
    lose nothing. A save that cannot get the lock within LOCK_TIMEOUT_S, or that finds the file
    corrupt, keeps its entries in a side file `<name>.pending-<pid>-<hex>.yaml` beside the DB:
    every load merges side files, and the next save folds them into the file and removes them.
    Temp files of crashed saves are removed by the next save.
  - `load_layered` (the dispatcher's view) degrades: a corrupt user DB is warned about once and
    the shipped DB (and the user DB's side files) stay in use.
  - Only regular files are read, at most MAX_FILE_BYTES of them (64 MiB, some 90,000 entries):
    a FIFO, a device (/dev/zero) or a larger file is unusable (DBCorruptError), not a read that
    blocks forever or without bound. A DB path that is a symlink is read, written and locked
    as its target (the link stays a link); a save to something that is not a regular file, or
    into a folder where no file can be created, is refused up front (DBPathError).
  - What a file of at least PARSED_MIN_BYTES holds, as read and checked, is kept in a parse
    cache (`<cache dir>/db-parsed/`, JSON) keyed by the sha256 of the file's bytes and of ckgen's
    sources: a later load of the same bytes by the same ckgen takes it from there (~10 ms for the
    packaged DB instead of ~0.5 s). A changed or corrupt file never matches a cache file; a cache
    file that is unreadable or fails its structural check is ignored. The YAML stays the source.
    Writers keep what they wrote there (the next process reads a file just saved in
    milliseconds), and re-use the text of the entries a file in ckgen's form holds, dumping only
    the new ones (a save of one entry into a 20,000-entry file costs ~0.5 s, not ~10 s).
  - `merge_into` (`ckgen db merge -o`) merges into the destination as a save does: under its
    lock, re-reading it, so what others save meanwhile is kept, and so are its malformed items.

Nothing here imports CuPy.
"""
from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import importlib.resources
import itertools
import json
import math
import os
import re
import reprlib
import secrets
import stat
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Mapping

import filelock
import yaml

from .. import parsecache

SCHEMA_VERSION = 1
LOCK_TIMEOUT_S = 60.0
MAX_DEPTH = 32  # a DB nests 4 levels (top, entries, entry, config); the loaders recurse per level
MAX_NODES = 10_000_000  # YAML nodes with every alias expanded (an alias bomb has billions)
MAX_MESSAGE = 500  # characters of a reason or corruption message: never a whole value
# Bytes of a DB file read at most: an entry takes about 750 bytes (the packaged DB: 1,314 in
# 0.98 MB), so this holds some 90,000 entries, and a file beyond it (or /dev/zero) is not read.
MAX_FILE_BYTES = 64 * 2**20
STALE_SIDE_TEMP_S = 600.0  # a side file's temp older than this is a crashed writer's
_NO_FOLDING = 2**30  # the dumpers' line width: no line is folded

# libyaml's C loader and dumper are several times faster than the pure-Python ones.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

Ident = tuple[str, str, str]  # (op, arch, problem)
_SCALARS = (str, int, float, bool, type(None))
_UNTOUCHED = "the file was left untouched; fix it or move it aside"
_HEADER = (
    f"# ckgen instance database (schema {SCHEMA_VERSION}); written by ckgen, "
    "entries sorted by (op, arch, problem).\n"
)
CSV_COLUMNS = (
    "op", "arch", "device", "problem", "instance", "time_us", "gbps", "default_time_us", "config",
)


class DBError(ValueError):
    """A DB entry or value is malformed; the message says which field and why."""


class DBCorruptError(DBError):
    """The DB file as a whole cannot be used; `path` names it. Nothing was written to it.
    `kept`: the side file a save put its new entries in instead (None if none)."""

    def __init__(self, path: Path | str, what: str, kept: Path | None = None) -> None:
        self.path = Path(path)
        self.what = _bounded(what)
        self.kept = kept
        extra = (f"; the new entries were kept in {kept.name} beside it, merged by every load and "
                 "folded in once the file is fixed or moved aside") if kept else ""
        super().__init__(f"instance DB {self.path}: {self.what}; {_UNTOUCHED}{extra}")


class DBPathError(DBError):
    """A DB path that cannot be written: not a regular file (a folder, a device, a FIFO), or in
    a folder where no file can be created. Nothing was written."""

    def __init__(self, path: Path | str, what: str) -> None:
        self.path = Path(path)
        super().__init__(f"instance DB {self.path}: {_bounded(what)}; nothing was written")


class DBWarning(UserWarning):
    """Entries of a DB were skipped or dropped; the rest of the DB is in use."""


# ----------------------------------------------------------------------------- values


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def _short(value: Any) -> str:
    """A bounded repr: a huge, deep, self-referencing or alias-bomb value renders in a few
    characters (the full repr of a 675-byte alias bomb needs gigabytes)."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails still gets a name
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 100 else text[:97] + "..."


def _bounded(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE - 3] + "..."


def _plain(value: Any) -> Any:
    """YAML may hand back dates for unquoted timestamps: keep them as ISO strings."""
    if isinstance(value, (_dt.datetime, _dt.date)):
        return value.isoformat()
    return value


def _pairs(name: str, value: Any, allowed: tuple[type, ...]) -> tuple[tuple[str, Any], ...]:
    """A mapping (or pairs) of str -> scalar as sorted pairs; DBError saying what is wrong."""
    if isinstance(value, tuple):
        try:
            value = dict(value)
        except (TypeError, ValueError) as e:
            raise DBError(f"field {name!r}: not (name, value) pairs ({_bounded(str(e))})") from None
    if not isinstance(value, Mapping):
        raise DBError(f"field {name!r}: expected a mapping, got {type(value).__name__}")
    out: dict[str, Any] = {}
    for k, v in value.items():
        v = _plain(v)
        if not isinstance(k, str):
            raise DBError(f"field {name!r}: key {_short(k)} is not a string")
        if not isinstance(v, allowed):
            raise DBError(f"field {name!r}: value of {_short(k)} is a {type(v).__name__}")
        out[k] = v
    return tuple(sorted(out.items()))


def _number(name: str, value: Any) -> float:
    """A finite real number as float (YAML ints accepted, bools not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DBError(f"field {name!r}: expected a number, got {type(value).__name__}")
    try:
        f = float(value)
    except OverflowError:  # an int beyond the float range
        f = math.inf
    if not math.isfinite(f):
        raise DBError(f"field {name!r}: {_short(value)} is not finite")
    return f


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise DBError(f"field {name!r}: expected a non-empty string, got {_short(value)}")
    return value


@dataclass(frozen=True)
class Entry:
    """One tuned winner. `config` and `provenance` may be given as mappings; they are stored
    as sorted (name, value) pairs so entries are hashable and compare by value."""

    op: str
    vendor: str
    arch: str
    device: str
    problem: str
    config: tuple[tuple[str, Any], ...]
    instance: str
    source_sha256: str
    time_us: float
    gbps: float
    default_time_us: float
    provenance: tuple[tuple[str, Any], ...] = ()
    # The winner's run-to-run spread in the final re-timing, (max - min) / median of its
    # per-round medians; None in entries from before it was recorded.
    spread: float | None = None

    def __post_init__(self) -> None:
        for name in ("op", "vendor", "arch", "device", "problem", "instance", "source_sha256"):
            _text(name, getattr(self, name))
        object.__setattr__(self, "problem", _problem_key(self.op, self.problem))
        for name in ("time_us", "gbps", "default_time_us"):
            object.__setattr__(self, name, _number(name, getattr(self, name)))
        if self.spread is not None:
            object.__setattr__(self, "spread", _number("spread", self.spread))
        object.__setattr__(self, "config", _pairs("config", self.config, (str, int, float)))
        object.__setattr__(self, "provenance", _pairs("provenance", self.provenance, _SCALARS))

    @property
    def ident(self) -> Ident:
        """The DB key: one entry per (op, arch, problem)."""
        return (self.op, self.arch, self.problem)

    @property
    def date(self) -> str | None:
        value = self.provenance_dict().get("date")
        return value if isinstance(value, str) else None

    def config_dict(self) -> dict[str, Any]:
        return dict(self.config)

    def provenance_dict(self) -> dict[str, Any]:
        return dict(self.provenance)

    def to_dict(self) -> dict[str, Any]:
        """The nested YAML form (target: {vendor, arch, device})."""
        out = {
            "op": self.op,
            "target": {"vendor": self.vendor, "arch": self.arch, "device": self.device},
            "problem": self.problem,
            "config": self.config_dict(),
            "instance": self.instance,
            "source_sha256": self.source_sha256,
            "time_us": self.time_us,
            "gbps": self.gbps,
            "default_time_us": self.default_time_us,
            "provenance": self.provenance_dict(),
        }
        if self.spread is not None:
            out["spread"] = self.spread
        return out

    @classmethod
    def from_dict(cls, d: Any) -> "Entry":
        """Inverse of `to_dict`; DBError naming the missing or mistyped field."""
        if not isinstance(d, Mapping):
            raise DBError(f"entry is a {type(d).__name__}, not a mapping")
        target = _field(d, "target")
        if not isinstance(target, Mapping):
            raise DBError(f"field 'target': expected a mapping, got {type(target).__name__}")
        return cls(
            op=_field(d, "op"),
            vendor=_field(target, "vendor", "target."),
            arch=_field(target, "arch", "target."),
            device=_field(target, "device", "target."),
            problem=_field(d, "problem"),
            config=_field(d, "config"),
            instance=_field(d, "instance"),
            source_sha256=_field(d, "source_sha256"),
            time_us=_field(d, "time_us"),
            gbps=_field(d, "gbps"),
            default_time_us=_field(d, "default_time_us"),
            provenance=d.get("provenance") or {},
            spread=d.get("spread"),
        )


def _problem_key(op: str, key: str) -> str:
    """`key` parsed by its op (and written back in its canonical form); DBError for an unknown
    op or a key the op cannot parse. So every entry's problem parses: the dispatcher's nearest
    fallback, the library and retune parse every key of an op and arch."""
    from ..ops import get_op  # lazily: the op registry imports the templates' spaces

    try:
        spec = get_op(op)
    except ValueError:
        raise DBError(f"field 'op': unknown op {_short(op)}") from None
    try:
        return spec.problem_from_key(key).key()
    except (ValueError, TypeError, KeyError, ArithmeticError) as e:
        raise DBError(f"field 'problem': {_bounded(str(e))}") from None


def _field(d: Mapping[str, Any], name: str, prefix: str = "") -> Any:
    if name not in d:
        raise DBError(f"missing field {prefix + name!r}")
    return d[name]


def _iso_key(date: str) -> _dt.datetime | None:
    """An ISO date as an aware datetime (one without a zone is UTC); None if it does not parse."""
    try:
        parsed = _dt.datetime.fromisoformat(date)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=_dt.timezone.utc)


def _stamp(e: Entry, now: float) -> float:
    """The entry's date as a POSIX time for ranking: -inf when it has none, does not parse, or
    lies after `now`. Dates come from other machines' clocks and from hand edits: a future or
    unreadable one must never outrank a real one (it would keep its entry for ever)."""
    when = _iso_key(e.date) if e.date else None
    if when is None:
        return -math.inf
    try:
        stamp = when.timestamp()
    except (OverflowError, OSError, ValueError):  # a date at the edge of the range, in a far zone
        return -math.inf
    return stamp if stamp <= now else -math.inf


def _rank(e: Entry, verified: bool, now: float) -> tuple[bool, float, float]:
    """The merge rule, shared by saves and `merge_faster` (lower ranks first): an entry that holds
    for today's templates, then the faster measurement, then the later real date."""
    return (not verified, e.time_us, -_stamp(e, now))


@dataclass(frozen=True)
class Dropped:
    """A new entry a save did not keep: `kept`, already there, ranks before it (`_rank`)."""

    new: Entry
    kept: Entry

    def why(self) -> str:
        if self.kept.time_us < self.new.time_us:
            return f"the stored entry is faster ({self.kept.time_us:g} us < {self.new.time_us:g} us)"
        return "the stored entry holds for today's templates and the new one does not"


def _merge(old: Iterable[Entry], new: Iterable[Entry],
           verified: Callable[[Entry], bool] | None = None) -> tuple[list[Entry], list[Dropped]]:
    """Entries of `old` then `new`, one per ident: where two meet, the one of lower `_rank`
    (a tie: the later one, so a save replaces an equal entry). Only entries that meet are
    verified (a render each). Returns the entries kept and the entries of `new` that were not."""
    check = verified or entry_verified
    now = _dt.datetime.now(_dt.timezone.utc).timestamp()
    merged: dict[Ident, Entry] = {}
    ranks: dict[Entry, tuple[bool, float, float]] = {}

    def rank(e: Entry) -> tuple[bool, float, float]:
        r = ranks.get(e)
        if r is None:
            r = ranks[e] = _rank(e, check(e), now)
        return r

    new = list(new)
    fresh = {id(e) for e in new}  # by identity: hashing an entry hashes all its fields
    dropped: dict[Ident, Dropped] = {}
    for e in (*old, *new):
        prev = merged.get(e.ident)
        if prev is None or prev == e or rank(e) <= rank(prev):
            merged[e.ident] = e
            dropped.pop(e.ident, None)
        elif id(e) in fresh:
            dropped[e.ident] = Dropped(e, prev)
    return list(merged.values()), list(dropped.values())


def _sort_key(e: Entry) -> tuple[str, ...]:
    return (*e.ident, e.vendor, e.device)


# ----------------------------------------------------------------------------- the DB


@dataclass(frozen=True)
class InstanceDB:
    """An immutable view of entries, one per ident, sorted by (op, arch, problem).

    Built from a sequence with duplicates, the first entry of an ident wins.
    """

    entries: tuple[Entry, ...] = ()
    path: Path | None = None
    skipped: tuple[str, ...] = ()
    _index: dict[Ident, Entry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[Ident, Entry] = {}
        for e in self.entries:
            index.setdefault(e.ident, e)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "entries", tuple(sorted(index.values(), key=_sort_key)))
        object.__setattr__(self, "skipped", tuple(self.skipped))
        if self.path is not None:
            object.__setattr__(self, "path", Path(self.path))

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    @classmethod
    def load(cls, path: Path | str) -> "InstanceDB":
        """Read a DB file. Missing file: empty DB. Unusable file: DBCorruptError. Malformed
        entries are skipped (reasons in `skipped`) with one DBWarning for the whole load."""
        path = _real(path)  # a link's side files are beside its target, where saves put them
        pending = _read_pending(path)  # first: a side file folded meanwhile is in the file read next
        return _load(path, _read(path), pending)

    def lookup(self, op: str, arch: str, problem: str) -> Entry | None:
        """The entry for exactly this (op, arch, problem), or None."""
        return self._index.get((op, arch, problem))

    def select(self, op: str | None = None, arch: str | None = None) -> list[Entry]:
        """Entries of this op and/or arch (None: any), in DB order."""
        return [e for e in self.entries
                if (op is None or e.op == op) and (arch is None or e.arch == arch)]

    def filter(self, keep: Callable[[Entry], str | None]) -> "InstanceDB":
        """A DB of the entries for which `keep` returns None; the others are dropped with
        one DBWarning (count and first reason) for the whole call."""
        kept: list[Entry] = []
        dropped: list[str] = []
        for e in self.entries:
            reason = keep(e)
            if reason is None:
                kept.append(e)
            else:
                dropped.append(f"{_name(e)}: {reason}")
        if dropped:
            where = f" {self.path}" if self.path else ""
            _warn(f"instance DB{where}: ignoring {_count(len(dropped))} "
                  f"(first: {dropped[0]}); re-tune to refresh them")
        return InstanceDB(tuple(kept), self.path, self.skipped)

    @staticmethod
    def layered(*dbs: "InstanceDB") -> "InstanceDB":
        """One view over several DBs; on the same ident the earlier DB wins (user first)."""
        entries = tuple(e for db in dbs for e in db.entries)
        skipped = tuple(s for db in dbs for s in db.skipped)
        return InstanceDB(entries, None, skipped)


def _load(path: Path, contents: _Contents, pending: list[tuple[Path, _Contents]] = (), *,
          warn: bool = True) -> InstanceDB:
    """The DB of a file's contents and its side files' (merged by the merge rule), with one
    DBWarning for all malformed entries (unless not `warn`: the caller said it already)."""
    skipped = list(contents.skipped)
    entries = list(contents.entries)
    for side, c in pending:
        skipped += [f"{side.name} {s}" for s in c.skipped]
        entries += c.entries
    if skipped and warn:
        _warn(f"instance DB {path}: skipped {_count(len(skipped))} malformed "
              f"(first: {skipped[0]}); the other entries are in use")
    return InstanceDB(tuple(_merge((), entries)[0]), path, tuple(skipped))


def _name(e: Entry) -> str:
    return f"{e.op} {e.arch} {e.problem}"


def _count(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def _warn(message: str) -> None:
    warnings.warn(_bounded(message), DBWarning, stacklevel=3)


@dataclass(frozen=True)
class _Contents:
    entries: list[Entry]
    skipped: list[str]  # one reason per malformed item
    malformed: list[Any]  # those items as read, written back verbatim by a save


def _read(path: Path, keep: bool = True) -> _Contents:
    """The entries of the file at `path` and its malformed items; DBCorruptError if the
    file as a whole is unusable. A missing or empty file has no entries. What a large file
    holds comes from the parse cache when it has the file's bytes, else it is parsed (and kept
    there unless not `keep`: a writer's read, of a file it replaces)."""
    return _read_raw(path, keep)[1]


def _read_raw(path: Path, keep: bool = True) -> tuple[bytes, _Contents]:
    """`_read`, and the bytes it read (b"" for a missing file): a writer re-uses their text."""
    try:
        raw = _read_bounded(path)
    except FileNotFoundError:
        return b"", _Contents([], [], [])
    except OSError as e:  # unreadable (permissions, a broken link, ...)
        raise DBCorruptError(path, f"cannot be read ({e.strerror or e.__class__.__name__})") from None
    cached = _parsed_get(raw)
    if cached is not None:
        return raw, cached
    try:
        contents = _interpret(path, _parse(path, raw))
    except (RecursionError, MemoryError) as e:  # defence in depth: _parse bounds both
        raise DBCorruptError(path, f"too deeply nested or too large to read ({type(e).__name__})") from None
    if keep:
        _parsed_put(raw, contents)
    return raw, contents


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, for a message."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def _read_bounded(path: Path) -> bytes:
    """The bytes of the regular file at `path` (FileNotFoundError if there is none); a file of
    another kind or over MAX_FILE_BYTES is DBCorruptError. Opened without blocking and checked
    on the open descriptor: opening a FIFO for reading waits for a writer, reading a device may
    never end, and the kind checked by name could change before the open."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _kind(st.st_mode)
            raise DBCorruptError(path, f"is {kind}, not a DB file" if kind == "a directory"
                                 else f"is {kind}, not a regular file; ckgen reads DBs only from regular files")
        if st.st_size > MAX_FILE_BYTES:
            raise DBCorruptError(path, f"is {st.st_size:,} bytes, over the {MAX_FILE_BYTES:,} a DB file may have")
        chunks, size = [], 0
        while size <= MAX_FILE_BYTES:  # a file growing while read stops at the bound too
            chunk = os.read(fd, min(1 << 20, MAX_FILE_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_FILE_BYTES:
            raise DBCorruptError(path, f"is over the {MAX_FILE_BYTES:,} bytes a DB file may have")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _parse(path: Path, raw: bytes) -> Any:
    """The YAML document of `raw`, after its event stream passed `_check_structure`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DBCorruptError(path, f"not UTF-8 text ({e})") from None
    try:
        _check_structure(path, text)
        return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader (C or Python)
    except DBCorruptError:
        raise
    except yaml.YAMLError as e:
        raise DBCorruptError(path, f"not valid YAML ({_yaml_where(e)})") from None
    except ValueError as e:  # e.g. an int of more digits than Python converts
        raise DBCorruptError(path, f"a value cannot be read ({_bounded(str(e))})") from None


def _check_structure(path: Path, text: str) -> None:
    """Walk the YAML events (iterative, no recursion, no values built): DBCorruptError if the
    nesting is deeper than MAX_DEPTH or aliases expand to more than MAX_NODES nodes. The
    loaders recurse once per level (the C one overflows the C stack at ~100,000 levels, the
    Python one raises RecursionError) and an alias bomb is small on disk but astronomic
    expanded."""
    stack: list[list[Any]] = [[None, 0]]  # per open collection: [anchor, nodes expanded so far]
    sizes: dict[str, int] = {}  # anchor -> nodes of its value, expanded
    total = 0
    starts = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
    ends = (yaml.MappingEndEvent, yaml.SequenceEndEvent)
    for ev in yaml.parse(text, Loader=_LOADER):
        kind = type(ev)
        if kind is yaml.ScalarEvent:
            if ev.anchor is not None:
                sizes[ev.anchor] = 1
            stack[-1][1] += 1
            total += 1
        elif kind in starts:
            if len(stack) > MAX_DEPTH:
                raise DBCorruptError(path, f"nested deeper than {MAX_DEPTH} levels (line {ev.start_mark.line + 1}); "
                                           "a ckgen DB nests 4")
            stack.append([ev.anchor, 1])
            total += 1
        elif kind in ends:
            anchor, n = stack.pop()
            if anchor is not None:
                sizes[anchor] = n
            stack[-1][1] += n
        elif kind is yaml.AliasEvent:
            n = sizes.get(ev.anchor, 1)
            stack[-1][1] += n
            total += n
            if total > MAX_NODES:
                raise DBCorruptError(path, f"aliases expand it beyond {MAX_NODES:,} nodes (an alias bomb?)")
    if total > MAX_NODES:
        raise DBCorruptError(path, f"it has over {MAX_NODES:,} nodes")


def _interpret(path: Path, doc: Any) -> _Contents:
    if doc is None:
        return _Contents([], [], [])
    if not isinstance(doc, dict):
        raise DBCorruptError(path, f"the top level is a {type(doc).__name__}, not a mapping "
                                   "with 'schema' and 'entries'")
    schema = doc.get("schema")
    if schema != SCHEMA_VERSION or isinstance(schema, bool):
        raise DBCorruptError(path, f"schema version {_short(schema)}, this ckgen reads schema "
                                   f"{SCHEMA_VERSION}")
    items = doc.get("entries") or []
    if not isinstance(items, list):
        raise DBCorruptError(path, f"'entries' is a {type(items).__name__}, not a list")
    out = _Contents([], [], [])
    for i, item in enumerate(items):
        try:
            out.entries.append(Entry.from_dict(item))
        except DBError as e:
            out.skipped.append(f"entries[{i}]: {e}")
            out.malformed.append(item)
    return out


def _yaml_where(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = _bounded(str(getattr(e, "problem", None) or e))
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


# ----------------------------------------------------------------------------- the parse cache
#
# Reading the packaged DB (~1 MB, ~1,300 entries) costs about half a second of CPU: libyaml
# parses it, but PyYAML's constructor and the entries' checks (every problem key parsed by its
# op) are Python. So `_read` keeps what it read from a file of at least PARSED_MIN_BYTES (its
# entries, as checked, the reasons of its malformed items and those items) in the parse cache
# (ckgen/parsecache.py: keyed by the file's bytes and ckgen's sources, PyYAML's version and the
# loader), read back in ~10 ms. A corrupt file has no cache file (nothing is kept from a read
# that failed), and a changed one has another key. Kept only when every value survives JSON as
# it is; a cache file that fails the structural check (`_parsed_contents`) is ignored (and
# replaced by the read that parses). Nothing of the cache is ever a reason to refuse a file.
#
# The entries are kept by column (`_entry_columns`): one list per field, and a config or
# provenance as the index of its key list (in a table of the distinct ones) and a list of its
# values. So the JSON holds few objects, and each check runs over a whole column.

PARSED_FORMAT = "ckgen-db-parsed"
PARSED_VERSION = 2
PARSED_MIN_BYTES = 64 * 1024  # smaller files (under ~90 entries) parse in under ~30 ms
_TEXT_FIELDS = ("op", "vendor", "arch", "device", "problem", "instance", "source_sha256")
_NUMBER_FIELDS = ("time_us", "gbps", "default_time_us")  # finite floats; then spread: one or None
_ENTRY_NAMES = (*_TEXT_FIELDS, *_NUMBER_FIELDS, "spread", "config", "provenance")


def _parsed_dir() -> Path:
    return parsecache.folder("db")


def _parsed_key(raw: bytes) -> str | None:
    """The cache key of a file's bytes as this ckgen reads them; None: no cache."""
    return parsecache.key("db", raw, PARSED_FORMAT, str(PARSED_VERSION), yaml.__version__,
                          f"{_LOADER.__module__}.{_LOADER.__qualname__}")


def _pairs_columns(pairs: list[tuple[tuple[str, Any], ...]]) -> list[Any]:
    """Configs or provenances as [key lists, each one's key list index, each one's values]."""
    tables: dict[tuple[str, ...], int] = {}
    of, values = [], []
    for p in pairs:
        keys, vals = zip(*p) if p else ((), ())  # in C: ~2x faster than two comprehensions
        of.append(tables.setdefault(keys, len(tables)))
        values.append(list(vals))
    return [[list(k) for k in tables], of, values]


def _entry_columns(entries: list[Entry]) -> dict[str, Any]:
    return {"n": len(entries),
            "text": [[getattr(e, f) for e in entries] for f in _TEXT_FIELDS],
            "numbers": [[getattr(e, f) for e in entries] for f in (*_NUMBER_FIELDS, "spread")],
            "config": _pairs_columns([e.config for e in entries]),
            "provenance": _pairs_columns([e.provenance for e in entries])}


_CONFIG_TYPES = frozenset((str, int, float, bool))  # what `_pairs` lets into a config, as JSON has them
_PROVENANCE_TYPES = _CONFIG_TYPES | {type(None)}


def _column(value: Any, n: int, types: frozenset[type]) -> list[Any]:
    """A cached column: a list of n values of these types; ValueError if not."""
    if type(value) is not list or len(value) != n or not set(map(type, value)) <= types:
        raise ValueError("column")
    return value


def _finite(column: list[float]) -> list[float]:
    if not all(map(math.isfinite, column)):
        raise ValueError("number")
    return column


_STR, _FLOAT, _INT, _LIST = frozenset((str,)), frozenset((float,)), frozenset((int,)), frozenset((list,))


def _pairs_of_columns(value: Any, n: int, allowed: frozenset[type]) -> list[tuple[tuple[str, Any], ...]]:
    """Cached configs or provenances (`_pairs_columns`): each as `_pairs` leaves it, keys in
    strictly increasing order (JSON's keys are str), values of the allowed types; ValueError if not."""
    if type(value) is not list or len(value) != 3:
        raise ValueError("pairs")
    tables, of, values = value
    if type(tables) is not list:
        raise ValueError("pairs")
    keys = []
    for k in tables:
        _column(k, len(k) if type(k) is list else -1, _STR)
        if not all(a < b for a, b in zip(k, k[1:])):
            raise ValueError("pairs")
        keys.append(tuple(k))
    _column(of, n, _INT)
    _column(values, n, _LIST)
    if of and not 0 <= min(of) <= max(of) < len(keys):
        raise ValueError("pairs")
    sizes = [len(k) for k in keys]
    if list(map(len, values)) != [sizes[i] for i in of]:
        raise ValueError("pairs")
    if not set(map(type, itertools.chain.from_iterable(values))) <= allowed:
        raise ValueError("pairs")
    return [tuple(zip(keys[i], v)) for i, v in zip(of, values)]


def _entries_of_columns(doc: dict[str, Any]) -> list[Entry]:
    """Cached entries, checked for their structure (types, non-empty text, finite numbers);
    ValueError if not. Built without Entry's own checks (which parse the problem key): the key
    says that this ckgen checked the entries when it wrote the columns."""
    n, text, numbers = doc.get("n"), doc.get("text"), doc.get("numbers")
    if type(n) is not int or n < 0 or type(text) is not list or type(numbers) is not list:
        raise ValueError("columns")
    if len(text) != len(_TEXT_FIELDS) or len(numbers) != len(_NUMBER_FIELDS) + 1:
        raise ValueError("columns")
    columns = [_column(c, n, _STR) for c in text]
    if not all(map(all, columns)):  # no empty string
        raise ValueError("text")
    columns += [_finite(_column(c, n, _FLOAT)) for c in numbers[:-1]]
    spread = _column(numbers[-1], n, _FLOAT | {type(None)})
    _finite([x for x in spread if x is not None])
    columns += [spread, _pairs_of_columns(doc.get("config"), n, _CONFIG_TYPES),
                _pairs_of_columns(doc.get("provenance"), n, _PROVENANCE_TYPES)]
    new, out = object.__new__, []
    for row in zip(*columns):
        e = new(Entry)
        e.__dict__.update(zip(_ENTRY_NAMES, row))
        out.append(e)
    return out


def _parsed_contents(doc: Any, key: str) -> _Contents:
    """The cache file's contents, checked for their structure; ValueError if not."""
    if (type(doc) is not dict or doc.get("format") != PARSED_FORMAT or doc.get("version") != PARSED_VERSION
            or doc.get("key") != key):
        raise ValueError("header")
    entries, skipped, malformed = doc.get("entries"), doc.get("skipped"), doc.get("malformed")
    if (type(entries) is not dict or type(skipped) is not list or type(malformed) is not list
            or len(skipped) != len(malformed) or not all(type(s) is str for s in skipped)):
        raise ValueError("lists")
    return _Contents(_entries_of_columns(entries), skipped, malformed)


def _parsed_get(raw: bytes) -> _Contents | None:
    """What `_read` read from these bytes before, if a cache file holds it (else None)."""
    if len(raw) < PARSED_MIN_BYTES:
        return None
    try:
        key = _parsed_key(raw)
        data = parsecache.read("db", key) if key is not None else None
        return _parsed_contents(json.loads(data), key) if data is not None else None
    except Exception:  # noqa: BLE001 - not JSON, too deep, not ours: not used
        return None


def _json_exact(value: Any) -> bool:
    """Does `value` come back from JSON as it is: dicts with str keys, lists, str, int, float,
    bool and None only, no container twice (YAML aliases share one; JSON would copy it)."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        v = todo.pop()
        t = type(v)
        if t is dict:
            if id(v) in seen or not all(type(k) is str for k in v):
                return False
            seen.add(id(v))
            todo.extend(v.values())
        elif t is list:
            if id(v) in seen:
                return False
            seen.add(id(v))
            todo.extend(v)
        elif t not in (str, int, float, bool, type(None)):
            return False
    return True


def _parsed_put(raw: bytes, contents: _Contents) -> None:
    """Keep what `_read` read from `raw` in the cache (best effort: never an error)."""
    if len(raw) < PARSED_MIN_BYTES or not _json_exact(contents.malformed):
        return
    with contextlib.suppress(Exception):
        key = _parsed_key(raw)
        if key is None:
            return
        parsecache.write("db", key, json.dumps({"format": PARSED_FORMAT, "version": PARSED_VERSION, "key": key,
                                                "entries": _entry_columns(contents.entries),
                                                "skipped": contents.skipped, "malformed": contents.malformed},
                                               ensure_ascii=True, separators=(",", ":")))


def _side_files(path: Path) -> list[Path]:
    """The side files of the DB at `path` (`<name>.pending-<pid>-<hex>.yaml`), oldest name first."""
    prefix = f"{path.name}.pending-"
    try:
        names = os.listdir(path.parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [path.parent / n for n in sorted(names) if n.startswith(prefix) and n.endswith(".yaml")]


def _read_pending(path: Path) -> list[tuple[Path, _Contents]]:
    """Each side file's contents; a corrupt one is warned about, left alone and not used."""
    out = []
    for side in _side_files(path):
        try:
            out.append((side, _read(side, keep=False)))
        except DBCorruptError as e:
            _warn(f"{e} (a side file of {path.name}: not used)")
    return out


# ----------------------------------------------------------------------------- writing


def _real(path: Path | str) -> Path:
    """`path` with every symlink resolved: a DB reached through a link is its target's file, its
    lock and side files are beside the target, and two paths of one file share one lock."""
    return Path(os.path.realpath(path))


def folder_problem(folder: Path | str) -> str | None:
    """Why no file can be created in `folder` (None: one can): the nearest existing folder on
    its way must be a folder in which a file can be created. Tried with a probe file, as
    permissions do not say it for root or on a read-only mount; a save that cannot create its
    lock file would otherwise wait LOCK_TIMEOUT_S for a lock that nobody holds."""
    folder = Path(folder)
    existing = next((p for p in (folder, *folder.parents) if os.path.lexists(p)), None)
    if existing is None:
        return None
    if not existing.is_dir():
        return f"{existing} is not a directory"
    probe = existing / f".ckgen-probe-{secrets.token_hex(6)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as e:
        why = e.strerror or type(e).__name__
        return f"no file can be created in {existing} ({why})" if existing == folder else \
            f"{folder} cannot be created ({why} in {existing})"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def destination_problem(path: Path | str) -> str | None:
    """Why the DB file at `path` cannot be written (None: it can): what the path (or its link's
    target) names exists and is not a regular file, or its folder cannot take a new file."""
    real = _real(path)
    try:
        st = os.stat(real)
    except (FileNotFoundError, NotADirectoryError):  # a new file (its folder is checked next)
        st = None
    except OSError as e:  # a link loop, no permission to look
        return f"cannot be used ({e.strerror or type(e).__name__})"
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = _kind(st.st_mode)
        return (f"is {kind}; name the DB file" if kind == "a directory"
                else f"is {kind}, not a regular file; ckgen writes DBs only to regular files")
    why = folder_problem(real.parent)
    return f"cannot be written: {why}" if why else None


def _destination(path: Path | str) -> Path:
    """The file a write of the DB at `path` replaces (symlinks resolved), its folder created;
    DBPathError when it cannot be written (`destination_problem`)."""
    why = destination_problem(path)
    if why:
        raise DBPathError(path, why)
    real = _real(path)
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DBPathError(path, f"its folder cannot be created ({e.strerror or type(e).__name__})") from None
    return real


def _lock(path: Path) -> filelock.FileLock:
    return filelock.FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)


class _NoLock(Exception):
    """The DB's lock could not be taken; `why` says so in a phrase."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold the lock of the DB at `path`. Taking it fails with _NoLock, never with another error:
    a lock busy beyond LOCK_TIMEOUT_S, or a lock file that cannot be opened (another user's in a
    shared folder, a folder, a link, which filelock refuses to follow). What the held block
    raises passes unchanged."""
    lock = _lock(path)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise _NoLock(f"its lock was not free within {LOCK_TIMEOUT_S:g} s (other saves)") from None
    except OSError as e:
        raise _NoLock(f"its lock file {lock.lock_file} cannot be used "
                      f"({e.strerror or type(e).__name__})") from None
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def _locked_or_error(path: Path) -> Iterator[None]:
    """`_locked`, for writes that have nothing to keep in a side file (a removal, a rewrite): no
    lock is DBError, and nothing was written."""
    try:
        with _locked(path):
            yield
    except _NoLock as e:
        raise DBError(f"instance DB {path}: {e.why}; nothing was written") from None


def _dump_items(items: list[Any]) -> str:
    """A YAML list of `items` as `_dump` writes the entries list (PyYAML writes a list under a
    mapping key without indenting it, so its items' text is the same either way)."""
    return yaml.dump(items, Dumper=_DUMPER, sort_keys=True, default_flow_style=False, allow_unicode=False,
                     width=_NO_FOLDING)


def _split_items(text: str) -> list[str]:
    """The items of a block-style YAML list at column 0, each with its text. An item's own lines
    (its keys, a long quoted string's continuation) are indented, so "- " at the start of a line
    opens the next item."""
    starts = [0, *(m.start() + 1 for m in re.finditer("\n- ", text))]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]


def _entry_texts(raw: bytes, contents: _Contents) -> dict[Ident, tuple[Entry, str]] | None:
    """Each entry of a DB file's `contents`, by ident -> (it, its text in the file's bytes `raw`),
    when the file
    is as `_dump` writes it (the header, the entries, then the malformed items, then the schema);
    None for any other file (edited by hand, another ckgen's form), which is dumped whole."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    head, tail = _HEADER + "entries:\n", f"schema: {SCHEMA_VERSION}\n"
    if not (text.startswith(head + "- ") and text.endswith("\n" + tail)):
        return None
    items = _split_items(text[len(head):len(text) - len(tail)])
    n = len(contents.entries)
    if len(items) != n + len(contents.malformed) or \
            any(not why.startswith(f"entries[{n + j}]:") for j, why in enumerate(contents.skipped)):
        return None
    out: dict[Ident, tuple[Entry, str]] = {}
    for e, item in zip(contents.entries, items):
        # the item is this entry's (its key as the entry has it: a key written in another form is dumped anew)
        if not item.startswith("- ") or f"\n  problem: {e.problem}\n" not in item:
            return None
        out.setdefault(e.ident, (e, item))
    return out


def _dump_reusing(entries: list[Entry], malformed: list[Any], raw: bytes, contents: _Contents | None) -> str:
    """`_dump(entries, malformed)`, byte for byte, re-using the text of every entry that the file
    of bytes `raw` (whose contents are `contents`) holds already: PyYAML's representer costs
    ~0.5 ms per entry in Python, 10 s for a 20,000-entry DB, where a save adds one entry."""
    known = _entry_texts(raw, contents) if raw and contents is not None else None
    if not known or not entries:
        return _dump(entries, malformed)
    # By ident, then the entry itself: kept entries are the very objects read (an `is` test),
    # which spares hashing every entry's fields.
    texts: list[str | None] = []
    for e in entries:
        had = known.get(e.ident)
        texts.append(had[1] if had is not None and (had[0] is e or had[0] == e) else None)
    missing = [i for i, t in enumerate(texts) if t is None]
    if missing:
        dumped = _split_items(_dump_items([entries[i].to_dict() for i in missing]))
        if len(dumped) != len(missing):
            return _dump(entries, malformed)
        for i, t in zip(missing, dumped):
            texts[i] = t
    return "".join([_HEADER, "entries:\n", *texts,  # type: ignore[list-item] - every one filled
                    _dump_items(malformed) if malformed else "", f"schema: {SCHEMA_VERSION}\n"])


def _dump(entries: Iterable[Entry], malformed: Iterable[Any] = ()) -> str:
    """The file text: sorted entries, then malformed items as read (kept for a hand fix)."""
    body = {"schema": SCHEMA_VERSION, "entries": [*(e.to_dict() for e in entries), *malformed]}
    # Non-ASCII escaped and no line folding: the C and the pure-Python dumpers then write the
    # same bytes, and every string reads back exactly (with allow_unicode the Python emitter
    # writes a raw U+0085, which loaders read back as a space; the two fold long quoted
    # strings differently).
    return _HEADER + yaml.dump(body, Dumper=_DUMPER, sort_keys=True, default_flow_style=False,
                               allow_unicode=False, width=_NO_FOLDING)



def _write_file(dest: Path, text: str, prefix: str, mode_of: Path) -> None:
    """Write `text` to a temp file beside `dest` (mode: that of `mode_of` if it exists, else the
    umask's), fsync it, then os.replace it onto `dest`. On any error the temp file is removed
    and `dest` is unchanged."""
    fd, tmp = parsecache.new_temp(dest.parent, prefix)
    try:
        try:
            with contextlib.suppress(FileNotFoundError):
                mode = stat.S_IMODE(os.stat(mode_of).st_mode)
                if hasattr(os, "fchmod"):
                    os.fchmod(fd, mode)
                else:  # pragma: no cover - Windows before 3.13
                    os.chmod(tmp, mode)
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                fd = -1
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        finally:
            if fd >= 0:
                os.close(fd)
        os.replace(tmp, dest)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno is None:
            raise
        # named by the file being written, not the temp file (or nothing: a failed write or
        # fsync names no file), so a message can say which file could not be written
        raise OSError(e.errno, e.strerror, str(dest)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(dest.parent)


def _write_atomic(path: Path, text: str) -> None:
    """Replace the DB file at `path` with `text`, keeping its mode (call under the lock)."""
    _write_file(path, text, f".{path.name}.save-", path)


def _write_entries(path: Path, entries: tuple[Entry, ...], malformed: list[Any], raw: bytes,
                   contents: _Contents | None) -> Callable[[], None]:
    """Replace the DB file at `path` (call under the lock) with `entries` (sorted) and
    `malformed`, re-using the text of the entries of its old bytes `raw` (`_dump_reusing`).
    Returns what keeps the new file in the parse cache, to call once the lock is released: the
    next process then reads it in milliseconds, not seconds (a file with malformed items is
    left to the next read, which knows their reasons)."""
    text = _dump_reusing(list(entries), malformed, raw, contents)
    _write_atomic(path, text)
    if malformed:
        return lambda: None
    return lambda: _parsed_put(text.encode("utf-8"), _Contents(list(entries), [], []))


def _write_side(path: Path, entries: list[Entry]) -> Path:
    """Keep `entries` in a new side file of the DB at `path` (no lock needed: the name is
    unique and appears whole); returns it."""
    side = path.parent / f"{path.name}.pending-{os.getpid()}-{secrets.token_hex(6)}.yaml"
    _write_file(side, _dump(sorted(entries, key=_sort_key)), f".{path.name}.side-", path)
    return side


def _clean_temps(path: Path) -> None:
    """Remove the temp files crashed saves of the DB at `path` left (call under the lock: no
    save is writing one then). A side file's temp is written without the lock, so only an old
    one is removed."""
    prefix, now = f".{path.name}.", time.time()
    with contextlib.suppress(OSError):
        for n in os.listdir(path.parent):
            if not (n.startswith(prefix) and n.endswith(".tmp")):
                continue
            tmp = path.parent / n
            with contextlib.suppress(OSError):
                if n.startswith(f"{prefix}side-") and now - tmp.stat().st_mtime < STALE_SIDE_TEMP_S:
                    continue
                tmp.unlink()


def _fsync_dir(folder: Path) -> None:
    """Best effort: make the rename itself durable (not possible on every platform)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_listeners: list[Callable[[], None]] = []


def on_change(fn: Callable[[], None]) -> None:
    """Call `fn` after every write of a DB file by this process (the dispatcher forgets its
    cached choices and launch plans then)."""
    _listeners.append(fn)


def _changed() -> None:
    for fn in _listeners:
        fn()


def save_entries(path: Path | str, new: Iterable[Entry]) -> InstanceDB:
    """Merge `new` into the DB file at `path` under its lock and write it atomically.

    For one ident the merge rule (`_rank`, as `merge_faster` decides) picks: a verified entry
    beats an unverified one, then the faster, then the later real date (a missing, unreadable or
    future date ranks last); a full tie goes to the new entry. A new entry not kept is named in
    one DBWarning (a tuning result is never dropped in silence). Side files are folded in and removed; malformed items already in the file are
    written back verbatim after the entries (and warned about, as by `load`). Returns the
    merged DB. A save never loses its entries:
      - lock not free within LOCK_TIMEOUT_S (other savers), or a lock file that cannot be
        opened: the entries go to a side file, with a DBWarning naming the lock and why; the
        returned view is the file's plus its side files';
      - a corrupt file: it is not written; the entries go to a side file and DBCorruptError
        (its `kept` names the side file) is raised.
    """
    new = list(new)
    path = _destination(path)
    try:
        with _locked(path):
            _clean_temps(path)
            pending = _read_pending(path)
            try:
                raw, contents = _read_raw(path, keep=False)
            except DBCorruptError as e:
                side = _write_side(path, new) if new else None
                if side is not None:
                    _changed()  # the view (its side files) changed
                raise DBCorruptError(path, e.what, side) from None
            on_disk = _load(path, contents, pending)
            kept, dropped = _merge(on_disk.entries, new)
            merged = InstanceDB(tuple(kept), path, on_disk.skipped)
            malformed = contents.malformed + [m for _, c in pending for m in c.malformed]
            cache = _write_entries(path, merged.entries, malformed, raw, contents)
            for side, _ in pending:
                side.unlink(missing_ok=True)
        cache()
        _changed()
        if dropped:
            _warn_dropped(path, dropped)
        return merged
    except _NoLock as e:
        if not new:  # nothing to keep
            return InstanceDB.load(path)
        side = _write_side(path, new)
        _changed()
        _warn(f"instance DB {path}: {e.why}; the {_count(len(new))} were kept in {side.name}, merged by "
              "every load and folded into the file by the next save that gets the lock")
        try:
            return InstanceDB.load(path)
        except DBCorruptError as e:
            raise DBCorruptError(path, e.what, side) from None


def _warn_dropped(path: Path, dropped: list[Dropped]) -> None:
    """One DBWarning naming the new entries a save did not keep, and why: a result is never
    dropped in silence."""
    first = "; ".join(f"{_name(d.new)}: {d.why()}" for d in dropped[:3])
    more = f"; and {len(dropped) - 3} more" if len(dropped) > 3 else ""
    _warn(f"instance DB {path}: {_count(len(dropped))} not saved, the stored ones rank first by the merge "
          f"rule (verified, then faster): {first}{more}")


def remove_entries(path: Path | str, pred: Callable[[Entry], bool]) -> int:
    """Remove the entries for which `pred` is true (side files folded in first), under the
    lock, atomically. Returns how many were removed (the file is not rewritten when none and
    there are no side files)."""
    path = _real(path)
    if not path.exists() and not _side_files(path):
        return 0
    path = _destination(path)
    with _locked_or_error(path):
        _clean_temps(path)
        pending = _read_pending(path)
        raw, contents = _read_raw(path, keep=False)
        on_disk = _load(path, contents, pending)
        kept = tuple(e for e in on_disk.entries if not pred(e))
        removed = len(on_disk.entries) - len(kept)
        cache: Callable[[], None] = lambda: None  # noqa: E731
        if removed or pending:
            malformed = contents.malformed + [m for _, c in pending for m in c.malformed]
            cache = _write_entries(path, kept, malformed, raw, contents)
            for side, _ in pending:
                side.unlink(missing_ok=True)
    cache()
    if removed:
        _changed()
    return removed


def entry_verified(e: Entry) -> bool:
    """Does the entry hold for today's templates: its config validates for its problem on its
    arch, and renders to the source it was tuned with (`source_sha256`)?"""
    from ..instance import render_instance
    from ..ops import get_op
    from ..types import Config, Target

    try:
        op = get_op(e.op)
        return render_instance(op, op.problem_from_key(e.problem), Config.of(e.config_dict()),
                               Target.named(e.arch)).sha256 == e.source_sha256
    except Exception:  # noqa: BLE001 - whatever stops the render (a bad value, a plug-in's template): not verified; a save or load goes on
        return False


def merge_faster(*dbs: InstanceDB, verified: Callable[[Entry], bool] = entry_verified) -> InstanceDB:
    """One entry per (op, arch, problem) from several DBs, the same whatever their order: a
    verified entry (`entry_verified`) beats an unverified one, then the faster (`time_us`) wins,
    then the later real date (`_stamp`); a full tie goes to the entry whose YAML text sorts first."""
    best: dict[Ident, tuple[Any, Entry]] = {}
    now = _dt.datetime.now(_dt.timezone.utc).timestamp()
    for db in dbs:
        for e in db.entries:
            rank = (*_rank(e, verified(e), now), json.dumps(e.to_dict(), sort_keys=True))
            if e.ident not in best or rank < best[e.ident][0]:
                best[e.ident] = (rank, e)
    return InstanceDB(tuple(e for _, e in best.values()))


def merge_into(path: Path | str, *dbs: InstanceDB,
               verified: Callable[[Entry], bool] = entry_verified) -> tuple[InstanceDB, int, Path | None]:
    """`merge_faster` of the DB file at `path` (if it exists) and `dbs`, written to `path` as
    `save_entries` writes: under the file's lock, re-reading the file (and folding in its side
    files), so entries saved by others while the inputs were read and verified are merged, not
    replaced. Malformed items of the file are written back verbatim. Returns (the merged DB,
    how many entries the file held under the lock).

    Verifying costs a render per entry, so it is done before the lock is taken for `dbs` and
    the file as read then; under the lock only the entries saved since are verified. Raises
    DBPathError (nothing written) for a destination that cannot be written and DBCorruptError
    (untouched) for a corrupt one. When the lock cannot be had (busy beyond LOCK_TIMEOUT_S, or
    a lock file that cannot be opened), the merge of `dbs` goes to a side file of the
    destination, as a save's entries do, with one DBWarning; every load merges it by the same
    rule. Returns (the merged DB, how many entries the file held, the side file or None)."""
    known: dict[Entry, bool] = {}

    def check(e: Entry) -> bool:
        ok = known.get(e)
        if ok is None:
            ok = known[e] = verified(e)
        return ok

    path = _destination(path)
    try:  # the file as it is now (read again under the lock, which warns about it)
        before: tuple[Entry, ...] = _load(path, _read(path), warn=False).entries
    except DBError:
        before = ()
    for e in (*before, *(e for db in dbs for e in db.entries)):
        check(e)
    try:
        with _locked(path):
            _clean_temps(path)
            pending = _read_pending(path)
            raw, contents = _read_raw(path, keep=False)
            # warned about once: by its load as an input if it is one
            on_disk = _load(path, contents, pending, warn=not any(db.path == path for db in dbs))
            merged = merge_faster(on_disk, *dbs, verified=check)
            malformed = contents.malformed + [m for _, c in pending for m in c.malformed]
            cache = _write_entries(path, merged.entries, malformed, raw, contents)
            for side, _ in pending:
                side.unlink(missing_ok=True)
    except _NoLock as e:
        incoming = merge_faster(*dbs, verified=check).entries
        side = _write_side(path, list(incoming)) if incoming else None
        _changed()
        if side is not None:
            _warn(f"instance DB {path}: {e.why}; the merge of {_count(len(incoming))} was kept in "
                  f"{side.name}, merged by every load and folded into the file by the next save that gets the lock")
        return InstanceDB.load(path), len(before), side
    cache()
    _changed()
    return InstanceDB(merged.entries, path, on_disk.skipped), len(on_disk.entries), None


def write_db(path: Path | str, entries: Iterable[Entry]) -> None:
    """Write a DB file holding exactly `entries` (replacing what is there), under its lock, atomically."""
    path = _destination(path)
    with _locked_or_error(path):
        _clean_temps(path)
        cache = _write_entries(path, tuple(sorted(entries, key=_sort_key)), [], b"", None)
    cache()
    _changed()


def packaged_db_path() -> Path:
    """The DB file inside the package (winners measured on our GPUs)."""
    return Path(str(importlib.resources.files("ckgen") / "data" / "instances.yaml"))


def shipped_db_path() -> Path:
    """The shipped DB in use: $CKGEN_SHIPPED_DB if set, else the packaged one; may not exist."""
    from .. import settings

    return settings.shipped_db_override() or packaged_db_path()


def export_csv(db: InstanceDB, stream: IO[str], cell: Callable[[str], str] | None = None) -> None:
    """One header row (CSV_COLUMNS) and one row per entry; config as `k=v;k=v`. `cell`: applied
    to every text cell (the CLI escapes control characters for a terminal)."""
    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    text = cell or str
    for e in db.entries:
        config = ";".join(f"{k}={v}" for k, v in e.config)
        writer.writerow([text(e.op), text(e.arch), text(e.device), text(e.problem), text(e.instance),
                         repr(e.time_us), repr(e.gbps), repr(e.default_time_us), text(config)])


_warned_corrupt: set[tuple[str, int, int]] = set()


def load_layered(user_path: Path | str, *, strict: bool = False) -> InstanceDB:
    """The view every reader uses: the user DB at `user_path` over the shipped DB.

    strict (the CLI's `db show`/`export`/`retune`): a corrupt file raises DBCorruptError.
    Otherwise (the dispatcher): a corrupt file is left untouched and warned about once per
    file version; the other DB, and a corrupt user DB's side files, stay in use, so op calls
    keep working."""
    user_path = Path(user_path)
    layers = []
    for path in (user_path, shipped_db_path()):
        try:
            layers.append(InstanceDB.load(path))
        except DBCorruptError as e:
            if strict:
                raise
            _warn_corrupt_once(e)
            if path == user_path:
                layers.append(_load(path, _Contents([], [], []), _read_pending(path)))
    return InstanceDB.layered(*layers)


def _warn_corrupt_once(e: DBCorruptError) -> None:
    try:
        st = e.path.stat()
        version = (str(e.path), st.st_mtime_ns, st.st_size)
    except OSError:
        version = (str(e.path), 0, 0)
    if version not in _warned_corrupt:
        _warned_corrupt.add(version)
        _warn(f"{e}; it is not used: ckgen goes on with the other DB")
