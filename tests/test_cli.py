"""CPU tests of the command line (`ckgen tune | list | db show | db export`), in process through
ckgen.cli.main and as `python -m ckgen.cli` in a subprocess."""
from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckgen.runtime import db as dbmod
from ckgen.instance import render_instance
from ckgen.ops import all_ops, get_op
from ckgen.ops.spec import Target
from ckgen.runtime.target import gpu_status

REPO = Path(__file__).resolve().parents[1]
OP = get_op("groupnorm_fwd")
TUNE = ["tune", "groupnorm_fwd", "--shape", "8,320,64,64", "--groups", "32"]
needs_no_gpu = pytest.mark.skipif(gpu_status() is None, reason="a GPU is usable here: tune would run")


def make_entries(n: int = 2) -> list[dbmod.Entry]:
    out = []
    t = Target.named("sm_90")
    for i in range(n):
        p = OP.parse_problem(N=2 + i, C=320, H=64, W=64, G=32, dtype="bf16", layout="nchw")
        src = render_instance(OP, p, OP.space.default, t)
        out.append(dbmod.Entry(op=OP.name, vendor="cuda", arch="sm_90", device="Test GPU", problem=p.key(),
                               config=OP.space.default.items, instance=src.name, source_sha256=src.sha256,
                               time_us=10.0 + i, gbps=1500.0, default_time_us=12.0))
    return out


@pytest.fixture
def db_file(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere" / "tuned.yaml"
    dbmod.save_entries(path, make_entries())
    return path


@pytest.fixture
def corrupt(tmp_path: Path) -> Path:
    path = tmp_path / "corrupt.yaml"
    path.write_text("schema: 1\nentries:\n  - op: [unclosed\n")
    return path


def tsv(out: str) -> list[list[dict[str, str]]]:
    """The tables of a tsv output: one list of row dicts per table (tables are separated by one
    empty line; each starts with its header line, after a `# name: title` caption when there
    are several)."""
    tables = []
    blocks = out.strip("\n").split("\n\n")
    for block in blocks:
        lines = block.split("\n")
        if len(blocks) > 1:
            assert lines[0].startswith("# "), block
            lines = lines[1:]
        head = lines[0].split("\t")
        rows = [ln.split("\t") for ln in lines[1:]]
        assert all(len(r) == len(head) for r in rows), block
        tables.append([dict(zip(head, r)) for r in rows])
    return tables


def run_sub(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("CKGEN_")}
    e.update(CKGEN_CACHE_DIR=str(tmp_path / "sub-cache"), CKGEN_DB=str(tmp_path / "sub-cache" / "instances.yaml"),
             CKGEN_SHIPPED_DB=str(tmp_path / "no-shipped-db.yaml"),
             PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
             COLUMNS="400", NO_COLOR="1")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "ckgen.cli", *args], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------ tune without a GPU


@needs_no_gpu
def test_tune_without_gpu_inprocess(inproc) -> None:
    code, out, err = inproc(*TUNE)
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("ckgen tune: no usable GPU (") and lines[0].count("usable") == 1
    assert out == ""


@needs_no_gpu
def test_tune_without_gpu_subprocess(tmp_path: Path) -> None:
    r = run_sub(tmp_path, *TUNE)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "no usable GPU" in lines[0]
    assert "Traceback" not in r.stderr
    assert r.stdout == ""
    assert not (tmp_path / "sub-cache" / "instances.yaml").exists(), "nothing tuned, nothing written"


def test_tune_unknown_op(inproc, tmp_path: Path) -> None:
    code, out, err = inproc("tune", "nosuchop")
    assert code == 2
    assert "nosuchop" in err and "groupnorm_fwd" in err  # names it and what is known
    r = run_sub(tmp_path, "tune", "nosuchop")
    assert r.returncode == 2 and "nosuchop" in r.stderr and "Traceback" not in r.stderr


