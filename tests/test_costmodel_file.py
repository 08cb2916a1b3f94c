"""The cost model file's validation at load (ckgen/model/, `CostModel.from_doc`), CPU tier: a
file the dispatcher cannot use safely is one ModelWarning and the nearest-tuned fallback, never
an exception in an unseen problem's call nor a prediction that is not a finite time."""
from __future__ import annotations

import json
import warnings

import pytest

import ckgen
from ckgen import model as cm
from ckgen.model import parsed, policy, store
from ckgen.runtime import db as dbmod
from ckgen import settings
from ckgen.runtime.dispatch import Dispatcher
from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.ops.spec import Target

SM90 = Target.named("sm_90")
GN = get_op("groupnorm_fwd")


def _packaged() -> dict:
    return json.loads(cm.packaged_model_path().read_text(encoding="utf-8"))


def _set(path, value):
    """An edit of a model document: the item at `path` (keys and indices) set to `value`."""
    def edit(doc):
        *head, last = path
        for k in head:
            doc = doc[k]
        doc[last] = value
    return edit


BAD = {
    "a list as a winner's knob value": _set(("winners", "groupnorm_fwd", 0, "threads"), [256]),
    "a dict as a winner's knob value": _set(("winners", "groupnorm_fwd", 0, "items"), {"n": 2}),
    "a list as a residual config's knob value": _set(("residuals", "groupnorm_fwd", "configs", 0, 0), [1]),
    "a dict as a residual config's knob value": _set(("residuals", "groupnorm_fwd", "configs", 0, 1), {}),
    "a winner that is not a mapping": _set(("winners", "groupnorm_fwd", 0), [["threads", 256]]),
    "a negative host time": _set(("host", "call_us"), -4.0),
    "a negative launch host time": _set(("host", "launch_us"), -1e-3),
    "weights that predict infinite times": _set(("weights",), [1e300] * len(cm.TERM_NAMES)),
    "an intercept that predicts infinite times": _set(("intercepts", "groupnorm_fwd"), 1e6),
    "a residual that predicts infinite times": _set(("residuals", "groupnorm_fwd", "residual", 0), 1e6),
    "a weight written as a string": _set(("weights", 0), "0.3"),
    "a weight written as a bool": _set(("weights", 1), True),
    "a huge knee": _set(("need_bytes",), 1e300),
    "stats that are not a mapping": _set(("stats",), ["records", 3]),
}


def _entry(p, config):
    src = render_instance(GN, p, config, SM90)
    return dbmod.Entry(op=GN.name, vendor="cuda", arch="sm_90", device="test device", problem=p.key(),
                       config=config.items, instance=src.name, source_sha256=src.sha256, time_us=10.0,
                       gbps=1000.0, default_time_us=20.0, provenance={"date": "2026-01-01T00:00:00+00:00"})


