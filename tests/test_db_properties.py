"""Hypothesis properties of the instance DB (ckgen.runtime.db): entries round-trip through the file
byte-stably with either YAML backend; the merge rule holds over any sequence of saves; any
document, however malformed, loads as a DB (bad entries skipped) or is refused as corrupt with
a bounded message, never another exception."""
from __future__ import annotations

import datetime as dt
import tempfile
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ckgen.runtime import db
from ckgen.runtime.db import DBCorruptError, DBWarning, Entry, InstanceDB
from ckgen.ops import get_op

PROPS = settings(max_examples=100, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
GN_OPS = ("groupnorm_fwd", "groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta")
POOL_OPS = ("maxpool2d_fwd", "maxpool2d_bwd", "avgpool2d_fwd", "avgpool2d_bwd")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DBWarning)
        yield


@st.composite
def problem_keys(draw, op: str) -> str:
    spec = get_op(op)
    common = dict(N=draw(st.integers(1, 4096)), dtype=draw(st.sampled_from(["fp32", "fp16", "bf16"])),
                  layout=draw(st.sampled_from(["nchw", "nhwc"])))
    if op in GN_OPS:
        G = draw(st.integers(1, 64))
        return spec.parse_problem(**common, C=G * draw(st.integers(1, 32)), G=G, H=draw(st.integers(1, 256)),
                                  W=draw(st.integers(1, 256)),
                                  activation=draw(st.sampled_from(["none", "swish"]))).key()
    k = draw(st.integers(1, 7))
    extra: dict = {}
    if op == "maxpool2d_fwd":
        extra = {"return_indices": draw(st.booleans()), "dilation": draw(st.integers(1, 3))}
    elif op == "maxpool2d_bwd":
        extra = {"indices": draw(st.sampled_from(["stored", "recompute"])), "dilation": draw(st.integers(1, 3))}
    else:
        extra = {"count_include_pad": draw(st.booleans()), "divisor_override": draw(st.integers(0, 2**31 - 1))}
    size = draw(st.integers(3 * k, 512))
    return spec.parse_problem(**common, C=draw(st.integers(1, 512)), H=size, W=size, kernel=k,
                              stride=draw(st.integers(1, 4)), padding=draw(st.integers(0, k // 2)),
                              ceil_mode=draw(st.booleans()), **extra).key()


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)
NAME = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=12)
FLOAT = st.floats(allow_nan=False, allow_infinity=False)
DATES = st.one_of(st.none(), st.datetimes(min_value=dt.datetime(2000, 1, 1), max_value=dt.datetime(2100, 1, 1),
                                          timezones=st.sampled_from([dt.timezone.utc, None])).map(
    lambda d: d.isoformat()))


@st.composite
def entries(draw, op: str | None = None, arch: str | None = None) -> Entry:
    op = op or draw(st.sampled_from(GN_OPS + POOL_OPS))
    prov = draw(st.dictionaries(NAME, st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), FLOAT, TEXT),
                                max_size=4))
    date = draw(DATES)
    if date is not None:
        prov["date"] = date
    return Entry(op=op, vendor=draw(st.sampled_from(["cuda", "hip"])),
                 arch=arch or draw(st.sampled_from(["sm_80", "sm_90", "sm_90a", "gfx942", "gfx1100"])),
                 device=draw(TEXT), problem=draw(problem_keys(op)),
                 config=draw(st.dictionaries(NAME, st.one_of(st.integers(-2**40, 2**40), FLOAT, TEXT), max_size=6)),
                 instance=draw(TEXT), source_sha256=draw(st.text("0123456789abcdef", min_size=64, max_size=64)),
                 time_us=draw(FLOAT), gbps=draw(FLOAT), default_time_us=draw(FLOAT), provenance=prov)


def _fresh() -> Path:
    return Path(tempfile.mkdtemp(prefix="ckgen-dbprop-")) / "instances.yaml"


@PROPS
@given(es=st.lists(entries(), max_size=8))
def test_save_load_round_trip_is_exact_and_byte_stable(es):
    path = _fresh()
    merged = db.save_entries(path, es)
    loaded = InstanceDB.load(path)
    assert loaded.entries == merged.entries and loaded.skipped == ()
    assert {e.ident for e in loaded} == {e.ident for e in es}
    for e in loaded:
        assert Entry.from_dict(e.to_dict()) == e
    first = path.read_bytes()
    db.save_entries(path, reversed(loaded.entries))
    assert path.read_bytes() == first
    # The pure-Python backend reads the same entries and writes the same bytes.
    with pytest.MonkeyPatch.context() as m:
        m.setattr(db, "_LOADER", yaml.SafeLoader)
        m.setattr(db, "_DUMPER", yaml.SafeDumper)
        assert InstanceDB.load(path).entries == loaded.entries
        db.save_entries(path, [])
        assert path.read_bytes() == first