def test_tune_shape_needs_four_numbers(inproc, tmp_path: Path) -> None:
    code, _, err = inproc("tune", "groupnorm_fwd", "--shape", "8,320,64", "--groups", "32")
    assert code == 2
    assert "N,C,H,W" in err and "--shape" in err
    r = run_sub(tmp_path, "tune", "groupnorm_fwd", "--shape", "8,320,64", "--groups", "32")
    assert r.returncode != 0
    assert "N,C,H,W" in r.stderr and "Traceback" not in r.stderr


def test_tune_shape_not_integers(tmp_path: Path) -> None:
    r = run_sub(tmp_path, "tune", "groupnorm_fwd", "--shape", "8,a,64,64", "--groups", "32")
    assert r.returncode == 2
    assert "comma-separated integers" in r.stderr and "8,a,64,64" in r.stderr


def test_tune_shape_without_groups(inproc) -> None:
    code, _, err = inproc("tune", "groupnorm_fwd", "--shape", "8,320,64,64")
    assert code == 2 and "--groups" in err


def test_tune_groups_not_dividing_channels(inproc) -> None:
    code, _, err = inproc("tune", "groupnorm_fwd", "--shape", "8,320,64,64", "--groups", "30")
    assert code == 2
    assert "groups" in err and "320" in err


# ------------------------------------------------------------------ list


def test_list(inproc, tmp_path: Path, db_file: Path) -> None:
    """`ckgen list`: the ops, their tunables and grids, never the DB's entries (`db show`'s)."""
    code, out, _ = inproc("list")
    assert code == 0
    (ops,) = tsv(out)  # not a terminal: tab-separated; one table, whatever the DB holds
    by_op = {r["op"]: r for r in ops}
    assert set(by_op) == {o.name for o in all_ops()}
    assert by_op["groupnorm_fwd"]["tunables"].startswith("threads, vec_bytes")
    assert "sd15-unet" in by_op["groupnorm_fwd"]["grids"] and "resnet" in by_op["maxpool2d_fwd"]["grids"]
    code, out2, _ = inproc("--db", str(db_file), "list")
    assert code == 0 and out2 == out
    r = run_sub(tmp_path, "list")
    assert r.returncode == 0 and "groupnorm_fwd" in r.stdout and "N=" not in r.stdout


def test_list_one_op(inproc) -> None:
    """`ckgen list --op NAME`: every tunable with its values and default, every grid with its
    problem count and what it covers."""
    code, out, _ = inproc("list", "--op", "maxpool2d_bwd")
    assert code == 0
    tunables, grids = tsv(out)
    op = get_op("maxpool2d_bwd")
    assert [r["tunable"] for r in tunables] == list(op.space.params)
    algo = next(r for r in tunables if r["tunable"] == "algo")
    assert algo["values"] == ", ".join(op.space.params["algo"])
    assert algo["default"] == op.space.default.as_dict()["algo"]
    assert {r["grid"]: int(r["problems"]) for r in grids} == {g: len(op.grid_problems(g)) for g in op.grid_names()}
    code, out, err = inproc("list", "--op", "conv2d")
    assert code == 2 and out == "" and err.startswith("ckgen list: --op: unknown 'conv2d'; choose from ")


def test_list_counts_the_default_problems_the_ops_tune(inproc) -> None:
    from ckgen.ops import all_ops

    code, out, _ = inproc("list")
    counts = {r["op"]: int(r["default_problems"]) for r in tsv(out)[0]}
    assert counts == {op.name: len(op.default_problems()) for op in all_ops()}
    assert counts["maxpool2d_fwd"] == 10 and counts["groupnorm_fwd"] == 14  # not the YAML's 0 and 7 shapes


# ------------------------------------------------------------------ db show / export


def test_db_show_with_db_option(inproc, db_file: Path) -> None:
    entries = make_entries()
    for argv in (["--db", str(db_file), "db", "show", "--all"], ["db", "show", "--all", "--db", str(db_file)]):
        code, out, err = inproc(*argv)
        assert code == 0, err
        (rows,) = tsv(out)
        assert {(r["problem"], r["instance"], r["from"]) for r in rows} == {(e.problem, e.instance, "user") for e in entries}
    code, out, _ = inproc("db", "show", "--all")  # the (empty) default DB, not the last --db
    assert code == 0 and tsv(out) == [[]]


