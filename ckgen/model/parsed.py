"""The parse cache of a model file (ckgen/parsecache.py): reading the packaged model costs ~60 ms
of CPU (json of ~250,000 numbers, then the residual tables' checks), and an unseen problem's pick
needs the residual table of its op alone. So what a model file of at least PARSED_MIN_BYTES holds is
kept as the document less its residual tables (read and checked by `CostModel.from_doc` as from the
file) and each op's table packed (its index and residual lists as little-endian arrays in base64,
the rest as JSON text), unpacked and checked (`_residuals_ok`, as `from_doc` checks it) when the op
is first asked about (`_PackedTables`). A table that fails its check there is taken from the model
file instead (parsed whole, once) and the cache file is removed. Kept only when the unpacked tables
are the file's exactly (value kinds too)."""
from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .document import MAX_MODEL_BYTES, ModelError, _residuals_ok
from .predictor import CostModel

PARSED_FORMAT = "ckgen-costmodel-parsed"
PARSED_VERSION = 1
PARSED_MIN_BYTES = 64 * 1024
_TABLE_KEYS = ("knobs", "problems", "configs", "problem", "config", "residual")


def _parsed_key(raw: bytes) -> str | None:
    from .. import parsecache

    return parsecache.key("model", raw, PARSED_FORMAT, str(PARSED_VERSION))


def _pack(xs: list, dtype: str) -> str:
    import base64

    return base64.b64encode(np.asarray(xs, dtype=dtype).tobytes()).decode("ascii")


def _unpack(text: Any, dtype: str, n: int) -> np.ndarray:
    import base64

    if type(text) is not str:
        raise ValueError("not packed")
    a = np.frombuffer(base64.b64decode(text, validate=True), dtype=dtype)
    if len(a) != n:
        raise ValueError("length")
    return a


def _index_dtype(n: int) -> str:
    return "<u2" if n <= 0xFFFF else "<u4"


def _packed_table(t: dict[str, Any]) -> dict[str, Any] | None:
    """One residual table packed, None if unpacking would not give it back exactly."""
    if set(t) != set(_TABLE_KEYS) or len(t["problems"]) > 0xFFFFFFFF or len(t["configs"]) > 0xFFFFFFFF:
        return None
    if not (all(type(x) is int for x in t["problem"]) and all(type(x) is int for x in t["config"])
            and all(type(x) is float for x in t["residual"])):
        return None
    return {"knobs": t["knobs"], "problems": json.dumps(t["problems"], separators=(",", ":")),
            "configs": json.dumps(t["configs"], separators=(",", ":")), "n": len(t["residual"]),
            "problem": _pack(t["problem"], _index_dtype(len(t["problems"]))),
            "config": _pack(t["config"], _index_dtype(len(t["configs"]))),
            "residual": _pack(t["residual"], "<f8")}


