"""CPU tests of the YAML instance database (ckgen.db)."""
from __future__ import annotations

import csv
import io
import multiprocessing
import warnings
from pathlib import Path

import pytest
import yaml

from ckgen import db
from ckgen.db import DBCorruptError, DBError, DBWarning, Entry, InstanceDB


def make(op: str = "groupnorm_fwd", arch: str = "sm_90", problem: str = "N=8,C=320",
         date: str | None = "2026-11-22T10:00:00+00:00", time_us: float = 12.5,
         **config: object) -> Entry:
    prov: dict[str, object] = {"ckgen": "0.1.0", "trials": 40, "tuning_seconds": 55.2}
    if date is not None:
        prov["date"] = date
    return Entry(op=op, vendor="cuda", arch=arch, device="NVIDIA H100 80GB HBM3",
                 problem=problem, config=config or {"threads": 512, "vec_bytes": 16},
                 instance=f"ckgen_{op}_x", source_sha256="ab" * 32, time_us=time_us,
                 gbps=2345.6, default_time_us=20.1, provenance=prov)


def no_temp_files(folder: Path, keep: set[str]) -> bool:
    return {p.name for p in folder.iterdir()} <= keep | {n + ".lock" for n in keep}


# ------------------------------------------------------------------ entries and round trip


def test_entry_dict_round_trip_and_sorted_pairs() -> None:
    e = make(vec_bytes=16, threads=256)
    assert e.config == (("threads", 256), ("vec_bytes", 16))
    assert e.ident == ("groupnorm_fwd", "sm_90", "N=8,C=320")
    d = e.to_dict()
    assert d["target"] == {"vendor": "cuda", "arch": "sm_90", "device": "NVIDIA H100 80GB HBM3"}
    assert Entry.from_dict(d) == e


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.pop("time_us"), "time_us"),
    (lambda d: d["target"].pop("arch"), "target.arch"),
    (lambda d: d.update(gbps="fast"), "gbps"),
    (lambda d: d.update(config=[1, 2]), "config"),
    (lambda d: d.update(target="sm_90"), "target"),
])
def test_from_dict_names_the_bad_field(mutate, words: str) -> None:
    d = make().to_dict()
    mutate(d)
    with pytest.raises(DBError, match=words):
        Entry.from_dict(d)


def test_save_load_round_trip_sorted_and_byte_stable(tmp_path: Path) -> None:
    entries = [make(problem="p2"), make(op="avgpool2d_fwd", problem="p9"),
               make(arch="sm_80", problem="p1"), make(problem="p1")]
    path = tmp_path / "sub" / "instances.yaml"  # parent is created
    db.save_entries(path, entries)
    first = path.read_bytes()
    loaded = InstanceDB.load(path)
    assert set(loaded.entries) == set(entries)
    idents = [e.ident for e in loaded.entries]
    assert idents == sorted(idents)
    on_disk = yaml.safe_load(first)
    assert on_disk["schema"] == db.SCHEMA_VERSION
    assert [(x["op"], x["target"]["arch"], x["problem"]) for x in on_disk["entries"]] == idents
    db.save_entries(path, reversed(entries))
    assert path.read_bytes() == first
    assert no_temp_files(path.parent, {"instances.yaml"})


def test_missing_file_is_empty_db(tmp_path: Path) -> None:
    d = InstanceDB.load(tmp_path / "nope.yaml")
    assert d.entries == () and d.skipped == ()