def test_db_show_with_env(inproc, db_file: Path, monkeypatch) -> None:
    monkeypatch.setenv("CKGEN_DB", str(db_file))
    code, out, _ = inproc("db", "show", "--all")
    assert code == 0
    (rows,) = tsv(out)
    assert len(rows) == 2 and make_entries()[1].problem in {r["problem"] for r in rows}


def test_db_show_subprocess_env_and_option(tmp_path: Path, db_file: Path) -> None:
    r = run_sub(tmp_path, "db", "show", "--all", env={"CKGEN_DB": str(db_file)})
    assert r.returncode == 0, r.stderr
    assert len(tsv(r.stdout)[0]) == 2 and make_entries()[0].instance in r.stdout
    r = run_sub(tmp_path, "db", "show", "--all", "--db", str(db_file))
    assert r.returncode == 0 and len(tsv(r.stdout)[0]) == 2
    r = run_sub(tmp_path, "db", "show", "--all")
    assert r.returncode == 0 and tsv(r.stdout) == [[]]


def test_db_show_first_screen_counts_entries_per_op_and_arch(inproc, db_file: Path, monkeypatch) -> None:
    """Plain `db show` over the packaged DB (over a thousand entries) is a screen: a count per op
    and arch, by origin; `--op`/`--all` list the entries."""
    import json

    monkeypatch.delenv("CKGEN_SHIPPED_DB")  # the packaged DB, as a user has it
    user, shipped = dbmod.InstanceDB.load(db_file), dbmod.InstanceDB.load(dbmod.shipped_db_path())
    layered = dbmod.InstanceDB.layered(user, shipped)
    assert len(layered.entries) > 1000
    code, out, err = inproc("db", "show", "--db", str(db_file), "--format", "json")
    assert code == 0, err
    rows = json.loads(out)["ops"]
    assert sum(r["entries"] for r in rows) == len(layered.entries)
    assert sum(r["user"] for r in rows) == len(user.entries)
    assert all(r["entries"] == r["user"] + r["shipped"] for r in rows)
    assert {(r["op"], r["arch"]) for r in rows} == {(e.op, e.arch) for e in layered.entries}
    code, out, err = inproc("db", "show", "--db", str(db_file), "--format", "table")
    assert code == 0 and len(out.splitlines()) < 40 and "--all" in out
    code, out, err = inproc("db", "show", "--db", str(db_file), "--all", "--format", "tsv")
    assert code == 0 and len(tsv(out)[0]) == len(layered.entries)
    code, out, err = inproc("db", "show", "--db", str(db_file), "--op", "maxpool2d_fwd", "--format", "tsv")
    assert code == 0 and len(tsv(out)[0]) == len(layered.select("maxpool2d_fwd"))
    code, out, err = inproc("db", "show", "--all", "--op", "maxpool2d_fwd")
    assert code == 2 and "not allowed with" in err


def test_db_export_csv(inproc, tmp_path: Path, db_file: Path) -> None:
    code, out, _ = inproc("db", "export", "--db", str(db_file))
    assert code == 0
    rows = list(csv.reader(io.StringIO(out)))
    assert tuple(rows[0]) == dbmod.CSV_COLUMNS
    assert len(rows) == 3
    got = [dict(zip(rows[0], r)) for r in rows[1:]]
    assert {g["problem"] for g in got} == {e.problem for e in make_entries()}
    assert {float(g["time_us"]) for g in got} == {10.0, 11.0}
    r = run_sub(tmp_path, "db", "export", env={"CKGEN_DB": str(db_file)})
    assert r.returncode == 0 and list(csv.reader(io.StringIO(r.stdout))) == rows
    r = run_sub(tmp_path, "db", "export")  # empty DB: the header alone
    assert r.returncode == 0 and list(csv.reader(io.StringIO(r.stdout))) == [list(dbmod.CSV_COLUMNS)]


