"""The YAML instance database: tuned winners per (op, arch, problem).

Contract (see docs/architecture.md, "The instance database"):
  - The file is YAML read with `yaml.safe_load` only and written with `yaml.safe_dump`
    (sorted keys, block style); entries are sorted by (op, arch, problem) so diffs are stable.
  - A file that cannot be read as a DB at all (bad YAML, wrong top level, other schema) raises
    DBCorruptError and is never overwritten. One malformed entry is skipped with one warning;
    the rest of the file stays usable.
  - Writes merge with what is on disk under a file lock and replace the file atomically
    (temp file + fsync + os.replace), so concurrent tuners on one file lose nothing.

Nothing here imports CuPy.
"""
from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import importlib.resources
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Mapping

import filelock
import yaml

SCHEMA_VERSION = 1
LOCK_TIMEOUT_S = 60.0

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
    """The DB file as a whole cannot be used; `path` names it. Nothing was written to it."""

    def __init__(self, path: Path | str, what: str) -> None:
        self.path = Path(path)
        super().__init__(f"ckgen instance DB {self.path}: {what}; {_UNTOUCHED}")


class DBWarning(UserWarning):
    """Entries of a DB were skipped or dropped; the rest of the DB is in use."""


# ----------------------------------------------------------------------------- values


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
            raise DBError(f"field {name!r}: not (name, value) pairs ({e})") from None
    if not isinstance(value, Mapping):
        raise DBError(f"field {name!r}: expected a mapping, got {type(value).__name__}")
    out: dict[str, Any] = {}
    for k, v in value.items():
        v = _plain(v)
        if not isinstance(k, str):
            raise DBError(f"field {name!r}: key {k!r} is not a string")
        if not isinstance(v, allowed):
            raise DBError(f"field {name!r}: value of {k!r} is a {type(v).__name__}")
        out[k] = v
    return tuple(sorted(out.items()))


def _number(name: str, value: Any) -> float:
    """A finite real number as float (YAML ints accepted, bools not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DBError(f"field {name!r}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise DBError(f"field {name!r}: {value} is not finite")
    return float(value)


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise DBError(f"field {name!r}: expected a non-empty string, got {value!r}")
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


def _field(d: Mapping[str, Any], name: str, prefix: str = "") -> Any:
    if name not in d:
        raise DBError(f"missing field {prefix + name!r}")
    return d[name]


def _iso_key(date: str) -> _dt.datetime | None:
    try:
        parsed = _dt.datetime.fromisoformat(date)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=_dt.timezone.utc)


def _newer_or_equal(new: Entry, old: Entry) -> bool:
    """The merge rule: `new` wins unless both have dates and `old`'s is strictly later."""
    a, b = new.date, old.date
    if a is None or b is None:
        return True
    ka, kb = _iso_key(a), _iso_key(b)
    if ka is not None and kb is not None:
        return ka >= kb
    return a >= b


def _merge(old: Iterable[Entry], new: Iterable[Entry]) -> list[Entry]:
    """Entries of `old` then `new`, one per ident, by the merge rule."""
    merged: dict[Ident, Entry] = {}
    for e in (*old, *new):
        prev = merged.get(e.ident)
        if prev is None or _newer_or_equal(e, prev):
            merged[e.ident] = e
    return list(merged.values())


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
        path = Path(path)
        return _load(path, _read(path))

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
            _warn(f"ckgen instance DB{where}: ignoring {_count(len(dropped))} "
                  f"(first: {dropped[0]}); re-tune to refresh them")
        return InstanceDB(tuple(kept), self.path, self.skipped)

    @staticmethod
    def layered(*dbs: "InstanceDB") -> "InstanceDB":
        """One view over several DBs; on the same ident the earlier DB wins (user first)."""
        entries = tuple(e for db in dbs for e in db.entries)
        skipped = tuple(s for db in dbs for s in db.skipped)
        return InstanceDB(entries, None, skipped)


def _load(path: Path, contents: _Contents) -> InstanceDB:
    skipped = contents.skipped
    if skipped:
        _warn(f"ckgen instance DB {path}: skipped {_count(len(skipped))} malformed "
              f"(first: {skipped[0]}); the other entries are in use")
    return InstanceDB(tuple(_merge((), contents.entries)), path, tuple(skipped))


def _name(e: Entry) -> str:
    return f"{e.op} {e.arch} {e.problem}"