@pytest.mark.parametrize("what", list(BAD))
def test_a_bad_model_file_is_one_warning_and_the_nearest_tuned_fallback(tmp_path, monkeypatch, what):
    doc = _packaged()
    BAD[what](doc)
    path = tmp_path / "model.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    monkeypatch.setenv("CKGEN_MODEL", str(path))
    near = GN.parse_problem(N=2, C=320, H=64, W=64, G=32, dtype="bf16", layout="nchw")
    dbmod.save_entries(settings.user_db_path(), [_entry(near, GN.space.default)])
    ckgen.reload_db()
    d = Dispatcher()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, _ = d.choose(GN, GN.parse_problem(N=4, C=320, H=64, W=64, G=32, dtype="bf16", layout="nchw"), SM90)
        b, _ = d.choose(GN, GN.parse_problem(N=8, C=320, H=64, W=64, G=32, dtype="bf16", layout="nchw"), SM90)
    assert a.source == b.source == "nearest" and a.config == b.config == GN.space.default
    mine = [w for w in caught if issubclass(w.category, cm.ModelWarning)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert str(path) in str(mine[0].message)
    with pytest.raises(cm.ModelError):  # rejected at load, not when first used
        cm.CostModel.from_doc(doc)


def test_a_fifo_or_a_device_as_model_file_is_one_warning_not_a_hang(tmp_path, monkeypatch, no_hang):
    """CKGEN_MODEL naming a FIFO hung the first untuned call (the read waited for a writer);
    /dev/zero was read without bound. Only a regular file of bounded size is read."""
    import os

    fifo = tmp_path / "model.json"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero"):
        monkeypatch.setenv("CKGEN_MODEL", path)
        monkeypatch.setattr(store, "_warned", set())
        with no_hang(5), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert store.load() is None
        mine = [str(w.message) for w in caught if issubclass(w.category, cm.ModelWarning)]
        assert len(mine) == 1 and "not a regular file" in mine[0], mine


def test_model_fit_replaces_the_file_whole_or_not_at_all(tmp_path, monkeypatch):
    """`python -m ckgen.model fit` wrote the model in place: a write that failed half way (a full
    disk) left a cut file, where the model was before. It now writes a temp file and renames it."""
    from ckgen.model import command

    class Fitted:
        def fit(self):
            return self

        def summary(self):
            return "stub"

    out = tmp_path / "model.json"
    out.write_text('{"before": true}\n')
    monkeypatch.setattr(command, "packaged_fit_data", lambda: Fitted())
    monkeypatch.setattr(command, "dumps", lambda model: "{\"cut\": \"" + "x" * 100 + "\ud800\"}")  # fails half way
    with pytest.raises(UnicodeEncodeError):
        command.main(["fit", "--no-user", "--out", str(out)])
    assert out.read_text() == '{"before": true}\n' and [p.name for p in tmp_path.iterdir()] == ["model.json"]
    monkeypatch.setattr(command, "dumps", lambda model: '{"after": true}\n')
    assert command.main(["fit", "--no-user", "--out", str(out)]) == 0
    assert out.read_text() == '{"after": true}\n'


def test_the_packaged_model_is_inside_the_bounds():
    """The bounds leave the fitted model far inside (so a refit does not trip over them)."""
    doc = _packaged()
    m = cm.CostModel.from_doc(doc)
    assert max(abs(w) for w in [*m.weights, *m.intercepts.values()]) < cm.MAX_WEIGHT / 5
    worst = max(abs(r) for v in doc["residuals"].values() for r in v["residual"])
    assert worst < cm.MAX_RESIDUAL / 5
    assert 0 < m.floor_next_us <= m.floor_us < cm.MAX_US / 100


def test_a_prediction_that_is_not_finite_falls_back_with_one_warning(monkeypatch):
    """A model whose predictions overflow for some problem (one built in code: a file's bounds keep
    the packaged terms finite) is, for that problem, as a corrupt file: the dispatcher falls back
    with one warning, and the tuner gets no seeds from it."""
    good = cm.CostModel.from_doc(_packaged())
    bad = cm.CostModel([1e3] * len(cm.TERM_NAMES), good.intercepts, good.floor_us, good.need_bytes,
                              good.host, good.winners, good.stats, good.residuals, good.correction, good.floor_next_us)
    monkeypatch.setattr(policy, "load", lambda: bad)
    monkeypatch.setattr(store, "_warned", set())
    p = GN.parse_problem(N=3, C=96, H=40, W=24, G=24, dtype="fp32", layout="nhwc")
    usable = lambda c: bool(GN.validate(p, c, SM90))  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cm.dispatch_pick(GN, p, SM90, [], usable) is None
        assert cm.top_configs(GN, p, SM90, 3, usable) == []
    mine = [w for w in caught if issubclass(w.category, cm.ModelWarning)]
    assert len(mine) == 1 and "not finite" in str(mine[0].message)


# ------------------------------------------------------------------ the parse cache (issue 53)


def _load_fresh(monkeypatch, path) -> cm.CostModel:
    """cm.load() of the model file at `path` in a process that has loaded none."""
    monkeypatch.setenv("CKGEN_MODEL", str(path))
    monkeypatch.setattr(store, "_loaded", {})
    return cm.load()


def _exact(model: cm.CostModel) -> str:
    return json.dumps(model.to_doc(), sort_keys=True)


def test_a_model_read_back_from_the_parse_cache_is_the_files(tmp_path, monkeypatch):
    path = tmp_path / "model.json"
    path.write_bytes(cm.packaged_model_path().read_bytes())
    first = _load_fresh(monkeypatch, path)
    assert isinstance(first.residuals, dict)  # parsed from the file, then kept
    again = _load_fresh(monkeypatch, path)
    assert isinstance(again.residuals, parsed._PackedTables) and len(again.residuals) == len(first.residuals)
    p = GN.parse_problem(N=3, C=96, H=40, W=24, G=24, dtype="fp32", layout="nhwc")
    configs = GN.space.enumerate()[:200]
    assert [str(x) for x in again.predict_many(GN, p, configs, SM90)] == \
        [str(x) for x in first.predict_many(GN, p, configs, SM90)]
    assert _exact(again) == _exact(first)  # every table, value kinds too
    path.write_text(path.read_text().replace('"floor_us":', '"floor_us": ', 1))  # other bytes: another key
    assert isinstance(_load_fresh(monkeypatch, path).residuals, dict)


@pytest.mark.parametrize("spoil", ["residual", "configs", "length", "head"])
def test_a_spoiled_model_cache_file_is_not_used(tmp_path, monkeypatch, spoil):
    """A packed table that fails its check is taken from the model file (and the cache file
    removed); a head that from_doc refuses makes the whole cache file unused."""
    import base64

    from ckgen import parsecache

    path = tmp_path / "model.json"
    path.write_bytes(cm.packaged_model_path().read_bytes())
    want = _exact(_load_fresh(monkeypatch, path))
    [cached] = parsecache.folder("model").glob("*.json")
    doc = json.loads(cached.read_text())
    table = doc["tables"]["groupnorm_fwd"]
    if spoil == "residual":
        res = bytearray(base64.b64decode(table["residual"]))
        res[0:8] = b"\xff" * 8  # a NaN
        table["residual"] = base64.b64encode(bytes(res)).decode()
    elif spoil == "configs":
        rows = json.loads(table["configs"])
        rows[0][0] = [1]
        table["configs"] = json.dumps(rows)
    elif spoil == "length":
        table["n"] -= 1
    else:
        doc["head"]["weights"][0] = "0.3"
    cached.write_text(json.dumps(doc))
    model = _load_fresh(monkeypatch, path)
    assert _exact(model) == want
    if spoil != "head":
        assert not cached.exists()