def test_corrupt_db_is_reported_and_untouched(inproc, tmp_path: Path, corrupt: Path) -> None:
    before = corrupt.read_bytes()
    for argv in (["db", "show", "--db", str(corrupt)], ["db", "export", "--db", str(corrupt)],
                 ["--db", str(corrupt), "explain", "groupnorm_fwd", "--arch", "sm_90"]):
        code, out, err = inproc(*argv)
        assert code == 2, argv
        assert str(corrupt) in err, err
        assert "Traceback" not in err
    r = run_sub(tmp_path, "db", "show", "--db", "corrupt.yaml")  # relative to cwd=tmp_path
    assert r.returncode == 2
    assert "corrupt.yaml" in r.stderr and "Traceback" not in r.stderr
    r = run_sub(tmp_path, "db", "show", env={"CKGEN_DB": str(corrupt)})
    assert r.returncode == 2 and str(corrupt) in r.stderr
    assert corrupt.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("corrupt")) == ["corrupt.yaml"]


def test_corrupt_db_message_keeps_brackets_in_the_path(inproc, tmp_path: Path) -> None:
    path = tmp_path / "db[old].yaml"
    path.write_text("schema: 1\nentries: {op: x}\n")
    code, _, err = inproc("db", "show", "--db", str(path))
    assert code == 2
    assert str(path) in err


def test_no_command_is_a_usage_error(tmp_path: Path) -> None:
    r = run_sub(tmp_path)
    assert r.returncode == 2 and "usage" in r.stderr.lower()


# ------------------------------------------------------------------ bench without a GPU


@needs_no_gpu
def test_bench_without_gpu_says_why(inproc) -> None:
    code, out, err = inproc("bench", "--quick")
    assert code == 2 and out == ""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ckgen bench: "), err
    assert "no usable GPU" in lines[0] or "needs PyTorch" in lines[0]
    assert lines[0].count("usable") <= 1


def test_bench_rejects_unknown_ops(inproc) -> None:
    code, out, err = inproc("bench", "--ops", "groupnorm_fwd,conv2d")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--ops: unknown conv2d; choose from " in err and "groupnorm_bwd_gamma_beta" in err


def test_bench_covers_every_op(inproc, monkeypatch) -> None:
    """`ckgen bench` has a suite for every op, and --ops takes each of them (up to the GPU check)."""
    import ckgen.runtime.target
    from ckgen.offline.opbench import OPS
    from ckgen.ops import all_ops

    assert sorted(OPS) == sorted(o.name for o in all_ops())
    pytest.importorskip("torch")
    monkeypatch.setattr(ckgen.runtime.target, "gpu_status", lambda: "faked: none here")
    for op in OPS:
        code, out, err = inproc("bench", "--ops", op)
        assert code == 2 and err.strip() == "ckgen bench: no usable GPU (faked: none here)", (op, err)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_bench_eager_sides_on_cpu(layout: str) -> None:
    """Each op's comparison: the eager side runs (on CPU here) and gives what the ckgen op gives
    (dx alone, dgamma/dbeta alone, or all three for the GroupNorm backwards); the ckgen side is a
    call of that op (GPU only)."""
    torch = pytest.importorskip("torch")
    import dataclasses

    from ckgen.offline.opbench import OPS, callables, suite

    shapes = {"groupnorm": (2, 8, 6, 6), "maxpool2d": (2, 4, 9, 9), "avgpool2d": (2, 4, 9, 9)}
    outputs = {"groupnorm_fwd": 1, "groupnorm_bwd": 3, "groupnorm_bwd_data": 1, "groupnorm_bwd_gamma_beta": 2}
    for op in OPS:
        p = suite(op, True)[0]
        N, C, H, W = shapes[op.split("_")[0]]
        fields = dict(N=N, C=C, H=H, W=W, dtype="fp32", layout=layout)
        if op.startswith("groupnorm"):
            fields["G"] = 4
        p = dataclasses.replace(p, **fields)
        ours, eager, what = callables(op, p, device="cpu")
        if op == "groupnorm_bwd_gamma_beta" and layout == "nhwc":
            # PyTorch's CPU channels-last GroupNorm backward crashes when dx is not asked for (the
            # CUDA kernel checks for it); the GPU run takes this path
            assert what == "autograd of F.group_norm (dgamma, dbeta)"
            continue
        got = eager()
        got = [got] if isinstance(got, torch.Tensor) else [t for t in got if t is not None]
        assert all(isinstance(t, torch.Tensor) and torch.isfinite(t).all() for t in got), op
        if op in outputs:
            assert len(got) == outputs[op], (op, what)
        assert callable(ours) and what
        with pytest.raises(TypeError, match="GPU"):  # the ckgen side: a GPU op, refused on CPU tensors
            ours()
    with pytest.raises(ValueError, match="conv2d"):
        callables("conv2d", p, device="cpu")