def test_lookup_and_select(tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    db.save_entries(path, [make(problem="a"), make(problem="b"), make(arch="gfx942", problem="a"),
                           make(op="maxpool2d_fwd", problem="a")])
    d = InstanceDB.load(path)
    assert d.lookup("groupnorm_fwd", "gfx942", "a") is not None
    assert d.lookup("groupnorm_fwd", "gfx942", "b") is None
    assert len(d.select()) == 4
    assert [e.problem for e in d.select(op="groupnorm_fwd", arch="sm_90")] == ["a", "b"]
    assert len(d.select(arch="sm_90")) == 3
    assert [e.op for e in d.select(op="maxpool2d_fwd")] == ["maxpool2d_fwd"]


def test_layered_user_wins_over_shipped() -> None:
    user = InstanceDB((make(problem="a", time_us=1.0),))
    shipped = InstanceDB((make(problem="a", time_us=2.0), make(problem="b", time_us=3.0)))
    both = InstanceDB.layered(user, shipped)
    assert both.lookup("groupnorm_fwd", "sm_90", "a").time_us == 1.0
    assert both.lookup("groupnorm_fwd", "sm_90", "b").time_us == 3.0
    assert InstanceDB.layered(shipped, user).lookup("groupnorm_fwd", "sm_90", "a").time_us == 2.0


def test_packaged_db_path() -> None:
    p = db.packaged_db_path()
    assert isinstance(p, Path) and p.name == "instances.yaml" and p.parent.name == "data"


# ------------------------------------------------------------------ damaged files


def write_doc(path: Path, entries: list[object], schema: object = 1) -> None:
    path.write_text(yaml.safe_dump({"schema": schema, "entries": entries}))


def test_malformed_entry_skipped_with_one_warning(tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    bad1 = make(problem="bad1").to_dict()
    del bad1["gbps"]
    bad2 = make(problem="bad2").to_dict()
    bad2["time_us"] = "slow"
    good = [make(problem="g1"), make(problem="g2")]
    write_doc(path, [good[0].to_dict(), bad1, "junk", good[1].to_dict(), bad2])
    with pytest.warns(DBWarning) as record:
        d = InstanceDB.load(path)
    assert len(record) == 1
    msg = str(record[0].message)
    assert "3 entries" in msg and "gbps" in msg
    assert set(d.entries) == set(good)
    assert len(d.skipped) == 3 and "entries[1]" in d.skipped[0]


def test_save_keeps_malformed_items_for_a_hand_fix(tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    bad = make(problem="bad").to_dict()
    del bad["gbps"]
    write_doc(path, [bad])
    with pytest.warns(DBWarning):
        db.save_entries(path, [make(problem="new")])
    doc = yaml.safe_load(path.read_text())
    assert bad in doc["entries"] and len(doc["entries"]) == 2


@pytest.mark.parametrize("text, words", [
    ("schema: 1\nentries:\n  - op: [unclosed\n", "line"),
    ("- just\n- a list\n", "not a mapping"),
    ("schema: 99\nentries: []\n", "schema version 99"),
    ("entries: []\n", "schema version None"),
    ("schema: 1\nentries: {op: x}\n", "'entries' is a dict"),
])
def test_corrupt_file_raises_and_save_leaves_it_untouched(tmp_path: Path, text: str,
                                                          words: str) -> None:
    path = tmp_path / "db.yaml"
    path.write_text(text)
    before = path.read_bytes()
    with pytest.raises(DBCorruptError, match=words) as info:
        InstanceDB.load(path)
    assert info.value.path == path
    assert str(path) in str(info.value) and "left untouched" in str(info.value)
    with pytest.raises(DBCorruptError):
        db.save_entries(path, [make()])
    with pytest.raises(DBCorruptError):
        db.remove_entries(path, lambda e: True)
    assert path.read_bytes() == before
    assert no_temp_files(tmp_path, {"db.yaml"})


def test_failed_write_leaves_no_temp_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "db.yaml"
    db.save_entries(path, [make(problem="a")])
    before = path.read_bytes()

    def boom(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(db.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        db.save_entries(path, [make(problem="b")])
    assert path.read_bytes() == before
    assert no_temp_files(tmp_path, {"db.yaml"})


def test_unquoted_yaml_date_is_read_as_iso_string(tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    text = yaml.safe_dump({"schema": 1, "entries": [make().to_dict()]})
    path.write_text(text.replace("'2026-11-22T10:00:00+00:00'", "2026-11-22 10:00:00"))
    (e,) = InstanceDB.load(path).entries
    assert e.provenance_dict()["date"].startswith("2026-11-22")


# ------------------------------------------------------------------ merge, filter, remove


def test_merge_later_date_wins_and_distinct_idents_kept(tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    db.save_entries(path, [make(problem="a", date="2026-11-22T10:00:00+00:00", time_us=5.0),
                           make(problem="b", time_us=7.0)])
    older = make(problem="a", date="2026-01-01T00:00:00+00:00", time_us=9.0)
    merged = db.save_entries(path, [older, make(problem="c")])
    assert merged.lookup("groupnorm_fwd", "sm_90", "a").time_us == 5.0  # on disk is later
    newer = make(problem="a", date="2026-12-01T00:00:00+00:00", time_us=3.0)
    db.save_entries(path, [newer])
    same_date = make(problem="b", time_us=6.0)
    db.save_entries(path, [same_date])
    d = InstanceDB.load(path)
    assert d.lookup("groupnorm_fwd", "sm_90", "a").time_us == 3.0
    assert d.lookup("groupnorm_fwd", "sm_90", "b").time_us == 6.0  # equal date: new wins
    assert sorted(e.problem for e in d.entries) == ["a", "b", "c"]
    db.save_entries(path, [make(problem="c", date=None, time_us=1.5)])  # no date: new wins
    assert InstanceDB.load(path).lookup("groupnorm_fwd", "sm_90", "c").time_us == 1.5


def test_filter_drops_with_one_warning() -> None:
    d = InstanceDB((make(problem="a"), make(problem="b"), make(problem="c")))
    with pytest.warns(DBWarning) as record:
        kept = d.filter(lambda e: None if e.problem == "b" else "template hash changed")
    assert len(record) == 1
    assert "2 entries" in str(record[0].message)
    assert "template hash changed" in str(record[0].message)
    assert [e.problem for e in kept.entries] == ["b"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert d.filter(lambda e: None) == d


def test_remove_entries(tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    assert db.remove_entries(path, lambda e: True) == 0
    db.save_entries(path, [make(problem="a"), make(problem="b"), make(arch="sm_80", problem="a")])
    assert db.remove_entries(path, lambda e: e.arch == "sm_90") == 2
    assert [e.ident for e in InstanceDB.load(path).entries] == [("groupnorm_fwd", "sm_80", "a")]
    assert db.remove_entries(path, lambda e: False) == 0
    assert no_temp_files(tmp_path, {"db.yaml"})


def test_export_csv_columns() -> None:
    d = InstanceDB((make(problem="N=1,C=2", threads=128, vec_bytes=8),))
    out = io.StringIO()
    db.export_csv(d, out)
    rows = list(csv.reader(io.StringIO(out.getvalue())))
    assert rows[0] == ["op", "arch", "device", "problem", "instance", "time_us", "gbps",
                       "default_time_us", "config"]
    assert len(rows) == 2
    row = dict(zip(rows[0], rows[1]))
    assert row["problem"] == "N=1,C=2"  # the comma survives quoting
    assert row["config"] == "threads=128;vec_bytes=8"
    assert float(row["time_us"]) == 12.5 and row["arch"] == "sm_90"


# ------------------------------------------------------------------ two processes, one file

SAVES_PER_PROCESS = 40


def _saver(path: str, tag: str, start) -> None:
    start.wait()
    for i in range(SAVES_PER_PROCESS):
        db.save_entries(path, [make(problem=f"{tag}-{i:02d}")])


def test_two_processes_lose_no_entry(tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_saver, args=(str(path), tag, start)) for tag in "AB"]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    problems = {e.problem for e in InstanceDB.load(path).entries}
    assert problems == {f"{t}-{i:02d}" for t in "AB" for i in range(SAVES_PER_PROCESS)}
    assert no_temp_files(tmp_path, {"db.yaml"})