def _count(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def _warn(message: str) -> None:
    warnings.warn(message, DBWarning, stacklevel=3)


@dataclass(frozen=True)
class _Contents:
    entries: list[Entry]
    skipped: list[str]  # one reason per malformed item
    malformed: list[Any]  # those items as read, written back verbatim by a save


def _read(path: Path) -> _Contents:
    """The entries of the file at `path` and its malformed items; DBCorruptError if the
    file as a whole is unusable. A missing or empty file has no entries."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return _Contents([], [], [])
    try:
        doc = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DBCorruptError(path, f"not UTF-8 text ({e})") from None
    except yaml.YAMLError as e:
        raise DBCorruptError(path, f"not valid YAML ({_yaml_where(e)})") from None
    if doc is None:
        return _Contents([], [], [])
    if not isinstance(doc, dict):
        raise DBCorruptError(path, f"the top level is a {type(doc).__name__}, not a mapping "
                                   "with 'schema' and 'entries'")
    schema = doc.get("schema")
    if schema != SCHEMA_VERSION or isinstance(schema, bool):
        raise DBCorruptError(path, f"schema version {schema!r}, this ckgen reads schema "
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
    problem = getattr(e, "problem", None) or str(e)
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


# ----------------------------------------------------------------------------- writing


def _lock(path: Path) -> filelock.FileLock:
    return filelock.FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)


def _dump(entries: Iterable[Entry], malformed: Iterable[Any] = ()) -> str:
    """The file text: sorted entries, then malformed items as read (kept for a hand fix)."""
    body = {"schema": SCHEMA_VERSION, "entries": [*(e.to_dict() for e in entries), *malformed]}
    return _HEADER + yaml.safe_dump(body, sort_keys=True, default_flow_style=False,
                                    allow_unicode=True)


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, fsync it, then os.replace it onto `path`.
    On any error the temp file is removed and `path` is unchanged."""
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, delete=False,
                                     prefix=f".{path.name}.", suffix=".tmp") as tmp:
        tmp_path = Path(tmp.name)
        try:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
        except BaseException:
            tmp.close()
            tmp_path.unlink(missing_ok=True)
            raise
    try:
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Best effort: make the rename itself durable (not possible on every platform)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_entries(path: Path | str, new: Iterable[Entry]) -> InstanceDB:
    """Merge `new` into the DB file at `path` under its lock and write it atomically.

    For one ident the entry with the later provenance date wins (equal or missing: the new
    one). Malformed items already in the file are written back verbatim after the entries
    (and warned about, as by `load`). A corrupt file raises DBCorruptError and is not
    written. Returns the merged DB.
    """
    path = Path(path)
    new = list(new)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path):
        contents = _read(path)
        on_disk = _load(path, contents)
        merged = InstanceDB(tuple(_merge(on_disk.entries, new)), path, on_disk.skipped)
        _write_atomic(path, _dump(merged.entries, contents.malformed))
    return merged


def remove_entries(path: Path | str, pred: Callable[[Entry], bool]) -> int:
    """Remove the entries for which `pred` is true, under the lock, atomically.
    Returns how many were removed (the file is not rewritten when none)."""
    path = Path(path)
    if not path.exists():
        return 0
    with _lock(path):
        contents = _read(path)
        on_disk = _load(path, contents)
        kept = tuple(e for e in on_disk.entries if not pred(e))
        removed = len(on_disk.entries) - len(kept)
        if removed:
            _write_atomic(path, _dump(kept, contents.malformed))
    return removed


def packaged_db_path() -> Path:
    """The DB file inside the package (winners measured on our GPUs)."""
    return Path(str(importlib.resources.files("ckgen") / "data" / "instances.yaml"))


def shipped_db_path() -> Path:
    """The shipped DB in use: $CKGEN_SHIPPED_DB if set, else the packaged one; may not exist."""
    from . import settings

    return settings.shipped_db_override() or packaged_db_path()


def export_csv(db: InstanceDB, stream: IO[str]) -> None:
    """One header row (CSV_COLUMNS) and one row per entry; config as `k=v;k=v`."""
    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for e in db.entries:
        config = ";".join(f"{k}={v}" for k, v in e.config)
        writer.writerow([e.op, e.arch, e.device, e.problem, e.instance,
                         repr(e.time_us), repr(e.gbps), repr(e.default_time_us), config])


def load_layered(user_path: Path | str) -> InstanceDB:
    """The view every reader uses: the user DB at `user_path` over the shipped DB."""
    return InstanceDB.layered(InstanceDB.load(user_path), InstanceDB.load(shipped_db_path()))