def test_bench_suites_and_explain_fields() -> None:
    """Every suite problem maps to the fields `explain` takes (no GPU needed to check that)."""
    import ckgen
    from ckgen.offline.opbench import OPS, _explain_fields, suite

    for op in OPS:
        full, quick = suite(op, False), suite(op, True)
        assert full and quick and len(quick) < len(full)
        for p in quick[:1]:
            assert ckgen.explain(op, arch="sm_90", **_explain_fields(op, p)).problem == p.key()


def test_bench_report_from_rows(tmp_path: Path) -> None:
    """The report writer on made-up rows: tables, geomeans, errors, JSON (the plot if matplotlib)."""
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from ckgen.offline.opbench import write

    rows = [{"op": "groupnorm_fwd", "problem": "N=2,C=320", "source": "tuned", "eager_kind": "F.group_norm",
             "ckgen_gpu_us": 10.0, "eager_gpu_us": 30.0, "compile_gpu_us": 20.0,
             "ckgen_host_us": 40.0, "eager_host_us": 35.0, "compile_host_us": 60.0},
            {"op": "maxpool2d_fwd", "problem": "N=32", "source": "default", "eager_kind": "F.max_pool2d",
             "ckgen_gpu_us": 5.0, "eager_gpu_us": 10.0, "ckgen_host_us": 20.0, "eager_host_us": 25.0,
             "compile_error": "BackendCompilerFailed: no"},
            {"op": "avgpool2d_fwd", "problem": "N=1", "error": "ValueError: x: bad"}]
    info = SimpleNamespace(name="Fake GPU 80GB", target=SimpleNamespace(arch="sm_90"))
    md = write(rows, info, tmp_path, quick=True)
    text = md.read_text()
    assert md.name == "bench-Fake-GPU-80GB.md" and (tmp_path / "bench-Fake-GPU-80GB.json").is_file()
    assert "geomean speedup: 2.45x over eager, 2.00x over torch.compile" in text  # sqrt(3 * 2), 2
    assert "| groupnorm_fwd | N=2,C=320 | 10.0 | 30.0 | 20.0 | 3.00x | 2.00x | tuned | F.group_norm |" in text
    assert "error: ValueError: x: bad" in text and "torch.compile failed: BackendCompilerFailed" in text


# ------------------------------------------------------------------ DB text on a terminal, bad places and paths

HOSTILE = "Evil\x1b[2J\x1b]0;pwned\x07GPU\nop\tfake row\r\x9b31m\u202e"


def _hostile_db(path: Path) -> dbmod.Entry:
    """A DB as `db pull`/`db merge` may bring it from another machine: ESC sequences, newlines,
    a C1 CSI and a bidi override in its device and instance strings (and in an arch, which only
    has to be non-empty)."""
    e = make_entries(1)[0]
    e = dbmod.Entry(**{**e.__dict__, "device": HOSTILE, "instance": "ckgen_x\x1b[31m\nred"})
    odd = dbmod.Entry(**{**e.__dict__, "arch": "sm_90\x1b[8m"})
    dbmod.save_entries(path, [e, odd])
    return e


@pytest.mark.parametrize("argv", [["db", "show"], ["db", "show", "--all"], ["db", "show", "--op", "groupnorm_fwd"],
                                  ["db", "where"]])
