"""CPU tests of the YAML instance database (ckgen.runtime.db)."""
from __future__ import annotations

import csv
import io
import multiprocessing
import os
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import yaml

from ckgen.runtime import db
from ckgen import parsecache
from ckgen.runtime.db import DBCorruptError, DBError, DBWarning, Entry, InstanceDB
from ckgen.ops import get_op


_TAGS = ("a", "b", "c", "p1", "p2", "p9", "g1", "g2", "bad", "bad1", "bad2", "new")


def key(tag: str | int, op: str = "groupnorm_fwd") -> str:
    """A valid problem key of `op`, one per tag (a name of _TAGS or a number: N=1, 2, ...)."""
    n = tag if isinstance(tag, int) else _TAGS.index(tag) + 1
    spec = get_op(op)
    if op.startswith("groupnorm"):
        return spec.parse_problem(N=n, C=320, H=8, W=8, G=32, dtype="bf16", layout="nhwc").key()
    return spec.parse_problem(N=n, C=16, H=9, W=9, dtype="bf16", layout="nhwc", kernel=3, stride=2, padding=1).key()


def make(op: str = "groupnorm_fwd", arch: str = "sm_90", problem: str | int = "a",
         date: str | None = "2026-11-22T10:00:00+00:00", time_us: float = 12.5,
         **config: object) -> Entry:
    prov: dict[str, object] = {"ckgen": "0.1.0", "trials": 40, "tuning_seconds": 55.2}
    if date is not None:
        prov["date"] = date
    return Entry(op=op, vendor="cuda", arch=arch, device="NVIDIA H100 80GB HBM3",
                 problem=key(problem, op), config=config or {"threads": 512, "vec_bytes": 16},
                 instance=f"ckgen_{op}_x", source_sha256="ab" * 32, time_us=time_us,
                 gbps=2345.6, default_time_us=20.1, provenance=prov)


def no_temp_files(folder: Path, keep: set[str]) -> bool:
    return {p.name for p in folder.iterdir()} <= keep | {n + ".lock" for n in keep}


# ------------------------------------------------------------------ entries and round trip


def test_entry_dict_round_trip_and_sorted_pairs() -> None:
    e = make(vec_bytes=16, threads=256)
    assert e.config == (("threads", 256), ("vec_bytes", 16))
    assert e.ident == ("groupnorm_fwd", "sm_90", key("a"))
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
    assert d.lookup("groupnorm_fwd", "gfx942", key("a")) is not None
    assert d.lookup("groupnorm_fwd", "gfx942", key("b")) is None
    assert len(d.select()) == 4
    assert [e.problem for e in d.select(op="groupnorm_fwd", arch="sm_90")] == [key("a"), key("b")]
    assert len(d.select(arch="sm_90")) == 3
    assert [e.op for e in d.select(op="maxpool2d_fwd")] == ["maxpool2d_fwd"]


def test_layered_user_wins_over_shipped() -> None:
    user = InstanceDB((make(problem="a", time_us=1.0),))
    shipped = InstanceDB((make(problem="a", time_us=2.0), make(problem="b", time_us=3.0)))
    both = InstanceDB.layered(user, shipped)
    assert both.lookup("groupnorm_fwd", "sm_90", key("a")).time_us == 1.0
    assert both.lookup("groupnorm_fwd", "sm_90", key("b")).time_us == 3.0
    assert InstanceDB.layered(shipped, user).lookup("groupnorm_fwd", "sm_90", key("a")).time_us == 2.0


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
    with pytest.raises(DBCorruptError) as saved:
        db.save_entries(path, [make()])
    side = saved.value.kept  # the save's entry is not lost: it waits in a side file
    assert side is not None and side.parent == tmp_path and side.name in str(saved.value)
    assert InstanceDB.load(side).entries == (make(),)
    with pytest.raises(DBCorruptError):
        db.remove_entries(path, lambda e: True)
    assert path.read_bytes() == before
    assert no_temp_files(tmp_path, {"db.yaml", side.name})


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


def test_merge_faster_wins_and_distinct_idents_kept(tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    db.save_entries(path, [make(problem="a", date="2026-11-22T10:00:00+00:00", time_us=5.0),
                           make(problem="b", time_us=7.0)])
    older = make(problem="a", date="2026-01-01T00:00:00+00:00", time_us=9.0)
    with pytest.warns(DBWarning, match="1 entry not saved"):
        merged = db.save_entries(path, [older, make(problem="c")])
    assert merged.lookup("groupnorm_fwd", "sm_90", key("a")).time_us == 5.0  # on disk is faster
    newer = make(problem="a", date="2026-12-01T00:00:00+00:00", time_us=3.0)
    db.save_entries(path, [newer])
    same_date = make(problem="b", time_us=6.0)
    db.save_entries(path, [same_date])
    d = InstanceDB.load(path)
    assert d.lookup("groupnorm_fwd", "sm_90", key("a")).time_us == 3.0
    assert d.lookup("groupnorm_fwd", "sm_90", key("b")).time_us == 6.0  # faster, same date
    assert sorted(e.problem for e in d.entries) == [key("a"), key("b"), key("c")]
    db.save_entries(path, [make(problem="c", date=None, time_us=1.5)])  # faster, no date
    assert InstanceDB.load(path).lookup("groupnorm_fwd", "sm_90", key("c")).time_us == 1.5


def _verified(problem: str = "a", time_us: float = 12.5, date: str | None = None) -> Entry:
    """An entry that holds for today's templates: the valid config nearest the default, as
    rendered for sm_90."""
    from ckgen.instance import render_instance
    from ckgen.types import Target

    op, target = get_op("groupnorm_fwd"), Target.named("sm_90")
    prob = op.problem_from_key(key(problem))
    cfg = op.space.nearest_default(lambda c: bool(op.validate(prob, c, target)))
    inst = render_instance(op, prob, cfg, target)
    e = make(problem=problem, time_us=time_us, date=date)
    return Entry(**{**e.__dict__, "config": cfg.items, "instance": inst.name, "source_sha256": inst.sha256})


def _ahead(hours: float, utc_offset_h: float = 0.0) -> str:
    """An ISO date `hours` after now, written in the time zone UTC+`utc_offset_h`."""
    import datetime as dt

    when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=hours)
    return when.astimezone(dt.timezone(dt.timedelta(hours=utc_offset_h))).isoformat(timespec="seconds")


