"""Reading tuning records (ckgen/model/records.py `read`), CPU tier: a line no JSON parser can take
whole (nested deeper than the interpreter's recursion limit) is one more malformed line; the
records' kernel_version (written, migrated from a legacy record's date, read by the cost model)."""
from __future__ import annotations

import json
import warnings

from ckgen.model import records
from ckgen.ops import get_op
from ckgen.ops.spec import Config, Target


def _line(N: int) -> str:
    op = get_op("groupnorm_fwd")
    p = op.parse_problem(N=N, C=64, H=8, W=8, G=8, dtype="fp16", layout="nhwc")
    rec = records.make_record(op, p, Target.named("sm_90"), "test device", op.space.default, ok=True, time_us=3.5)
    return json.dumps(rec)


def test_a_deeply_nested_line_is_skipped_not_fatal(tmp_path):
    deep = "[" * 200_000 + "]" * 200_000
    deep_obj = '{"op": ' + "{\"a\": " * 100_000 + "1" + "}" * 100_000 + "}"
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join([_line(1), deep, _line(2), deep_obj, _line(3)]) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = records.read(path)
    assert [r["problem"].split(",")[0] for r in got] == ["N=1", "N=2", "N=3"]
    mine = [w for w in caught if issubclass(w.category, records.RecordsWarning)]
    assert len(mine) == 1 and "skipped 2 malformed line(s)" in str(mine[0].message)
    assert "line 2" in str(mine[0].message) and "nested" in str(mine[0].message)


# ------------------------------------------------------------------ appends after a torn line


def _problems(path) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", records.RecordsWarning)  # no malformed line left
        return [r["problem"].split(",")[0] for r in records.read(path)]


def test_an_append_after_a_torn_line_starts_a_fresh_line(tmp_path):
    """An append cut by a full disk or a kill leaves a partial last line; the next append was
    glued to it and both were skipped. The torn tail is cut back under the lock."""
    path = tmp_path / "records.jsonl"
    path.write_text(_line(1) + "\n" + _line(2)[:40])
    records.append(path, [json.loads(_line(3))])
    assert _problems(path) == ["N=1", "N=3"]
    assert path.read_text().endswith("\n")


def test_an_append_after_a_whole_record_without_its_newline_keeps_it(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(_line(1))  # cut just before its newline: the record is whole
    records.append(path, [json.loads(_line(2))])
    assert _problems(path) == ["N=1", "N=2"]


# ------------------------------------------------------------------ files that are not records files


def test_a_fifo_or_a_device_as_records_file_is_one_warning_not_a_hang(tmp_path, no_hang):
    """A FIFO at the records path hung explain, calls and the model fit (read waited for a
    writer); /dev/zero was read without bound. Only a regular file of bounded size is read."""
    import os

    fifo = tmp_path / "instances.records.jsonl"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        with no_hang(5), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert records.read(path) == [] and records.read_cached(path) == []
        mine = [str(w.message) for w in caught if issubclass(w.category, records.RecordsWarning)]
        assert mine and "not a regular file" in mine[0], mine
    with no_hang(5):  # an append does not wait for a reader either
        try:
            records.append(fifo, [json.loads(_line(1))])
        except OSError as e:
            assert "not a regular file" in str(e)


def test_a_records_file_over_the_bound_is_not_read(tmp_path, monkeypatch):
    import gzip

    monkeypatch.setattr(records, "MAX_RECORDS_BYTES", 1000)
    big = tmp_path / "big.jsonl"
    big.write_text((_line(1) + "\n") * 10)
    bomb = tmp_path / "bomb.jsonl.gz"
    bomb.write_bytes(gzip.compress(((_line(1) + "\n") * 10).encode()))  # small, but over the bound unpacked
    for path in (big, bomb):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert records.read(path) == []
        assert any("over" in str(w.message) for w in caught), [str(w.message) for w in caught]


# ------------------------------------------------------------------ kernel_version


def test_records_carry_the_kernel_version(tmp_path):
    """A record written now says the kernels' version; `read` keeps it."""
    rec = json.loads(_line(1))
    assert rec["kernel_version"] == records.KERNEL_VERSION
    path = tmp_path / "new.jsonl"
    records.append(path, [rec])
    assert records.read(path)[0]["kernel_version"] == records.KERNEL_VERSION


def test_legacy_records_are_migrated_once_by_their_date(tmp_path):
    """A record without the field (written before it existed) gets it from the legacy migration
    rule as it is read: dated from LEGACY_V2_FROM_DATE on, version 2; older or undated, 1. A
    record that carries its version keeps it, whatever its date."""
    since = records.LEGACY_V2_FROM_DATE
    old, new, undated, says = (json.loads(_line(n)) for n in (1, 2, 3, 4))
    for rec in (old, new, undated):
        del rec["kernel_version"]
    before = f"{int(since[:4]) - 1}{since[4:]}"  # a year before the rule's time
    old["date"], new["date"], says["date"] = before, since + ":00+00:00", before
    del undated["date"]
    says["kernel_version"] = 2
    path = tmp_path / "legacy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (old, new, undated, says)))
    got = records.read(path)
    assert [r["kernel_version"] for r in got] == [1, 2, 1, 2]
    assert records.kernel_version({"date": since}) == 2
    assert records.kernel_version({"kernel_version": 1, "date": since}) == 1


def test_a_bad_or_newer_kernel_version_is_a_skipped_line(tmp_path):
    lines = []
    for v in (0, "2", True, records.KERNEL_VERSION + 1):
        rec = json.loads(_line(1))
        rec["kernel_version"] = v
        lines.append(json.dumps(rec))
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines + [_line(2)]) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = records.read(path)
    assert [r["problem"].split(",")[0] for r in got] == ["N=2"]
    assert "skipped 4 malformed line(s)" in str(caught[0].message) and "kernel_version" in str(caught[0].message)


def test_the_shipped_records_say_their_kernel_version():
    """The packaged records carry the field (tools/build_records.py writes it), so reading them
    needs no date."""
    import gzip

    raw = gzip.decompress(records.packaged_records_path().read_bytes()).decode().splitlines()
    versions = {json.loads(line).get("kernel_version") for line in raw[:: max(1, len(raw) // 2000)]}
    assert versions <= set(range(1, records.KERNEL_VERSION + 1)) and None not in versions


def test_the_cost_model_reads_the_version_not_the_date():
    """The fit counts a record's NCHW backward chain by its kernel version: a record dated today
    that says version 1 ran the wide rows."""
    from ckgen import model as cm
    from ckgen.model.fit import _prepare

    op = get_op("groupnorm_bwd")
    p = op.parse_problem(N=1, C=64, H=64, W=64, G=32, dtype="bf16", layout="nchw")
    target = Target.named("sm_90")
    recs = []
    for v in (1, 2):
        for c in op.space.enumerate():
            differs = cm.chain_steps(op, p, c, True) != cm.chain_steps(op, p, c, False)
            if op.validate(p, c, target) and differs:
                recs.append(records.make_record(op, p, target, "test", c, ok=True, time_us=10.0, kernel_version=v))
                break
    assert len(recs) == 2 and recs[0]["date"][:4] == recs[1]["date"][:4]
    _, geos = _prepare(recs)
    assert geos[0] != geos[1]
    assert geos[0] == cm.geometry(op, p, Config.of(recs[0]["config"]), target, narrow_rows=False)
    assert geos[1] == cm.geometry(op, p, Config.of(recs[1]["config"]), target, narrow_rows=True)