@PROPS
@given(saves=st.lists(st.lists(entries(op="groupnorm_fwd", arch="sm_90"), min_size=1, max_size=3), min_size=1,
                      max_size=5))
def test_merge_rule_over_a_sequence_of_saves(saves):
    """For each ident: the verified entry wins, then the faster, then the later real date (none,
    an unreadable or a future one ranks last); a full tie goes to the later save. Every new
    entry that was not kept is reported."""
    import warnings

    path = _fresh()
    want: dict = {}
    now = dt.datetime.now(dt.timezone.utc).timestamp()
    for batch in saves:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", db.DBWarning)
            db.save_entries(path, batch)
        lost = []
        for e in batch:
            old = want.get(e.ident)
            verified = db.entry_verified
            if old is None or old == e or db._rank(e, verified(e), now) <= db._rank(old, verified(old), now):
                want[e.ident] = e
                lost = [x for x in lost if x.ident != e.ident]
            else:
                lost.append(e)
        assert bool(lost) == any("not saved" in str(w.message) for w in caught)
    assert set(InstanceDB.load(path).entries) == set(want.values())


JSONISH = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**80, 2**80), st.floats(), TEXT,
              st.dates().map(lambda d: d)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.one_of(TEXT, st.integers()), inner,
                                                                          max_size=4)),
    max_leaves=20)


@st.composite
def documents(draw):
    """Whole documents: arbitrary values, or DB-shaped ones whose entries have random fields
    replaced, dropped or added."""
    kind = draw(st.sampled_from(["any", "db", "db"]))
    if kind == "any":
        return draw(JSONISH)
    items = []
    for e in draw(st.lists(entries(), max_size=4)):
        d = e.to_dict()
        for _ in range(draw(st.integers(0, 3))):
            field = draw(st.sampled_from(sorted(d) + ["target.arch", "config.threads", "extra"]))
            value = draw(JSONISH)
            if "." in field:
                outer, inner = field.split(".")
                if isinstance(d.get(outer), dict):
                    d[outer] = {**d[outer], inner: value}
            elif draw(st.booleans()):
                d[field] = value
            else:
                d.pop(field, None)
        items.append(d)
    items += draw(st.lists(JSONISH, max_size=2))
    return {"schema": draw(st.sampled_from([1, 1, 1, 2, "1", True, None])), "entries": items}


@PROPS
@given(doc=documents(), backend=st.sampled_from(["C", "python"]))
def test_any_document_loads_or_is_corrupt_with_a_bounded_message(doc, backend, monkeypatch):
    if backend == "python":
        monkeypatch.setattr(db, "_LOADER", yaml.SafeLoader)
    path = _fresh()
    text = yaml.safe_dump(doc, allow_unicode=True)
    path.write_text(text, encoding="utf-8")
    try:
        loaded = InstanceDB.load(path)
    except DBCorruptError as e:
        event("corrupt")
        assert len(str(e)) < 1000 and e.path == path
        with pytest.raises(DBCorruptError):
            db.save_entries(path, [])
        assert path.read_text(encoding="utf-8") == text
        return
    event(f"loaded: {len(loaded)} entries, {len(loaded.skipped)} skipped" if len(loaded) + len(loaded.skipped) < 3
          else "loaded: more")
    for reason in loaded.skipped:
        assert len(reason) < 1000
    for e in loaded:  # every entry that loads is a valid one: its key parses through its op
        assert get_op(e.op).problem_from_key(e.problem).key() == e.problem
    new = Entry(op="groupnorm_fwd", vendor="cuda", arch="sm_90", device="d", problem=get_op("groupnorm_fwd")
                .parse_problem(N=1, C=2, H=1, W=1, G=1, dtype="bf16", layout="nchw").key(), config={"threads": 128},
                instance="i", source_sha256="0" * 64, time_us=1.0, gbps=1.0, default_time_us=1.0,
                provenance={"date": "2100-01-01T00:00:00+00:00"})
    after = db.save_entries(path, [new])
    again = InstanceDB.load(path)
    assert again.entries == after.entries and new in again.entries
    assert len(again.skipped) == len(loaded.skipped), "malformed items are kept for a hand fix"


@PROPS
@given(doc=documents())
def test_any_document_reads_the_same_from_the_parse_cache(doc, monkeypatch):
    """What the parse cache gives back for a file is what parsing it gives (value kinds, order
    and malformed items exactly), or nothing: it is not used."""
    monkeypatch.setattr(db, "PARSED_MIN_BYTES", 0)
    path = _fresh()
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    try:
        parsed = repr(db._read(path))  # parsed, and kept where JSON holds it exactly
    except DBCorruptError:
        event("corrupt")
        return
    raw = path.read_bytes()
    cached = db._parsed_get(raw)
    event("cached" if cached is not None else "not cached")
    assert cached is None or repr(cached) == parsed
    assert repr(db._read(path)) == parsed