def _unpacked_table(p: Any) -> tuple[dict[str, Any], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A packed table back, checked as `from_doc` checks one, and its problem, config and
    residual lists as arrays (what `_ResidualIndex` reads); ValueError if it fails. The arrays
    are checked as they are (unpacked: ints and floats by construction), not as lists again."""
    if type(p) is not dict or type(p.get("n")) is not int or type(p.get("problems")) is not str \
            or type(p.get("configs")) is not str:
        raise ValueError("packed table")
    problems, configs, n = json.loads(p["problems"]), json.loads(p["configs"]), p["n"]
    if type(problems) is not list or type(configs) is not list:
        raise ValueError("packed table")
    arrays = (_unpack(p.get("problem"), _index_dtype(len(problems)), n),
              _unpack(p.get("config"), _index_dtype(len(configs)), n),
              _unpack(p.get("residual"), "<f8", n))
    t = {"knobs": p.get("knobs"), "problems": problems, "configs": configs,
         "problem": arrays[0].tolist(), "config": arrays[1].tolist(), "residual": arrays[2].tolist()}
    if not _residuals_ok(t, arrays):
        raise ValueError("residual table")
    return t, arrays


class _PackedTables(Mapping):
    """A model's residual tables (op -> table) from the parse cache, each unpacked and checked
    when first asked for; a table that fails is taken from the model file instead."""

    def __init__(self, packed: dict[str, Any], path: Path, key: str) -> None:
        self._packed, self._path, self._key = packed, path, key
        self._tables: dict[str, dict[str, Any]] = {}
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._spoiled: dict[str, dict[str, Any]] | None = None  # the file's tables, once one failed
        self._lock = threading.Lock()

    def __getitem__(self, op: str) -> dict[str, Any]:
        t = self._tables.get(op)
        if t is None:
            with self._lock:
                t = self._tables.get(op)
                if t is None:
                    t = self._tables[op] = self._unpacked(op)
        return t

    def arrays(self, op: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Op's table's problem, config and residual lists as arrays (None: its table is the
        model file's, after a spoiled cache file)."""
        self[op]
        return self._arrays.get(op)

    def _unpacked(self, op: str) -> dict[str, Any]:
        packed = self._packed[op]  # KeyError: no table of this op
        if self._spoiled is None:
            try:
                t, self._arrays[op] = _unpacked_table(packed)
                return t
            except Exception:  # noqa: BLE001 - a spoiled cache file: the model file's tables instead
                from .. import parsecache

                parsecache.forget("model", self._key)
                self._spoiled = self._file_tables()
        return self._spoiled[op]

    def _file_tables(self) -> dict[str, dict[str, Any]]:
        """The model file's residual tables (its bytes still those of the key), checked by from_doc."""
        try:
            from .. import files

            raw = files.read_regular(self._path, MAX_MODEL_BYTES)
            if _parsed_key(raw) != self._key:
                raise ModelError("the file changed since it was read")
            tables = CostModel.from_doc(json.loads(raw.decode("utf-8"))).residuals
        except (ModelError, OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ModelError(f"its residual tables cannot be read again ({str(e)[:200]})") from None
        if set(tables) != set(self._packed):
            raise ModelError("its residual tables cannot be read again (the file changed)")
        return tables

    def __iter__(self):
        return iter(self._packed)

    def __len__(self) -> int:
        return len(self._packed)


def _parsed_get(raw: bytes, path: Path) -> CostModel | None:
    """The model of these bytes from the parse cache (None: not there, or spoiled)."""
    if len(raw) < PARSED_MIN_BYTES:
        return None
    from .. import parsecache

    try:
        key = _parsed_key(raw)
        data = parsecache.read("model", key) if key is not None else None
        if data is None:
            return None
        doc = json.loads(data)
        if (type(doc) is not dict or doc.get("format") != PARSED_FORMAT or doc.get("version") != PARSED_VERSION
                or doc.get("key") != key or type(doc.get("head")) is not dict or type(doc.get("tables")) is not dict
                or "residuals" in doc["head"]):
            return None
        model = CostModel.from_doc(doc["head"])
        model.residuals = _PackedTables(doc["tables"], path, key)
        return model
    except Exception:  # noqa: BLE001 - not JSON, too deep, a head from_doc refuses: not used
        return None


def _parsed_put(raw: bytes, doc: dict[str, Any]) -> None:
    """Keep the model document `doc` (read from `raw`, accepted by from_doc) in the parse cache."""
    if len(raw) < PARSED_MIN_BYTES:
        return
    from .. import parsecache

    with contextlib.suppress(Exception):
        key = _parsed_key(raw)
        tables = {op: _packed_table(t) for op, t in (doc.get("residuals") or {}).items()}
        if key is None or any(t is None for t in tables.values()):
            return
        head = {k: v for k, v in doc.items() if k != "residuals"}
        parsecache.write("model", key, json.dumps({"format": PARSED_FORMAT, "version": PARSED_VERSION, "key": key,
                                                   "head": head, "tables": tables},
                                                  ensure_ascii=True, separators=(",", ":")))