@pytest.mark.parametrize("fmt", ["table", "tsv"])
def test_db_strings_are_shown_escaped_not_obeyed(inproc, tmp_path: Path, argv, fmt) -> None:
    path = tmp_path / "hostile.yaml"
    _hostile_db(path)
    code, out, err = inproc(*argv, "--db", str(path), "--format", fmt)
    assert code == 0, err
    for raw in ("\x1b", "\x07", "\r", "\x9b", "\u202e"):
        assert raw not in out, (raw, out)
    if argv not in (["db", "where"], ["db", "show"]):  # these show counts per arch, not devices
        assert "Evil\\x1b[2J\\x1b]0;pwned\\x07GPU\\nop\\tfake row\\r\\x9b31m\\u202e" in out
    assert "sm_90\\x1b[8m" in out
    lines = out.splitlines()
    assert not any(line.startswith(("red", "fake", "op\tfake")) for line in lines)  # no forged row


def test_json_keeps_db_strings_exact(inproc, tmp_path: Path) -> None:
    import json

    path = tmp_path / "hostile.yaml"
    _hostile_db(path)
    code, out, _ = inproc("db", "show", "--all", "--db", str(path), "--format", "json")
    assert code == 0 and "\x1b" not in out  # JSON escapes them itself
    assert HOSTILE in {r["device"] for r in json.loads(out)["entries"]}


def test_db_where_reports_a_bad_place_and_goes_on(inproc, tmp_path: Path, corrupt: Path, monkeypatch) -> None:
    """A corrupt user DB (or shipped DB, or a --db that is a folder) is its row's state; every
    other place is still listed. Exit code 1."""
    shipped = tmp_path / "shipped.yaml"
    dbmod.save_entries(shipped, make_entries(2))
    monkeypatch.setenv("CKGEN_SHIPPED_DB", str(shipped))
    folder = tmp_path / "dbdir"
    folder.mkdir()
    for db_arg, words in ((corrupt, "not valid YAML"), (folder, "is a directory")):
        code, out, err = inproc("db", "where", "--db", str(db_arg))
        places, entries = tsv(out)
        by = {r["what"]: r for r in places}
        assert code == 1 and "user DB" in err and len(err.strip().splitlines()) == 1, err
        assert by["user DB"]["state"].startswith("unusable: ") and words in by["user DB"]["state"]
        assert by["shipped DB"]["state"] == "2 entries" and {"cache dir", "cost model", "ROCm (offline HIP builds)"} < set(by)
        assert sum(int(r["shipped"]) for r in entries) == 2
    monkeypatch.setenv("CKGEN_SHIPPED_DB", str(corrupt))
    code, out, err = inproc("db", "where")
    by = {r["what"]: r for r in tsv(out)[0]}
    assert code == 1 and by["shipped DB"]["state"].startswith("unusable: ") and by["user DB"]["state"].startswith("not created")