@pytest.mark.parametrize("stored_date", [
    lambda: _ahead(2, -5),  # another machine's clock 2 h ahead, in another time zone
    lambda: _ahead(24 * 365 * 70),  # far in the future
    lambda: "yesterday",  # not ISO at all (sorts after every digit)
], ids=["2h-ahead-other-zone", "future", "not-iso"])
def test_a_fresh_faster_result_replaces_an_entry_whatever_its_date(tmp_path: Path, stored_date) -> None:
    """The stored entry's date once outranked a fresh result: a date ahead of this machine's
    clock, or text that sorts after digits, kept it for ever and the new winner was dropped."""
    path = tmp_path / "db.yaml"
    now, stored_date = _ahead(0), stored_date()
    db.save_entries(path, [make(problem="a", date=stored_date, time_us=9.0),
                           make(problem="b", date=stored_date, time_us=5.0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DBWarning)  # nothing dropped: nothing to report
        db.save_entries(path, [make(problem="a", date=now, time_us=4.0)])
    assert InstanceDB.load(path).lookup("groupnorm_fwd", "sm_90", key("a")).time_us == 4.0
    # Equally fast: a real date (not after now) outranks a future or unreadable one.
    db.save_entries(path, [make(problem="b", date="2026-01-01T00:00:00+00:00", time_us=5.0)])
    assert InstanceDB.load(path).lookup("groupnorm_fwd", "sm_90", key("b")).date == "2026-01-01T00:00:00+00:00"


def test_a_slower_result_is_not_saved_and_is_reported(tmp_path: Path) -> None:
    """As `db merge` decides: a verified entry beats an unverified one, then the faster wins; an
    entry a save did not keep is named in one DBWarning, never dropped in silence."""
    path = tmp_path / "db.yaml"
    db.save_entries(path, [make(problem="a", time_us=3.0), make(problem="b", time_us=3.0)])
    with pytest.warns(DBWarning, match=r"not saved.*groupnorm_fwd sm_90 " + key("a").replace("=", ".")) as rec:
        merged = db.save_entries(path, [make(problem="a", time_us=8.0, date="2026-12-01T00:00:00+00:00")])
    assert len(rec) == 1 and "3 us" in str(rec[0].message)
    assert merged.lookup("groupnorm_fwd", "sm_90", key("a")).time_us == 3.0
    fresh = _verified(problem="b", time_us=8.0)  # slower, but holds for today's templates
    db.save_entries(path, [fresh])
    assert InstanceDB.load(path).lookup("groupnorm_fwd", "sm_90", key("b")) == fresh


def test_filter_drops_with_one_warning() -> None:
    d = InstanceDB((make(problem="a"), make(problem="b"), make(problem="c")))
    with pytest.warns(DBWarning) as record:
        kept = d.filter(lambda e: None if e.problem == key("b") else "template hash changed")
    assert len(record) == 1
    assert "2 entries" in str(record[0].message)
    assert "template hash changed" in str(record[0].message)
    assert [e.problem for e in kept.entries] == [key("b")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert d.filter(lambda e: None) == d


def test_remove_entries(tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    assert db.remove_entries(path, lambda e: True) == 0
    db.save_entries(path, [make(problem="a"), make(problem="b"), make(arch="sm_80", problem="a")])
    assert db.remove_entries(path, lambda e: e.arch == "sm_90") == 2
    assert [e.ident for e in InstanceDB.load(path).entries] == [("groupnorm_fwd", "sm_80", key("a"))]
    assert db.remove_entries(path, lambda e: False) == 0
    assert no_temp_files(tmp_path, {"db.yaml"})


def test_export_csv_columns() -> None:
    d = InstanceDB((make(threads=128, vec_bytes=8),))
    out = io.StringIO()
    db.export_csv(d, out)
    rows = list(csv.reader(io.StringIO(out.getvalue())))
    assert rows[0] == ["op", "arch", "device", "problem", "instance", "time_us", "gbps",
                       "default_time_us", "config"]
    assert len(rows) == 2
    row = dict(zip(rows[0], rows[1]))
    assert row["problem"] == key("a")  # the commas survive quoting
    assert row["config"] == "threads=128;vec_bytes=8"
    assert float(row["time_us"]) == 12.5 and row["arch"] == "sm_90"


# ------------------------------------------------------------------ two processes, one file

SAVES_PER_PROCESS = 40


def _saver_n(tag: str, i: int) -> int:
    return 1 + i + 1000 * "ABCDEFGH".index(tag)


def _saver(path: str, tag: str, start) -> None:
    start.wait()
    for i in range(SAVES_PER_PROCESS):
        db.save_entries(path, [make(problem=_saver_n(tag, i))])


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
    assert problems == {key(_saver_n(t, i)) for t in "AB" for i in range(SAVES_PER_PROCESS)}
    assert no_temp_files(tmp_path, {"db.yaml"})


# ------------------------------------------------------------------ problem keys

BAD_KEYS = ["garbage", "N=-2,C=320,H=8,W=8,G=32,dtype=bf16,layout=nhwc,act=none",
            "N=4,C=320,H=8,W=8,G=32,dtype=int8,layout=nhwc,act=none", "N=4,C=320,H=8,W=8,G=30,dtype=bf16,layout=nhwc",
            "N=4,C=320,H=8,W=8,G=32,dtype=bf16", "N=99999999999,C=320,H=8,W=8,G=32,dtype=bf16,layout=nhwc,act=none",
            "N=4,C=320,H=8,W=8,G=32,dtype=bf16,layout=nhwc,act=none" + ",x" * 5000]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=lambda k: k[:30])
def test_entry_whose_problem_key_its_op_cannot_parse_is_skipped(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "db.yaml"
    item = make().to_dict()
    item["problem"] = bad
    write_doc(path, [make(problem="b").to_dict(), item])
    with pytest.warns(DBWarning, match="skipped 1 entry malformed") as record:
        d = InstanceDB.load(path)
    assert len(record) == 1 and len(str(record[0].message)) <= db.MAX_MESSAGE
    assert d.entries == (make(problem="b"),)
    assert "entries[1]: field 'problem'" in d.skipped[0]
    with pytest.raises(DBError, match="field 'problem'"):
        Entry.from_dict(item)


def test_entry_of_an_unknown_op_is_skipped_and_kept_on_save(tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    item = make().to_dict()
    item["op"] = "layernorm_fwd"  # e.g. written by a newer ckgen
    write_doc(path, [item])
    with pytest.warns(DBWarning, match="unknown op 'layernorm_fwd'"):
        assert InstanceDB.load(path).entries == ()
    with pytest.warns(DBWarning):
        db.save_entries(path, [make(problem="b")])
    assert item in yaml.safe_load(path.read_text())["entries"]


def test_problem_keys_are_stored_in_their_canonical_form() -> None:
    canonical = key("a")
    assert canonical.endswith(",act=none")
    e = Entry.from_dict({**make().to_dict(), "problem": canonical.replace(",act=none", "")})
    assert e.problem == canonical and e == make()


def test_malformed_keys_in_the_user_db_do_not_break_dispatch(monkeypatch) -> None:
    """The issue's repro: one bad key made the nearest-tuned fallback raise ValueError out of
    every untuned call of that op and arch."""
    import ckgen
    from ckgen import settings
    from ckgen.instance import render_instance
    from ckgen.ops.spec import Target

    op, t = get_op("groupnorm_fwd"), Target.named("sm_90")
    near = op.parse_problem(N=2, C=1280, H=16, W=16, G=32, dtype="bf16", layout="nchw")
    src = render_instance(op, near, op.space.default, t)
    good = Entry(op=op.name, vendor="cuda", arch="sm_90", device="test", problem=near.key(),
                 config=op.space.default.items, instance=src.name, source_sha256=src.sha256,
                 time_us=5.0, gbps=1.0, default_time_us=6.0)
    bad = [{**good.to_dict(), "problem": k} for k in ("garbage", BAD_KEYS[1], BAD_KEYS[2])]
    settings.user_db_path().parent.mkdir(parents=True, exist_ok=True)
    write_doc(settings.user_db_path(), [*bad, good.to_dict()])
    ckgen.reload_db()
    try:
        with pytest.warns(DBWarning, match="skipped 3 entries malformed"):
            choice = ckgen.explain("groupnorm_fwd", N=4, C=1280, H=16, W=16, G=32, dtype="bf16", layout="nchw",
                                   arch="sm_90")
        assert choice.source == "nearest" and choice.entry == good
    finally:
        ckgen.reload_db()


# ------------------------------------------------------------------ saving


def test_save_with_a_busy_lock_keeps_its_entries_in_a_side_file(tmp_path: Path, monkeypatch) -> None:
    """A save that waited LOCK_TIMEOUT_S raised filelock.Timeout and its result was lost."""
    import filelock

    path = tmp_path / "db.yaml"
    db.save_entries(path, [make(problem="a")])
    monkeypatch.setattr(db, "LOCK_TIMEOUT_S", 0.05)
    holder = filelock.FileLock(str(path) + ".lock")
    with holder:
        with pytest.warns(DBWarning, match="lock was not free") as record:
            view = db.save_entries(path, [make(problem="b"), make(problem="c")])
        assert len(record) == 1
        (side,) = db._side_files(path)
        assert side.name.startswith("db.yaml.pending-") and side.name in str(record[0].message)
        assert {e.problem for e in view} == {key("a"), key("b"), key("c")}
        assert {e.problem for e in InstanceDB.load(path)} == {key("a"), key("b"), key("c")}  # load merges it
        assert {e.problem for e in InstanceDB.load(path.with_name("x.yaml"))} == set()
    merged = db.save_entries(path, [make(problem="p1")])  # the next save folds it in
    assert {e.problem for e in merged} == {key(t) for t in ("a", "b", "c", "p1")}
    assert db._side_files(path) == []
    assert {e["problem"] for e in yaml.safe_load(path.read_text())["entries"]} == {e.problem for e in merged}
    assert no_temp_files(tmp_path, {"db.yaml"})


def _unusable_lock(lock: Path, kind: str, monkeypatch) -> None:
    """Make `lock` a lock file filelock cannot open: a folder, a link (filelock refuses to
    follow one), or a file of another user (simulated: the tests may run as root)."""
    lock.unlink(missing_ok=True)
    if kind == "folder":
        lock.mkdir()
    elif kind == "symlink":
        lock.symlink_to(lock.parent / "elsewhere")
    else:
        import filelock

        def denied(self, *args: object, **kw: object) -> None:
            raise PermissionError(13, "Permission denied", str(self.lock_file))

        monkeypatch.setattr(filelock.FileLock, "acquire", denied)


@pytest.mark.parametrize("kind", ["folder", "symlink", "other-user"])
def test_a_lock_file_that_cannot_be_opened_keeps_the_entries_in_a_side_file(tmp_path: Path, kind: str,
                                                                            monkeypatch) -> None:
    """A lock file that cannot be opened once raised out of the save: the tuned winner was lost.
    It takes the lock timeout's path: a side file and one warning naming the lock and why."""
    path = tmp_path / "db.yaml"
    db.save_entries(path, [make(problem="a")])
    _unusable_lock(tmp_path / "db.yaml.lock", kind, monkeypatch)
    with pytest.warns(DBWarning) as rec:
        view = db.save_entries(path, [make(problem="b")])
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "db.yaml.lock" in msg and ("directory" in msg or "symbolic" in msg or "denied" in msg), msg
    (side,) = db._side_files(path)
    assert side.name in msg and InstanceDB.load(side).entries == (make(problem="b"),)
    assert {e.problem for e in view} == {key("a"), key("b")}
    assert {e.problem for e in InstanceDB.load(path)} == {key("a"), key("b")}


def test_db_merge_with_an_unusable_lock_keeps_its_result_in_a_side_file(tmp_path: Path, capsys) -> None:
    u, b = tmp_path / "u.yaml", tmp_path / "b.yaml"
    db.save_entries(u, [make(problem="a")])
    db.save_entries(b, [make(problem="b")])
    _unusable_lock(tmp_path / "u.yaml.lock", "folder", None)
    assert _merge(str(b), "-o", str(u)) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "u.yaml.lock" in err, err
    assert len(db._side_files(u)) == 1 and {e.problem for e in InstanceDB.load(u)} == {key("a"), key("b")}


def test_side_files_are_folded_by_remove_and_a_newer_main_entry_wins(tmp_path: Path, monkeypatch) -> None:
    import filelock

    path = tmp_path / "db.yaml"
    monkeypatch.setattr(db, "LOCK_TIMEOUT_S", 0.01)
    with filelock.FileLock(str(path) + ".lock"), pytest.warns(DBWarning):
        db.save_entries(path, [make(problem="a", time_us=9.0, date="2026-01-01T00:00:00+00:00"),
                               make(problem="b")])
    assert not path.exists() and len(db._side_files(path)) == 1
    db.save_entries(path, [make(problem="a", time_us=1.0, date="2026-06-01T00:00:00+00:00")])
    assert InstanceDB.load(path).lookup("groupnorm_fwd", "sm_90", key("a")).time_us == 1.0
    with filelock.FileLock(str(path) + ".lock"), pytest.warns(DBWarning):
        db.save_entries(path, [make(problem="c")])
    assert db.remove_entries(path, lambda e: e.problem == key("c")) == 1  # a side file's entry too
    assert db._side_files(path) == []
    assert sorted(e.problem for e in InstanceDB.load(path)) == [key("a"), key("b")]


def _contended_saver(path: str, tag: str, start, timeout: float, n: int) -> None:
    import warnings as w

    db.LOCK_TIMEOUT_S = timeout
    w.simplefilter("ignore", DBWarning)
    start.wait()
    for i in range(n):
        db.save_entries(path, [make(problem=_saver_n(tag, i))])


def test_contended_saves_lose_nothing(tmp_path: Path) -> None:
    """Four processes, a lock timeout of 1 ms: most saves fall back to side files; every entry
    is in every later load, and one ordinary save folds all of them into the file."""
    path = tmp_path / "db.yaml"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    per = 20
    procs = [ctx.Process(target=_contended_saver, args=(str(path), tag, start, 0.001, per)) for tag in "ABCD"]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 4
    want = {key(_saver_n(t, i)) for t in "ABCD" for i in range(per)}
    assert {e.problem for e in InstanceDB.load(path).entries} == want
    db.save_entries(path, [])
    assert db._side_files(path) == []
    assert {e["problem"] for e in yaml.safe_load(path.read_text())["entries"]} == want
    assert no_temp_files(tmp_path, {"db.yaml"})


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o600, 0o664])
def test_save_keeps_the_file_mode(tmp_path: Path, mode: int) -> None:
    """Saves made the DB 0600 (temp file + rename): another user's dispatch then failed."""
    path = tmp_path / "db.yaml"
    db.save_entries(path, [make(problem="a")])
    path.chmod(mode)
    db.save_entries(path, [make(problem="b")])
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert db.remove_entries(path, lambda e: e.problem == key("b")) == 1
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_a_new_db_file_gets_the_umask_mode(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        db.save_entries(tmp_path / "new.yaml", [make()])
        os.umask(0o002)
        db.save_entries(tmp_path / "new2.yaml", [make()])
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.yaml").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "new2.yaml").stat().st_mode) == 0o664


def test_save_removes_temp_files_of_crashed_saves(tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    db.save_entries(path, [make(problem="a")])
    stale = [tmp_path / ".db.yaml.k3j_x9a1.tmp", tmp_path / ".db.yaml.save-00ff.tmp"]  # old-style and new
    old_side, young_side = tmp_path / ".db.yaml.side-aa.tmp", tmp_path / ".db.yaml.side-bb.tmp"
    other = tmp_path / ".other.yaml.k3j_x9a1.tmp"  # another DB's
    for p in (*stale, old_side, young_side, other):
        p.write_text("partial")
    hour_ago = time.time() - 3600
    os.utime(old_side, (hour_ago, hour_ago))
    db.save_entries(path, [make(problem="b")])
    assert not any(p.exists() for p in (*stale, old_side))
    assert young_side.exists() and other.exists()  # a side writer may be writing it; not ours


def test_libyaml_is_used_when_available_and_both_give_the_same_file(tmp_path: Path, monkeypatch) -> None:
    if hasattr(yaml, "CSafeLoader"):
        assert db._LOADER is yaml.CSafeLoader and db._DUMPER is yaml.CSafeDumper
    entries = [make(problem=t, threads=128 + i) for i, t in enumerate(("a", "b", "c"))]
    db.save_entries(tmp_path / "c.yaml", entries)
    monkeypatch.setattr(db, "_LOADER", yaml.SafeLoader)
    monkeypatch.setattr(db, "_DUMPER", yaml.SafeDumper)
    db.save_entries(tmp_path / "py.yaml", entries)
    assert (tmp_path / "c.yaml").read_bytes() == (tmp_path / "py.yaml").read_bytes()
    assert set(InstanceDB.load(tmp_path / "c.yaml").entries) == set(entries)


def test_shipped_db_reads_the_same_with_both_loaders(monkeypatch) -> None:
    path = db.packaged_db_path()
    fast = InstanceDB.load(path)
    monkeypatch.setattr(db, "_LOADER", yaml.SafeLoader)
    assert InstanceDB.load(path) == fast and len(fast) > 0


# ------------------------------------------------------------------ hostile YAML


def _bomb(levels: int, value: str) -> str:
    """A billion-laughs document: `levels` anchors of 9 aliases each, then `value` using the last."""
    names = "abcdefghijklmnop"[:levels]
    lines = ["bomb:", '  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"  {c}: &{c} [" + ",".join([f"*{names[i]}"] * 9) + "]" for i, c in enumerate(names[1:])]
    return "\n".join(lines) + "\n" + value.replace("BOMB", f"*{names[-1]}") + "\n"


# Deep nesting is refused by ckgen's own walk of the events, or earlier by the YAML library's
# parser (libyaml caps the depth itself from PyYAML 6.0.4 on, with its own words): either way
# a corrupt DB in ckgen's words, never the library's message text pinned here.
DEEP = "nested deeper than 32 levels|not valid YAML"


@pytest.mark.parametrize("loader", ["C", "python"])
@pytest.mark.parametrize("text, words", [
    pytest.param("schema: 1\nentries: " + "[" * 100_000 + "]" * 100_000 + "\n", DEEP, id="deep-lists"),
    pytest.param("schema: 1\nentries:\n- op: " + "{a: " * 50_000 + "1" + "}" * 50_000 + "\n", DEEP, id="deep-maps"),
    pytest.param(_bomb(9, "schema: BOMB"), "alias bomb", id="bomb-schema"),
    pytest.param(_bomb(9, "schema: 1\nentries:\n- op: BOMB"), "alias bomb", id="bomb-entry"),
    pytest.param(_bomb(9, "schema: 1\nentries: BOMB"), "alias bomb", id="bomb-entries"),
    pytest.param("schema: 1\nentries:\n- time_us: " + "9" * 5000 + "\n", "cannot be read", id="huge-int"),
])
def test_hostile_yaml_is_a_corrupt_db_with_a_bounded_message(tmp_path: Path, monkeypatch, loader: str, text: str,
                                                             words: str) -> None:
    """100,000 nested levels would raise RecursionError (and crash libyaml's loader); a 675-byte
    alias bomb would raise MemoryError if the error message rendered the whole value."""
    if loader == "python":
        monkeypatch.setattr(db, "_LOADER", yaml.SafeLoader)
    path = tmp_path / "db.yaml"
    path.write_text(text)
    with pytest.raises(DBCorruptError, match=words) as info:
        InstanceDB.load(path)
    assert len(str(info.value)) < 1000
    with pytest.raises(DBCorruptError):
        db.save_entries(path, [make()])
    assert path.read_text() == text


def test_a_small_alias_structure_in_an_entry_is_skipped_with_a_bounded_reason(tmp_path: Path) -> None:
    """Below the node limit (9^5 expanded) an alias structure is an ordinary malformed entry:
    skipped with a short reason (the value is not rendered whole), kept compact (aliases, not
    expanded) by a save."""
    path = tmp_path / "db.yaml"
    entry = {**make().to_dict(), "op": "@@"}
    doc = yaml.safe_dump({"schema": 1, "entries": [entry]}, sort_keys=False).replace("op: '@@'", "op: BOMB")
    path.write_text(_bomb(5, doc + "- BOMB"))
    with pytest.warns(DBWarning, match="skipped 2 entries") as record:
        d = InstanceDB.load(path)
    assert d.entries == () and len(str(record[0].message)) <= db.MAX_MESSAGE
    assert "field 'op': expected a non-empty string, got [[[" in d.skipped[0] and len(d.skipped[0]) < 200
    with pytest.warns(DBWarning):
        db.save_entries(path, [make()])
    assert path.stat().st_size < 20_000
    with pytest.warns(DBWarning):
        assert len(InstanceDB.load(path).skipped) == 2


# ------------------------------------------------------------------ a corrupt user DB


def test_corrupt_user_db_warns_once_and_the_shipped_db_is_used(tmp_path: Path, monkeypatch) -> None:
    user, shipped = tmp_path / "user.yaml", tmp_path / "shipped.yaml"
    db.save_entries(shipped, [make(problem="a"), make(problem="b")])
    monkeypatch.setenv("CKGEN_SHIPPED_DB", str(shipped))
    user.write_text("schema: 1\nentries:\n  - op: [unclosed\n")
    before = user.read_bytes()
    with pytest.warns(DBWarning, match="user.yaml: not valid YAML") as record:
        view = db.load_layered(user)
    assert len(record) == 1 and "not used" in str(record[0].message)
    assert {e.problem for e in view} == {key("a"), key("b")}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DBWarning)  # once per file version
        assert db.load_layered(user) == view
    with pytest.raises(DBCorruptError):
        db.load_layered(user, strict=True)
    with pytest.raises(DBCorruptError) as saved:  # a save into it: kept beside it, used by the view
        db.save_entries(user, [make(problem="c")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DBWarning)
        assert {e.problem for e in db.load_layered(user)} == {key("a"), key("b"), key("c")}
    assert user.read_bytes() == before
    user.write_text("")  # fixed (here: emptied): the next save folds the side file in
    db.save_entries(user, [])
    assert not saved.value.kept.exists()
    assert {e.problem for e in InstanceDB.load(user)} == {key("c")}


def test_corrupt_user_db_does_not_break_dispatch(monkeypatch, tmp_path: Path) -> None:
    """Every op call failed: the dispatcher's view raised DBCorruptError."""
    import ckgen
    from ckgen import settings
    from ckgen.instance import render_instance
    from ckgen.ops.spec import Target

    op, t = get_op("groupnorm_fwd"), Target.named("sm_90")
    p = op.parse_problem(N=4, C=1280, H=16, W=16, G=32, dtype="bf16", layout="nchw")
    src = render_instance(op, p, op.space.default, t)
    shipped = tmp_path / "shipped.yaml"
    db.save_entries(shipped, [Entry(op=op.name, vendor="cuda", arch="sm_90", device="test", problem=p.key(),
                                    config=op.space.default.items, instance=src.name, source_sha256=src.sha256,
                                    time_us=5.0, gbps=1.0, default_time_us=6.0)])
    monkeypatch.setenv("CKGEN_SHIPPED_DB", str(shipped))
    settings.user_db_path().parent.mkdir(parents=True, exist_ok=True)
    settings.user_db_path().write_text("- not\n- a DB\n")
    ckgen.reload_db()
    try:
        with pytest.warns(DBWarning, match="not a mapping"):
            choice = ckgen.explain("groupnorm_fwd", N=4, C=1280, H=16, W=16, G=32, dtype="bf16", layout="nchw",
                                   arch="sm_90")
        assert choice.source == "tuned"
    finally:
        ckgen.reload_db()
    assert settings.user_db_path().read_text() == "- not\n- a DB\n"


# ------------------------------------------------------------------ merges into a live DB, links, special files


def _merge(*argv: str) -> int:
    from ckgen import cli

    return cli.main(["db", "merge", *argv])


def test_db_merge_into_a_db_keeps_what_others_save_while_it_verifies(tmp_path: Path, monkeypatch) -> None:
    """`db merge U B -o U` verifies every entry (a render each) before it writes: entries another
    process saved to U meanwhile were replaced away. Here a save lands during each of the first
    verifications."""
    import ckgen.instance

    u, b = tmp_path / "u.yaml", tmp_path / "b.yaml"
    db.save_entries(u, [make(problem=n) for n in (1, 2)])
    db.save_entries(b, [make(problem=n) for n in (3, 4)])
    real, saved = ckgen.instance.render_instance, []

    def render_while_another_saves(*args: object, **kw: object) -> object:
        if len(saved) < 3:
            saved.append(make(problem=10 + len(saved)))
            db.save_entries(u, [saved[-1]])
        return real(*args, **kw)

    monkeypatch.setattr(ckgen.instance, "render_instance", render_while_another_saves)
    assert _merge(str(u), str(b), "-o", str(u)) == 0
    assert len(saved) == 3
    assert {e.problem for e in InstanceDB.load(u)} == {key(n) for n in (1, 2, 3, 4, 10, 11, 12)}


def test_db_merge_on_a_full_disk_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    """ENOSPC while `db merge` wrote its output ended in a traceback."""
    import errno

    out, b = tmp_path / "out.yaml", tmp_path / "b.yaml"
    db.save_entries(out, [make(problem="a")])
    db.save_entries(b, [make(problem="b")])
    before = out.read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(db.os, "fsync", full)
    assert _merge(str(b), "-o", str(out)) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"ckgen db merge: no space left on device writing {out}"], err
    assert out.read_bytes() == before and no_temp_files(tmp_path, {"out.yaml", "b.yaml"})


def test_db_merge_into_a_db_keeps_its_malformed_items(tmp_path: Path, capsys) -> None:
    u, b = tmp_path / "u.yaml", tmp_path / "b.yaml"
    bad = make(problem="bad").to_dict()
    del bad["gbps"]
    write_doc(u, [make(problem="a").to_dict(), bad])
    db.save_entries(b, [make(problem="b")])
    assert _merge(str(u), str(b), "-o", str(u)) == 0
    entries = yaml.safe_load(u.read_text())["entries"]
    assert bad in entries and len(entries) == 3  # kept verbatim for a hand fix, as a save keeps it
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(warned) == 1 and "missing field 'gbps'" in warned[0]  # once, though the file is read twice


def test_db_merge_into_a_corrupt_db_leaves_it_untouched(tmp_path: Path, capsys) -> None:
    out, b = tmp_path / "out.yaml", tmp_path / "b.yaml"
    out.write_text("schema: 1\nentries: [unclosed\n")
    db.save_entries(b, [make(problem="b")])
    assert _merge(str(b), "-o", str(out)) == 2
    assert out.read_text() == "schema: 1\nentries: [unclosed\n"
    assert "left untouched" in capsys.readouterr().err


_ACKED_PER_WRITER = 10


def _acking_writer(path: str, w: int, n: int, acks: str, start) -> None:
    """Save entries one by one; after each save returns, its problem number goes to `acks`
    (O_APPEND writes survive a SIGKILL)."""
    fd = os.open(acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    start.wait()
    for i in range(n):
        number = 100 + 100 * w + i
        db.save_entries(path, [make(problem=number)])
        os.write(fd, f"{number}\n".encode())


def _merger(path: str, other: str, stop, merges) -> None:
    import warnings as w

    w.simplefilter("ignore")
    while not stop.is_set():
        code = _merge(path, other, "-o", path)
        with merges.get_lock():
            merges.value += 1 if code == 0 else 1000  # a failed merge shows in the count


def test_merges_while_eight_writers_save_lose_no_acknowledged_entry(tmp_path: Path) -> None:
    """8 writer processes save into U one entry at a time while 2 processes run `db merge U B -o
    U` in a loop; one writer is killed with SIGKILL mid-run. Every entry whose save returned is in
    U at the end, and so is every entry of B; U reads back without a skipped item."""
    import signal

    path, other = tmp_path / "u.yaml", tmp_path / "b.yaml"
    db.save_entries(path, [make(problem=n) for n in (1, 2)])
    db.save_entries(other, [make(problem=n) for n in range(3, 9)])
    ctx = multiprocessing.get_context("fork")  # 10 interpreters spawned would take most of the budget
    start, stop, merges = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
    acks = [tmp_path / f"acks-{w}.txt" for w in range(8)]
    victim = 0
    writers = [ctx.Process(target=_acking_writer, args=(str(path), w, 10_000 if w == victim else _ACKED_PER_WRITER,
                                                        str(acks[w]), start)) for w in range(8)]
    mergers = [ctx.Process(target=_merger, args=(str(path), str(other), stop, merges)) for _ in range(2)]
    for p in writers + mergers:
        p.start()
    start.set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not acks[victim].exists() or len(acks[victim].read_text().split()) < 3):
        time.sleep(0.01)
    os.kill(writers[victim].pid, signal.SIGKILL)
    for p in writers:
        p.join(timeout=60)
    stop.set()
    for p in mergers:
        p.join(timeout=60)
    assert writers[victim].exitcode == -signal.SIGKILL
    assert [p.exitcode for p in writers if p is not writers[victim]] == [0] * 7
    assert [p.exitcode for p in mergers] == [0, 0]
    assert 2 <= merges.value < 1000  # merges ran meanwhile, and none failed
    acked = {int(n) for a in acks for n in a.read_text().split()}
    assert len(acked) >= 7 * _ACKED_PER_WRITER + 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", DBWarning)  # nothing skipped: the file is whole
        got = {e.problem for e in InstanceDB.load(path).entries}
    assert {key(n) for n in acked} - got == set()
    assert {key(n) for n in range(1, 9)} <= got


def test_a_save_through_a_symlink_writes_and_locks_its_target(tmp_path: Path) -> None:
    target, link = tmp_path / "real" / "db.yaml", tmp_path / "link.yaml"
    target.parent.mkdir()
    db.save_entries(target, [make(problem="a")])
    link.symlink_to(target)
    db.save_entries(link, [make(problem="b")])
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert {e.problem for e in InstanceDB.load(target)} == {key("a"), key("b")}
    assert (target.parent / "db.yaml.lock").exists() and not (tmp_path / "link.yaml.lock").exists()
    assert db.remove_entries(link, lambda e: e.problem == key("a")) == 1
    assert link.is_symlink() and {e.problem for e in InstanceDB.load(link)} == {key("b")}
    dangling = tmp_path / "dangling.yaml"  # a link to a file not there yet: the file is created
    dangling.symlink_to(tmp_path / "new" / "db.yaml")
    db.save_entries(dangling, [make(problem="c")])
    assert dangling.is_symlink() and (tmp_path / "new" / "db.yaml").is_file()


def test_db_merge_output_through_a_symlink_writes_its_target(tmp_path: Path) -> None:
    a, target, link = tmp_path / "a.yaml", tmp_path / "t.yaml", tmp_path / "link.yaml"
    db.save_entries(a, [make(problem="a")])
    link.symlink_to(target)
    assert _merge(str(a), "-o", str(link)) == 0
    assert link.is_symlink() and {e.problem for e in InstanceDB.load(target)} == {key("a")}


def test_saves_refuse_what_is_not_a_regular_file(tmp_path: Path) -> None:
    """A FIFO or a socket (or a device: `-o /dev/null` as root replaced the node) is not
    replaced by a DB file; the error names the kind."""
    import socket

    fifo, sock = tmp_path / "fifo", tmp_path / "sock"
    os.mkfifo(fifo)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    try:
        for path, kind in ((fifo, "a FIFO"), (sock, "a socket")):
            with pytest.raises(db.DBPathError, match=f"is {kind}, not a regular file"):
                db.save_entries(path, [make()])
            with pytest.raises(db.DBPathError):
                db.write_db(path, [make()])
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and stat.S_ISSOCK(os.lstat(sock).st_mode)
    finally:
        s.close()
    assert db.destination_problem("/dev/null").startswith("is a character device")


def test_a_save_into_a_folder_that_takes_no_file_fails_at_once(tmp_path: Path) -> None:
    """Not after LOCK_TIMEOUT_S waiting for a lock file that cannot be created."""
    (tmp_path / "file").write_text("")
    for path in (tmp_path / "file" / "db.yaml", Path("/proc/ckgen-test/db.yaml")):
        t0 = time.monotonic()
        with pytest.raises(db.DBPathError, match="cannot be written"):
            db.save_entries(path, [make()])
        assert time.monotonic() - t0 < 5


def _load_in_a_subprocess(path: Path) -> subprocess.CompletedProcess:
    """`InstanceDB.load(path)` and the dispatcher's `load_layered(path)` in a child with 1 GiB
    of address space and 30 s: a read that blocks or does not end fails, it does not hang the run."""
    code = ("import resource, warnings, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
            "from ckgen.runtime import db\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    assert db.load_layered(sys.argv[1]).entries == ()\n"
            "print('layered:', w[0].message if w else 'no warning')\n"
            "db.InstanceDB.load(sys.argv[1])\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=30, env=env)


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_a_fifo_or_device_db_is_refused_not_read(tmp_path: Path, special: str) -> None:
    """$CKGEN_DB a FIFO blocked every op call for ever; /dev/zero read without bound."""
    path = Path(special)
    if special == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
    try:
        r = _load_in_a_subprocess(path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading {path} blocked")
    kind = "a FIFO" if special == "fifo" else "a character device"
    assert f"layered: instance DB {path}: is {kind}, not a regular file" in r.stdout, r.stderr[-2000:]
    assert r.returncode == 1 and "DBCorruptError" in r.stderr and "MemoryError" not in r.stderr


def test_a_db_file_over_the_size_bound_is_corrupt_not_read(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "db.yaml"
    db.save_entries(path, [make(problem=n) for n in range(1, 6)])
    size = path.stat().st_size
    monkeypatch.setattr(db, "MAX_FILE_BYTES", size - 1, raising=False)
    with pytest.raises(DBCorruptError, match=f"{size:,} bytes, over the {size - 1:,}"):
        InstanceDB.load(path)
    monkeypatch.setattr(db, "MAX_FILE_BYTES", size, raising=False)
    assert len(InstanceDB.load(path)) == 5


# ------------------------------------------------------------------ the parse cache (issue 53)


def _big_db(path: Path, n: int = 160, malformed: list | None = None) -> None:
    """A DB file over PARSED_MIN_BYTES (n entries of ~500 bytes), with `malformed` items appended."""
    entries = [make(problem=i, threads=128, vec_bytes=16, time_us=10.0 + i / 7) for i in range(1, n + 1)]
    text = db._dump(entries, malformed or [])
    path.write_text(text, encoding="utf-8")
    assert path.stat().st_size >= db.PARSED_MIN_BYTES


def _parsed_files() -> list[Path]:
    folder = db._parsed_dir()
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def _read_as_parsed(path: Path, monkeypatch) -> str:
    """repr of what `_read` makes of the file with the cache out of the way (types exact)."""
    with monkeypatch.context() as m:
        m.setattr(db, "_parsed_get", lambda raw: None)
        m.setattr(db, "_parsed_put", lambda raw, contents: None)
        return repr(db._read(path))


def test_a_large_db_is_read_back_from_the_parse_cache_exactly(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "db.yaml"
    _big_db(path, malformed=[{"op": "nope", "n": [1, 2.5, True, None, "x"]}, "just text"])
    want = _read_as_parsed(path, monkeypatch)
    with pytest.warns(DBWarning, match="skipped 2 entries"):
        first = InstanceDB.load(path)
    assert len(first) == 160 and len(_parsed_files()) == 1
    with monkeypatch.context() as m:
        m.setattr(db, "_parse", lambda *a: pytest.fail("parsed again"))
        with pytest.warns(DBWarning, match="skipped 2 entries"):
            again = InstanceDB.load(path)
        assert repr(db._read(path)) == want  # value kinds too (1 vs 1.0 vs True)
    assert again == first and repr(again) == repr(first)
    # a save writes the malformed items back as read from the cache
    with pytest.warns(DBWarning):
        db.save_entries(path, [make(problem=500)])
    assert yaml.safe_load(path.read_text())["entries"][-2:] == [{"op": "nope", "n": [1, 2.5, True, None, "x"]},
                                                                "just text"]


def test_a_changed_or_corrupted_db_is_never_read_from_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    _big_db(path)
    assert len(InstanceDB.load(path)) == 160 and _parsed_files()
    text = path.read_text()
    path.write_text(text.replace("time_us: 10.142857142857142", "time_us: 99.5", 1))  # one value changed
    assert 99.5 in {e.time_us for e in InstanceDB.load(path)}
    for corrupt in (text[: len(text) // 2] + "\n  - [", text.replace("schema: 1", "schema: 2"), text + "\0"):
        path.write_text(corrupt)
        with pytest.raises(DBCorruptError):
            InstanceDB.load(path)
    path.write_text(text)
    assert len(InstanceDB.load(path)) == 160


def _counting_dumps(monkeypatch) -> list[int]:
    """How many DB items each yaml.dump call of the DB module represents (its cost)."""
    dumped: list[int] = []
    real = db.yaml.dump

    def counting(data, *args, **kw):
        dumped.append(len(data["entries"]) if isinstance(data, dict) else len(data))
        return real(data, *args, **kw)

    monkeypatch.setattr(db.yaml, "dump", counting)
    return dumped


def test_a_write_to_a_large_db_dumps_only_the_new_entries_and_refreshes_the_cache(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """A save of one entry into a 20,000-entry DB re-dumped every entry (7-20 s of CPU under the
    lock), and the next process parsed the whole file again (~12 s): writers did not refresh the
    parse cache. A write now re-uses the text of the entries the file holds and keeps what it
    wrote in the parse cache; the file is byte for byte what a full dump writes."""
    path = tmp_path / "db.yaml"
    _big_db(path)
    InstanceDB.load(path)  # parsed once, and cached
    with monkeypatch.context() as m:
        dumped = _counting_dumps(m)
        m.setattr(db, "_parse", lambda *a: pytest.fail("parsed"))
        new, changed = make(problem=500), make(problem=3, threads=128, vec_bytes=16, time_us=1.0)
        db.save_entries(path, [new, changed])  # one new, one replaced
        assert db.remove_entries(path, lambda e: e.problem == key(7)) == 1
        merged, _, _ = db.merge_into(path, InstanceDB((make(problem=501),)), verified=lambda e: False)
        loaded = InstanceDB.load(path)  # a later process: from the cache
        assert sum(dumped) == 3, dumped  # the new entries, once each
    assert new in loaded.entries and changed in loaded.entries and len(loaded) == 161
    assert loaded.entries == merged.entries
    assert path.read_text() == db._dump(loaded.entries)


def test_a_write_keeps_a_hand_edited_db_exact(tmp_path: Path, monkeypatch) -> None:
    """A file not in the form ckgen writes (edited by hand: another order, comments, malformed
    items between entries) is dumped whole, as before."""
    path = tmp_path / "db.yaml"
    _big_db(path)
    text = path.read_text()
    first = text.index("\n- ") + 1
    second = text.index("\n- ", first) + 1
    edited = text[:first] + "- {op: nope}\n" + text[first:second] + "# a comment\n" + text[second:]
    path.write_text(edited)
    with pytest.warns(DBWarning):
        InstanceDB.load(path)
        db.save_entries(path, [make(problem=500)])
    with pytest.warns(DBWarning):
        loaded = InstanceDB.load(path)
    assert len(loaded) == 161 and path.read_text() == db._dump(loaded.entries, [{"op": "nope"}])


SPOILS = ["not json", "truncated", "deep", "wrong key", "nan time", "bad config", "unsorted config", "short column",
          "empty op", "skipped count", "directory", "int text", "count", "spread text", "config index", "config size",
          "provenance list", "keys not a list", "no columns", "row format"]


@pytest.mark.parametrize("spoil", SPOILS)
def test_a_spoiled_cache_file_is_ignored(tmp_path: Path, monkeypatch, spoil: str) -> None:
    """A cache file that is unreadable or fails the structural check is not used: the YAML is
    parsed (and the cache file rewritten where it can be)."""
    import json

    path = tmp_path / "db.yaml"
    _big_db(path)
    want = _read_as_parsed(path, monkeypatch)
    InstanceDB.load(path)
    [cached] = _parsed_files()
    doc = json.loads(cached.read_text())
    cols = doc["entries"]
    text, numbers, (config_keys, config_of, config_values) = cols["text"], cols["numbers"], cols["config"]
    if spoil == "not json":
        cached.write_text("{]")
    elif spoil == "truncated":
        cached.write_text(cached.read_text()[:-100])
    elif spoil == "deep":
        cached.write_text("[" * 200_000 + "]" * 200_000)
    elif spoil == "directory":
        cached.unlink()
        cached.mkdir()
    else:
        if spoil == "wrong key":
            doc["key"] = "0" * 64
        elif spoil == "nan time":
            numbers[0][3] = float("nan")
        elif spoil == "bad config":
            config_values[3][config_keys[config_of[3]].index("threads")] = [128]
        elif spoil == "unsorted config":
            config_keys[config_of[3]].reverse()
        elif spoil == "short column":
            del text[4][-1]
        elif spoil == "empty op":
            text[0][3] = ""
        elif spoil == "skipped count":
            doc["skipped"].append("entries[9]: made up")
        elif spoil == "int text":
            text[6][3] = 7
        elif spoil == "count":
            cols["n"] += 1
        elif spoil == "spread text":
            numbers[-1][3] = "0.1"
        elif spoil == "config index":
            config_of[3] = len(config_keys)
        elif spoil == "config size":
            config_values[3].append(1)
        elif spoil == "provenance list":
            cols["provenance"][2][3] = [[1]]
        elif spoil == "keys not a list":
            config_keys[config_of[3]] = "threads"
        elif spoil == "no columns":
            del cols["numbers"]
        elif spoil == "row format":  # the entries as rows of their fields
            doc["entries"] = [list(r) for r in zip(*text)]
        cached.write_text(json.dumps(doc))
        with pytest.raises(ValueError):
            db._parsed_contents(json.loads(cached.read_text()), cached.stem)
    assert repr(db._read(path)) == want
    if spoil != "directory":  # rewritten by the read that parsed
        assert repr(db._parsed_contents(json.loads(cached.read_text()), cached.stem)) == want


def test_the_cache_holds_the_entries_by_column(tmp_path: Path) -> None:
    """One list per field, a config or provenance as its key list's index and its values: the
    JSON holds a few objects per entry, not one per config item (it loads in a few ms)."""
    import json

    path = tmp_path / "db.yaml"
    _big_db(path)
    InstanceDB.load(path)
    [cached] = _parsed_files()
    cols = json.loads(cached.read_text())["entries"]
    assert cols["n"] == 160 and cols["text"][0] == [e.op for e in InstanceDB.load(path)]
    keys, of, values = cols["config"]
    assert keys == [["threads", "vec_bytes"]] and of == [0] * 160 and values[0] == [128, 16]


def test_the_cache_follows_the_loader_and_skips_what_json_would_change(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "db.yaml"
    _big_db(path)
    InstanceDB.load(path)
    monkeypatch.setattr(db, "_LOADER", yaml.SafeLoader)  # another reader of the bytes: another key
    InstanceDB.load(path)
    assert len(_parsed_files()) == 2
    # malformed items JSON cannot hold as they are (a date, an int key, an alias) are not cached
    for item in ({"op": "x", "when": __import__("datetime").date(2026, 1, 2)}, {1: "int key"}):
        other = tmp_path / f"db{len(_parsed_files())}.yaml"
        _big_db(other, malformed=[item])
        with pytest.warns(DBWarning):
            assert len(InstanceDB.load(other)) == 160
    assert len(_parsed_files()) == 2
    shared = {"op": "x"}
    assert not db._json_exact([shared, shared]) and db._json_exact([{"op": "x"}, {"op": "x"}])


def test_an_unusable_cache_folder_does_not_stop_a_load(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "db.yaml"
    _big_db(path)
    (tmp_path / "not-a-folder").write_text("x")
    monkeypatch.setenv("CKGEN_CACHE_DIR", str(tmp_path / "not-a-folder"))
    assert len(InstanceDB.load(path)) == 160 and len(InstanceDB.load(path)) == 160


def test_the_cache_keeps_its_newest_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(parsecache, "KEEP", 3)
    for i in range(5):
        _big_db(tmp_path / "db.yaml", n=160 + i)
        InstanceDB.load(tmp_path / "db.yaml")
        os.utime(_parsed_files()[0].parent, None)
    assert len(_parsed_files()) == 3


def test_writers_cache_what_they_write_not_what_they_replace(tmp_path: Path) -> None:
    """A writer's read is of the file it replaces: not kept. What it writes is, for the next
    reader."""
    path = tmp_path / "db.yaml"
    _big_db(path)
    replaced = path.read_bytes()
    db.save_entries(path, [make(problem=500)])
    db.remove_entries(path, lambda e: e.problem == key(500))
    names = {f.stem for f in _parsed_files()}
    assert db._parsed_key(path.read_bytes()) in names and db._parsed_key(replaced) not in names
