"""Where the model file is and how it is read and written: $CKGEN_MODEL (a path; "off" disables
the model), else a model fitted by the user beside the user DB (`python -m ckgen.model fit`), else
the packaged ckgen/data/costmodel.json. `load()` reads it once per file version (through the parse
cache); a missing or corrupt file gives one `ModelWarning` and no model, and the dispatcher then
serves the nearest tuned problem's winner. `dumps` is the file's text. Nothing here imports CuPy."""
from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

from .. import files
from ..settings import ENV_MODEL  # one place for every environment setting
from .document import MAX_MODEL_BYTES, ModelError, ModelWarning
from .parsed import _parsed_get, _parsed_put
from .predictor import CostModel


def dumps(model: CostModel) -> str:
    """The model file's text: one line per top-level key, its value compact (deterministic)."""
    doc = model.to_doc()
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(doc[k], sort_keys=True, separators=(',', ':'))}"
                      for k in sorted(doc))
    return "{\n" + body + "\n}\n"


def packaged_model_path() -> Path:
    import importlib.resources

    return Path(str(importlib.resources.files("ckgen") / "data" / "costmodel.json"))


def user_model_path() -> Path:
    """Where `python -m ckgen.model fit` writes: beside the user DB."""
    from .. import settings

    db = settings.user_db_path()
    return db.with_name(f"{db.stem}.costmodel.json")


def model_path() -> Path | None:
    """The model file in use: $CKGEN_MODEL ("off": none), else the user's, else the packaged one."""
    env = os.environ.get(ENV_MODEL, "")
    if env.lower() in ("off", "0", "none"):
        return None
    if env:
        return Path(env)
    user = user_model_path()
    return user if user.exists() else packaged_model_path()


_lock = threading.Lock()
_loaded: dict[tuple[str, int, int], CostModel | None] = {}
_warned: set[str] = set()


def load() -> CostModel | None:
    """The model in use, or None (disabled, or its file missing or corrupt: one ModelWarning per
    file, and the dispatcher falls back to nearest-tuned). Cached per file version."""
    path = model_path()
    if path is None:
        return None
    try:
        st = path.stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
    except OSError:
        key = (str(path), -1, -1)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        try:
            if key[1] < 0:
                raise ModelError("the file is missing")
            raw = files.read_regular(path, MAX_MODEL_BYTES)  # a FIFO named here would block a plain read
            model = _parsed_get(raw, path)
            if model is None:
                doc = json.loads(raw.decode("utf-8"))
                model = CostModel.from_doc(doc)
                _parsed_put(raw, doc)
        except (ModelError, OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            model = None
            _warn_once(path, e)
        _loaded[key] = model
        return model


def _warn_once(path: Path | None, e: Exception) -> None:
    """One ModelWarning per model file: it cannot be used, the dispatcher falls back."""
    if str(path) in _warned:
        return
    _warned.add(str(path))
    warnings.warn(f"ckgen cost model {path}: {str(e)[:300]}; unseen problems get the nearest tuned "
                  "problem's winner instead", ModelWarning, stacklevel=4)