def test_bad_output_paths_are_one_line_at_once(inproc, tmp_path: Path) -> None:
    """`db merge -o` under a regular file, in a folder that cannot be created, or onto a device;
    `generate --out` a file: one line naming the option, exit 2, before any work (no 60 s wait
    for a lock that nobody holds, no traceback)."""
    import time

    src = tmp_path / "a.yaml"
    dbmod.save_entries(src, make_entries(1))
    afile = tmp_path / "afile"
    afile.write_text("")
    cases = [(["db", "merge", str(src), "-o", str(afile / "out.yaml")], "-o: ", "afile is not a directory"),
             (["db", "merge", str(src), "-o", "/proc/ckgen-out.yaml"], "-o: ", "no file can be created in /proc"),
             (["db", "merge", str(src), "-o", "/proc/ckgen/sub/out.yaml"], "-o: ", "cannot be created"),
             (["db", "merge", str(src), "-o", "/dev/null"], "-o: ", "is a character device, not a regular file"),
             (["generate", "--out", str(afile), "--no-compile", "--target", "sm_90", "--ops", "groupnorm_fwd"],
              "--out: ", "is not a folder"),
             (["generate", "--out", "/proc/ckgen/gen", "--no-compile", "--target", "sm_90", "--ops", "groupnorm_fwd"],
              "--out: ", "cannot be created"),
             (["tune", "groupnorm_fwd", "--db", str(afile / "db.yaml")], "--db: ", "is a file")]
    for argv, option, words in cases:
        t0 = time.monotonic()
        code, out, err = inproc(*argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, (argv, err)
        assert option in err and words in err and "Traceback" not in err, (argv, err)
        assert time.monotonic() - t0 < 10, argv
    assert stat_is_char_device("/dev/null")


def stat_is_char_device(path: str) -> bool:
    import stat

    return stat.S_ISCHR(os.stat(path).st_mode)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_db_merge_into_a_read_only_folder_is_one_line(inproc, tmp_path: Path) -> None:
    src, ro = tmp_path / "a.yaml", tmp_path / "ro"
    dbmod.save_entries(src, make_entries(1))
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, _, err = inproc("db", "merge", str(src), "-o", str(ro / "out.yaml"))
        assert code == 2 and "-o: " in err and "no file can be created" in err, err
    finally:
        ro.chmod(0o755)


def test_generate_check_of_a_missing_folder_says_it_is_missing(inproc, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    code, out, err = inproc("generate", "--check", "--out", str(missing), "--target", "sm_90", "--ops", "groupnorm_fwd")
    assert code == 2 and f"--out: {missing} does not exist" in err and "out of date" not in err, err
    assert not missing.exists()


def test_db_pull_of_a_storage_that_does_not_exist_is_an_error(inproc, tmp_path: Path) -> None:
    """Not an empty study file created and "wrote 0 entries" (nothing was written)."""
    db = tmp_path / "pulled.yaml"
    for url, words in ((f"sqlite:///{tmp_path / 'typo.db'}", "the file does not exist"),
                       (f"sqlite:///{tmp_path}", "is a directory")):
        code, out, err = inproc("db", "pull", "--storage", url, "--db", str(db))
        assert code == 2 and "--storage: " in err and words in err and "wrote" not in out + err, err
    assert not (tmp_path / "typo.db").exists() and not db.exists()


def test_db_pull_from_a_folder_that_takes_no_lock_file_fails_at_once(inproc, tmp_path: Path, monkeypatch) -> None:
    """The study file's lock went beside it: a folder where no file can be created made the pull
    wait SQLITE_BUSY_S (120 s) and then say the lock was held. (/proc/version: a file in a folder
    that takes no new file, even for root; and no study storage: said at once.)"""
    import time

    from ckgen.tuner import tune

    monkeypatch.setattr(tune, "SQLITE_BUSY_S", 3)  # bounds the run before the fix
    t0 = time.monotonic()
    code, out, err = inproc("db", "pull", "--storage", "sqlite:////proc/version", "--db", str(tmp_path / "p.yaml"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--storage: /proc/version " in err, err
    assert "lock" not in err and time.monotonic() - t0 < 2.5


def test_db_merge_and_pull_leave_no_stray_lock_files(inproc, tmp_path: Path) -> None:
    """`db pull` left `<storage>.lock` beside the SQLite storage it only reads (the lock that
    guards creating optuna's schema). The DBs' own locks stay: every writer of the DB shares
    them, and deleting one while another process waits on it would let two writers in."""
    from ckgen.tuner.replay import ReplayEvaluator
    from ckgen.tuner.tune import Tuner, TuneRequest

    import wtimes

    a, out = tmp_path / "a.yaml", tmp_path / "out.yaml"
    dbmod.write_db(a, make_entries(2))
    assert inproc("db", "merge", str(a), "-o", str(out))[0] == 0
    storage = tmp_path / "s.sqlite3"
    key = wtimes.KEYS[1]
    Tuner(TuneRequest(wtimes.OP, wtimes.OP.problem_from_key(key), wtimes.SM90, trials=2, storage=f"sqlite:///{storage}",
                      restrict=lambda c: wtimes.restrict_to(key, c), model=None),
          ReplayEvaluator(lambda c: wtimes.time_of(key, c))).search()
    for p in tmp_path.glob("s.sqlite3*.lock"):
        p.unlink()  # the tuner's (not what is tested here)
    code, _, err = inproc("db", "pull", "--storage", f"sqlite:///{storage}", "--db", str(out))
    assert code == 0, err
    files = sorted(p.name for p in tmp_path.iterdir() if p.is_file())  # the cache dir is there too
    assert files == ["a.yaml", "a.yaml.lock", "out.yaml", "out.yaml.lock", "s.sqlite3"]
