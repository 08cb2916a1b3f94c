"""CPU tests of the command line as a new user meets it: output in a pipe, at 80 columns and as
JSON; every bad option one line naming it (before the GPU check); --version and `python -m
ckgen`; `tune --help`; `db where`; `generate` with the user DB, without the HIP toolchain and
without CuPy; the tune/retune tables (with the GPU faked)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from ckgen import cli
from ckgen.runtime import db as dbmod
from ckgen.instance import render_instance
from ckgen.ops import all_ops, get_op
from ckgen.cli.output import Col, Sheet, to_json, to_rich, to_tsv
from ckgen.types import Target

from test_cli import REPO, make_entries, run_sub, tsv

OP = get_op("groupnorm_fwd")
POOL = get_op("avgpool2d_bwd")


def pool_entry(i: int = 0, arch: str = "sm_90") -> dbmod.Entry:
    t = Target.named(arch)
    p = POOL.parse_problem(N=8 + i, C=64, H=56, W=56, kernel=3, stride=2, padding=1, dtype="bf16", layout="nhwc")
    src = render_instance(POOL, p, POOL.space.default, t)
    return dbmod.Entry(op=POOL.name, vendor=t.vendor, arch=arch, device="Test GPU", problem=p.key(),
                       config=POOL.space.default.items, instance=src.name, source_sha256=src.sha256,
                       time_us=20.0 + i, gbps=1000.0, default_time_us=25.0)


@pytest.fixture
def run(capsys, monkeypatch):
    """main() in this process with a console of a given width; returns (code, stdout, stderr)."""

    def go(*args: str, width: int = 400, terminal: bool = False) -> tuple[int, str, str]:
        monkeypatch.setattr(cli, "console", Console(soft_wrap=True, width=width, force_terminal=terminal,
                                                   no_color=True, highlight=False))
        capsys.readouterr()
        code = cli.main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return go


@pytest.fixture
def many(tmp_path: Path) -> Path:
    path = tmp_path / "many.yaml"
    dbmod.save_entries(path, make_entries(3) + [pool_entry(i) for i in range(3)])
    return path


# ------------------------------------------------------------------ formats


def test_pipe_gets_tsv_terminal_gets_a_table(run, many: Path) -> None:
    code, out, _ = run("db", "show", "--all", "--db", str(many))
    assert code == 0 and "\t" in out and "┃" not in out and "│" not in out
    code, out, _ = run("db", "show", "--all", "--db", str(many), terminal=True)
    assert code == 0 and "\t" not in out and "instance DB (6 entries)" in out


@pytest.mark.parametrize("width", [60, 80, 120, 400])
def test_table_never_cuts_an_identifier(run, many: Path, width: int) -> None:
    entries = dbmod.InstanceDB.load(many).entries
    code, out, _ = run("db", "show", "--all", "--db", str(many), "--format", "table", width=width)
    assert code == 0 and "…" not in out and "..." not in out
    lines = out.splitlines()
    for e in entries:  # every key and name whole, on one line
        assert any(e.problem in ln for ln in lines), (width, e.problem)
        assert any(e.instance in ln for ln in lines), (width, e.instance)
    ops = [ln for ln in lines if ln.lstrip("│ ").startswith(("groupnorm_fwd", "avgpool2d_bwd"))]
    assert len(ops) == len(entries)  # groupnorm_fwd and avgpool2d_bwd whole on their rows
    if width >= 400:
        assert max(len(ln) for ln in lines) <= width and "┌" in out  # a table when it fits


def test_tsv_and_json_hold_the_same_rows(run, many: Path) -> None:
    _, out_tsv, _ = run("db", "show", "--all", "--db", str(many), "--format", "tsv")
    code, out_json, _ = run("db", "show", "--all", "--db", str(many), "--format", "json")
    assert code == 0
    doc = json.loads(out_json)
    (rows,) = tsv(out_tsv)
    assert [r["problem"] for r in rows] == [e["problem"] for e in doc["entries"]]
    assert all(isinstance(e["time_us"], float) and e["from"] == "user" for e in doc["entries"])
    assert {e["op"] for e in doc["entries"]} == {"groupnorm_fwd", "avgpool2d_bwd"}


def test_list_json(run, many: Path) -> None:
    code, out, _ = run("list", "--db", str(many), "--format", "json")
    doc = json.loads(out)
    assert code == 0 and set(doc) == {"ops"}  # the DB's entries are `db show`'s
    assert {o["op"]: o["default_problems"] for o in doc["ops"]} == {o.name: len(o.default_problems()) for o in all_ops()}
    assert {o["op"]: o["tunables"] for o in doc["ops"]} == {o.name: list(o.space.params) for o in all_ops()}
    code, out, _ = run("list", "--op", "groupnorm_fwd", "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["op"] == "groupnorm_fwd" and doc["template"] == "groupnorm_fwd.cu.j2"
    assert {t["tunable"]: t["values"] for t in doc["tunables"]} == {k: list(v) for k, v in OP.space.params.items()}
    assert [g["grid"] for g in doc["grids"]] == OP.grid_names()
    code, out, _ = run("db", "show", "--db", str(many), "--op", "avgpool2d_bwd", "--format", "json")
    assert code == 0 and [e["op"] for e in json.loads(out)["entries"]] == ["avgpool2d_bwd"] * 3


def test_output_module_cells_and_folding() -> None:
    sheet = Sheet("rows", "t", (Col("name", ident=True), Col("text"), Col("n", number=True, fmt=lambda v: f"{v:.1f}")))
    sheet.add("a\tb", "x\ny", 1.0)
    sheet.add("groupnorm_bwd_gamma_beta", None, float("nan"))
    assert to_tsv([sheet]) == "name\ttext\tn\na b\tx y\t1.0\ngroupnorm_bwd_gamma_beta\t\tnan\n"
    other = Sheet("more", "", (Col("k"),))
    other.add("v")
    # several tables: each captioned, so a reader of the pipe knows which is which
    assert to_tsv([sheet, other]) == ("# rows: t\nname\ttext\tn\na b\tx y\t1.0\ngroupnorm_bwd_gamma_beta\t\tnan\n"
                                      "\n# more\nk\nv\n")
    assert json.loads(to_json([sheet], {"k": 1})) == {"k": 1, "rows": [{"name": "a\tb", "text": "x\ny", "n": 1.0},
                                                                       {"name": "groupnorm_bwd_gamma_beta", "text": None,
                                                                        "n": None}]}
    c = Console(width=20, record=True, no_color=True)  # no wide columns: cells fold, never cut
    c.print(to_rich(sheet, 20))
    text = c.export_text()
    assert "…" not in text and "".join(ln.strip("│ ") for ln in text.splitlines() if "gro" in ln or "_" in ln)
    with pytest.raises(ValueError):
        sheet.add("only one value")


def test_plurals() -> None:
    assert cli.plural(1, "instance") == "1 instance" and cli.plural(2, "instance") == "2 instances"
    assert cli.plural(1, "entry", "entries") == "1 entry" and cli.plural(0, "entry", "entries") == "0 entries"


# ------------------------------------------------------------------ every option checked first


BAD = [
    (["tune", "groupnorm_fwd", "--trials", "-1"], "--trials"),
    (["tune", "groupnorm_fwd", "--trials", "0"], "--trials"),
    (["tune", "groupnorm_fwd", "--timeout", "-5"], "--timeout"),
    (["tune", "groupnorm_fwd", "--total-timeout", "nan"], "--total-timeout"),
    (["tune", "groupnorm_fwd", "--seed", "-1"], "--seed"),
    (["tune", "groupnorm_fwd", "--storage", "bogus://x"], "--storage"),
    (["tune", "groupnorm_fwd", "--storage", "not a url"], "--storage"),
    (["tune", "avgpool2d_fwd", "--shape", "1,8,8,8", "--kernel", "3", "--divisor-override", "0"], "--divisor-override"),
    (["tune", "maxpool2d_fwd", "--shape", "1,8,8,8", "--kernel", "3", "--groups", "2"], "--groups"),
    (["tune", "groupnorm_fwd", "--shape", "1,32,8,8", "--groups", "4", "--kernel", "3"], "--kernel"),
    (["tune", "groupnorm_bwd", "--shape", "1,32,8,8", "--groups", "4", "--ceil-mode"], "--ceil-mode"),
    (["tune", "avgpool2d_bwd", "--shape", "1,8,8,8", "--kernel", "3", "--dilation", "2"], "--dilation"),
    (["tune", "maxpool2d_fwd", "--shape", "1,8,8,8", "--kernel", "3", "--no-count-include-pad"], "--count-include-pad"),
    (["tune", "maxpool2d_bwd", "--shape", "1,8,8,8", "--kernel", "3", "--return-indices"], "--return-indices"),
    (["tune", "maxpool2d_fwd", "--activation", "swish"], "--activation"),
    (["tune", "groupnorm_fwd", "--groups", "32"], "--groups"),  # without --shape
    (["tune", "maxpool2d_fwd", "--kernel", "3"], "--kernel"),
    (["tune", "maxpool2d_fwd", "--shape", "1,8,8,8"], "--kernel"),
    (["tune", "maxpool2d_fwd", "--shape", "1,8,8,8", "--kernel", "0"], "--kernel"),
    (["tune", "maxpool2d_fwd", "--shape", "1,8,8,8", "--kernel", "3", "--padding", "2"], "--padding"),
    (["tune", "groupnorm_fwd", "--shape", "0,32,8,8", "--groups", "4"], "--shape"),
    (["tune", "groupnorm_fwd", "--shape", "1,32,8,8", "--groups", "5"], "--groups"),
    (["tune", "nosuchop"], "OP"),
    (["retune", "--trials", "-1"], "--trials"),
    (["retune", "--storage", "bogus://x"], "--storage"),
    (["retune", "--from-arch", "volta"], "--from-arch"),
    (["retune", "--ops", "conv2d"], "--ops"),
    (["generate", "--target", "sm_9x"], "--target"),
    (["generate", "--target", ","], "--target"),
    (["generate", "--ops", "conv2d"], "--ops"),
    (["generate", "--jobs", "0"], "--jobs"),
    (["db", "show", "--op", "conv2d"], "--op"),
    (["list", "--format", "yaml"], "--format"),
]


@pytest.mark.parametrize("argv,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_option_is_one_line_naming_it_before_the_gpu_check(run, monkeypatch, argv, option) -> None:
    import ckgen.runtime.target

    def no(*a, **k):
        raise AssertionError("the GPU was looked at before the options were checked")

    monkeypatch.setattr(ckgen.runtime.target, "gpu_status", no)
    monkeypatch.setattr(ckgen.runtime.target, "device_info", no)
    code, out, err = run(*argv)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and out == ""
    assert len(lines) == 1, err
    assert lines[0].startswith(("ckgen tune: ", "ckgen retune: ", "ckgen generate: ", "ckgen db show: ",
                                "ckgen list: ")), lines[0]
    assert option in lines[0], lines[0]
    assert "Traceback" not in err


def test_db_that_is_a_folder(run, tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "dbdir"
    folder.mkdir()
    for argv in (["db", "show", "--db", str(folder)], ["db", "export", "--db", str(folder)],
                 ["--db", str(folder), "list"],
                 ["generate", "--db", str(folder), "--no-compile", "--out", str(tmp_path / "g")],
                 ["tune", "groupnorm_fwd", "--db", str(folder)], ["retune", "--db", str(folder)],
                 ["bench", "--db", str(folder)]):
        code, out, err = run(*argv)
        assert code == 2 and out == "", argv
        assert len(err.strip().splitlines()) == 1 and "--db" in err and "is a directory" in err, (argv, err)
    monkeypatch.setenv("CKGEN_DB", str(folder))
    code, _, err = run("db", "show")
    assert code == 2 and "$CKGEN_DB" in err and "is a directory" in err
    file = tmp_path / "afile"
    file.write_text("")
    code, _, err = run("db", "show", "--db", str(file / "instances.yaml"))
    assert code == 2 and "is a file" in err
    r = run_sub(tmp_path, "db", "show", "--db", str(folder))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_folder_db_does_not_break_op_calls(tmp_path: Path, monkeypatch) -> None:
    """The dispatcher's (lenient) view warns about an unreadable user DB and keeps the shipped one."""
    folder = tmp_path / "dbdir"
    folder.mkdir()
    with pytest.raises(dbmod.DBCorruptError, match="is a directory"):
        dbmod.InstanceDB.load(folder)
    with pytest.warns(dbmod.DBWarning, match="is a directory"):
        assert dbmod.load_layered(folder).entries == ()


def test_db_errors_do_not_stutter(run, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema: 1\nentries: [unclosed\n")
    code, _, err = run("db", "show", "--db", str(bad))
    assert code == 2 and err.startswith("ckgen db show: instance DB ") and "ckgen instance DB" not in err


def test_db_warnings_are_one_line(run, tmp_path: Path) -> None:
    path = tmp_path / "db.yaml"
    dbmod.save_entries(path, make_entries(1))
    import yaml

    doc = yaml.safe_load(path.read_text())
    doc["entries"].append({"op": "groupnorm_fwd"})  # a malformed entry
    path.write_text(yaml.safe_dump(doc))
    code, out, err = run("db", "show", "--all", "--db", str(path))
    assert code == 0 and len(tsv(out)[0]) == 1
    assert err.startswith("ckgen db show: warning: instance DB ") and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ version, python -m, help


def test_version_and_python_m(run, tmp_path: Path) -> None:
    import tomllib

    import ckgen

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert ckgen.__version__ == version
    code, out, _ = run("--version")
    assert code == 0 and out.strip() == f"ckgen {version}"
    e = {k: v for k, v in os.environ.items() if not k.startswith("CKGEN_")}
    e.update(PYTHONPATH=str(REPO), CKGEN_CACHE_DIR=str(tmp_path / "c"), CKGEN_SHIPPED_DB=str(tmp_path / "none.yaml"))
    r = subprocess.run([sys.executable, "-m", "ckgen", "--version"], cwd=tmp_path, env=e, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"ckgen {version}"
    r = subprocess.run([sys.executable, "-m", "ckgen", "list"], cwd=tmp_path, env=e, capture_output=True, text=True)
    assert r.returncode == 0 and tsv(r.stdout)[0][0]["op"] == "avgpool2d_bwd"


def test_tune_help_lists_ops_and_every_default(run) -> None:
    code, out, _ = run("tune", "--help")
    assert code == 0
    for op in all_ops():
        assert op.name in out
    parser = cli.parser()
    tune = parser._subparsers._group_actions[0].choices["tune"]
    for action in tune._actions:
        if action.dest in ("help", "op", "fn", "prog") or action.help == "==SUPPRESS==":
            continue
        assert "default" in (action.help or ""), action.option_strings


def _commands(parser) -> dict[str, object]:
    """Every (sub)command's parser by its name ("tune", "db show", ...)."""
    out = {}
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        out[name] = sub
        if sub._subparsers is not None:
            out.update({f"{name} {n}": s for n, s in sub._subparsers._group_actions[0].choices.items()})
    return out


def test_every_command_has_a_description_and_help_fits_80_columns(run, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    commands = _commands(cli.parser())
    assert {"tune", "generate", "bench", "db export", "db merge", "db pull", "db where"} <= set(commands)
    for name in commands:
        code, out, _ = run(*name.split(), "--help")
        assert code == 0
        long = [ln for ln in out.splitlines() if len(ln) > 80]
        assert not long, (name, long)
        description = out.split("\n\n")[1]  # after the usage block: the description, before the options
        assert not description.startswith(("options:", "positional arguments:")), (name, out)


def test_every_command_takes_db_after_its_name(run, tmp_path: Path) -> None:
    """`--db FILE` works after every command (README: every command takes it); `db merge` without
    -o merges into it."""
    user = tmp_path / "user.yaml"
    a = tmp_path / "a.yaml"
    dbmod.save_entries(a, make_entries(2))
    code, out, err = run("db", "merge", str(a), "--db", str(user))
    assert code == 0, err
    assert len(dbmod.InstanceDB.load(user).entries) == 2 and str(user) in out
    code, _, err = run("--db", str(tmp_path / "other.yaml"), "db", "merge", str(a))
    assert code == 0 and len(dbmod.InstanceDB.load(tmp_path / "other.yaml").entries) == 2, err
    for name, sub in _commands(cli.parser()).items():
        if sub._subparsers is None:  # a command, not a group of them
            assert any("--db" in a.option_strings for a in sub._actions), name


def test_bench_says_no_gpu_before_it_asks_for_pytorch(run, monkeypatch) -> None:
    """Without a GPU, `ckgen bench` says so at once: it neither imports PyTorch (seconds) nor asks
    for it first."""
    import sys

    from ckgen.runtime import target

    monkeypatch.setattr(target, "gpu_status", lambda: "faked: none here")  # on a GPU machine too
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails: as where it is not installed
    code, out, err = run("bench")
    assert code == 2 and out == "" and err.strip() == "ckgen bench: no usable GPU (faked: none here)", err


# ------------------------------------------------------------------ db where


def test_db_where_says_which_entries_come_from_which(run, tmp_path: Path, monkeypatch) -> None:
    shipped = tmp_path / "shipped.yaml"
    dbmod.save_entries(shipped, make_entries(2) + [pool_entry(0)])
    user = tmp_path / "user.yaml"
    overriding = dataclasses.replace(make_entries(1)[0], time_us=5.0)
    dbmod.save_entries(user, [overriding, pool_entry(1)])
    monkeypatch.setenv("CKGEN_SHIPPED_DB", str(shipped))
    code, out, _ = run("db", "where", "--db", str(user), "--format", "json")
    assert code == 0
    doc = json.loads(out)
    places = {p["what"]: p for p in doc["places"]}
    assert places["user DB"]["path"] == str(user) and places["user DB"]["set_by"] == "--db"
    assert places["user DB"]["state"] == "2 entries"
    assert places["shipped DB"]["path"] == str(shipped) and places["shipped DB"]["set_by"] == "$CKGEN_SHIPPED_DB"
    assert places["cache dir"]["path"] == os.environ["CKGEN_CACHE_DIR"]
    # the tests share one compiled-kernel folder (conftest); without the variable: <cache dir>/kernels
    assert places["compiled kernels"]["path"] == os.environ["CKGEN_KERNEL_CACHE"]
    assert places["compiled kernels"]["set_by"] == "$CKGEN_KERNEL_CACHE"
    monkeypatch.delenv("CKGEN_KERNEL_CACHE")
    places = {p["what"]: p for p in json.loads(run("db", "where", "--db", str(user), "--format", "json")[1])["places"]}
    assert places["compiled kernels"]["path"] == str(Path(os.environ["CKGEN_CACHE_DIR"]) / "kernels")
    assert places["compiled kernels"]["set_by"] == "the cache dir"
    assert Path(places["templates"]["path"]).name == "templates"
    counts = {(c["op"], c["arch"]): (c["user"], c["shipped"], c["shipped_overridden"]) for c in doc["entries"]}
    assert counts == {("groupnorm_fwd", "sm_90"): (1, 1, 1), ("avgpool2d_bwd", "sm_90"): (1, 1, 0)}
    _, out, _ = run("db", "show", "--all", "--db", str(user))
    origin = {(r["op"], r["problem"]): r["from"] for r in tsv(out)[0]}
    assert origin[("groupnorm_fwd", overriding.problem)] == "user"
    assert sorted(origin.values()) == ["shipped", "shipped", "user", "user"]
    code, out, _ = run("db", "where", "--format", "table", width=80)
    assert code == 0 and "user DB" in out and "…" not in out


# ------------------------------------------------------------------ generate


def test_generate_layers_the_user_db_over_the_shipped_one(run, tmp_path: Path, monkeypatch) -> None:
    shipped = tmp_path / "shipped.yaml"
    dbmod.save_entries(shipped, make_entries(1))
    user = tmp_path / "user.yaml"
    dbmod.save_entries(user, [make_entries(2)[1]])
    monkeypatch.setenv("CKGEN_SHIPPED_DB", str(shipped))
    out = tmp_path / "lib"
    code, stdout, err = run("generate", "--db", str(user), "--ops", "groupnorm_fwd", "--target", "sm_90",
                            "--no-compile", "--out", str(out))
    assert code == 0, err
    manifest = (out / "sm_90" / "groupnorm_fwd" / "manifest.yaml").read_text()
    for e in make_entries(2):  # the shipped entry's problem and the user entry's problem
        assert e.problem in manifest
    # a pipe: the summary as TSV on stdout, as every command prints its tables there; the notes on stderr
    (summary,) = tsv(stdout)
    assert [r["target"] for r in summary] == ["sm_90"] and summary[0]["not_built"] == summary[0]["instances"]
    assert "┌" not in stdout and "│" not in stdout
    assert any(ln.startswith(("wrote 1 instance for sm_90", "wrote 2 instances for sm_90"))
               for ln in err.splitlines())


def test_generate_with_ops_rewrites_only_those_ops(run, tmp_path: Path) -> None:
    out = tmp_path / "lib"
    code, _, err = run("generate", "--ops", "maxpool2d_fwd,avgpool2d_fwd", "--target", "sm_90", "--defaults",
                       "--no-compile", "--out", str(out))
    assert code == 0, err
    code, _, err = run("generate", "--ops", "avgpool2d_fwd", "--target", "sm_90", "--defaults",
                       "--no-compile", "--out", str(out))
    assert code == 0, err
    for op in ("maxpool2d_fwd", "avgpool2d_fwd"):  # the op not named keeps its folder
        assert (out / "sm_90" / op / "manifest.yaml").is_file(), op
    # --check with --ops/--target compares only those folders (the others are not drift)
    code, _, err = run("generate", "--check", "--ops", "avgpool2d_fwd", "--target", "sm_90", "--defaults",
                       "--out", str(out))
    assert code == 0, err
    (out / "sm_90" / "avgpool2d_fwd" / "manifest.yaml").write_text("changed\n")
    code, _, err = run("generate", "--check", "--ops", "avgpool2d_fwd", "--target", "sm_90", "--defaults",
                       "--out", str(out))
    assert code == 1 and "out of date" in err


def test_generate_without_the_hip_toolchain_is_one_line(run, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CKGEN_HIP_CLANG", "no-such-clang++")
    code, out, err = run("generate", "--ops", "groupnorm_fwd", "--target", "gfx90a,gfx942", "--out", str(tmp_path / "g"))
    lines = [ln for ln in err.splitlines() if ln.startswith("ckgen generate:")]  # besides the progress (a pipe)
    assert code == 1 and len(lines) == 1, err
    assert "not built for gfx90a, gfx942" in lines[0] and "no-such-clang++ is not on PATH" in lines[0]
    assert "tools/hip-toolchain" in lines[0] and "hip-check" not in lines[0] and "FAILED" not in err
    assert "not built (no toolchain)" in err
    assert list((tmp_path / "g" / "gfx942" / "groupnorm_fwd").glob("*.hip")), "sources are still written"


def _no_cupy_env(tmp_path: Path) -> dict[str, str]:
    stub = tmp_path / "stub" / "cupy"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'cupy'\", name='cupy')\n")
    return {"PYTHONPATH": os.pathsep.join((str(stub.parent), str(REPO)))}


def test_without_cupy_generate_and_tune_say_what_to_install(tmp_path: Path) -> None:
    env = _no_cupy_env(tmp_path)
    r = run_sub(tmp_path, "generate", "--ops", "groupnorm_fwd", "--target", "sm_90", "--out", str(tmp_path / "g"), env=env)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("ckgen generate:")]  # besides the progress
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "CuPy is not installed" in lines[0] and "ckgen[cuda13]" in lines[0] and "Traceback" not in r.stderr
    r = run_sub(tmp_path, "tune", "groupnorm_fwd", env=env)
    assert r.returncode == 2 and r.stderr.strip() == (
        "ckgen tune: no usable GPU (CuPy is not installed; pip install 'ckgen[cuda13]', or 'ckgen[cuda12]' "
        "for a CUDA 12 driver)")


def test_without_cupy_the_api_says_what_to_install(tmp_path: Path) -> None:
    code = """
import ckgen
from ckgen.runtime.target import CuPyMissingError, NoGPUError
class Dev:
    __cuda_array_interface__ = {"shape": (2, 32, 4, 4), "typestr": "<f4", "data": (0, False), "version": 3}
try:
    ckgen.groupnorm_fwd(Dev(), None, None, 4)
except ModuleNotFoundError as e:
    assert isinstance(e, CuPyMissingError) and "ckgen[cuda13]" in str(e), e
    print("api:", e)
try:
    ckgen.explain("groupnorm_fwd", N=2, C=32, H=4, W=4, G=4, dtype="bf16", layout="nchw")
except NoGPUError as e:
    assert "CuPy is not installed" in str(e) and "ckgen[cuda13]" in str(e), e
    print("explain:", e)
"""
    e = {k: v for k, v in os.environ.items() if not k.startswith("CKGEN_")}
    e.update(_no_cupy_env(tmp_path), CKGEN_CACHE_DIR=str(tmp_path / "c"))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=e, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "api: ckgen reads other frameworks' device arrays through CuPy, which is not installed" in r.stdout


# ------------------------------------------------------------------ tune / retune tables (GPU faked)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A usable 'GPU' whose tune_problem returns made-up results at once."""
    import ckgen.runtime.target
    import ckgen.tuner.tune
    from ckgen.runtime.bench import Timing
    from ckgen.tuner.tune import Measured, TuneResult

    info = ckgen.runtime.target.DeviceInfo(Target.named("sm_90"), "Fake GPU", 132, 50 << 20)
    monkeypatch.setattr(ckgen.runtime.target, "gpu_status", lambda: None)
    monkeypatch.setattr(ckgen.runtime.target, "device_info", lambda i=None: info)

    def tune_problem(request, info, on_trial=None):
        op, p = request.op, request.problem
        cfg = op.space.nearest_default(lambda c: bool(op.validate(p, c, info.target)))
        src = render_instance(op, p, cfg, info.target)
        m = Measured(cfg, src.name, src.sha256, Timing(10.0, 9.5, 10.5, 5))
        d = Measured(cfg, src.name, src.sha256, Timing(12.0, 11.0, 13.0, 5))
        return TuneResult(op.name, p, m, d, Timing(8.0, 8.0, 8.0, 5), op.min_bytes(p), 3, 0,
                          failures=[("threads=64", "wrong answer")], warm=[d] if request.warm else [])

    def db_entry(r, info, prov=None):
        return dbmod.Entry(op=r.op, vendor="cuda", arch="sm_90", device=info.name, problem=r.problem.key(),
                           config=r.best.config.items, instance=r.best.instance, source_sha256=r.best.sha256,
                           time_us=r.best.timing.median_us, gbps=r.gbps, default_time_us=12.0)

    monkeypatch.setattr(ckgen.tuner.tune, "tune_problem", tune_problem)
    monkeypatch.setattr(ckgen.tuner.tune, "db_entry", db_entry)
    return info


@pytest.mark.parametrize("fmt", ["tsv", "json", "table"])
def test_tune_results_in_every_format(run, fake_gpu, tmp_path: Path, fmt: str) -> None:
    db = tmp_path / "t.yaml"
    argv = ["tune", "avgpool2d_bwd", "--shape", "8,64,56,56", "--kernel", "3", "--stride", "2", "--padding", "1",
            "--dtype", "bf16", "--dtype", "fp16", "--layout", "nhwc", "--trials", "3", "--db", str(db), "--format", fmt]
    code, out, err = run(*argv, width=80)
    assert code == 0, err
    keys = sorted(p.key() for p in POOL.problems_from_cli(cli.parser().parse_args(argv)))
    if fmt == "tsv":
        (rows,) = tsv(out)
        assert sorted(r["problem"] for r in rows) == keys and {r["failed_trials"] for r in rows} == {"1"}
        assert "wrote 2 entries" in err and "tuning 2 problems" in err  # notes on stderr: stdout is data
    elif fmt == "json":
        doc = json.loads(out)
        assert doc["op"] == "avgpool2d_bwd" and doc["device"] == "Fake GPU" and doc["db"] == str(db)
        assert sorted(r["problem"] for r in doc["results"]) == keys
        assert doc["results"][0]["speedup_vs_default"] == pytest.approx(1.2)
    else:
        assert "…" not in out and all(k in out for k in keys) and "wrote 2 entries" in out
    assert len(dbmod.InstanceDB.load(db).entries) == 2


def test_retune_results(run, fake_gpu, tmp_path: Path) -> None:
    db = tmp_path / "r.yaml"
    dbmod.save_entries(db, [pool_entry(0, "sm_80"), pool_entry(1, "sm_80")])
    code, out, err = run("retune", "--db", str(db), "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert len(doc["results"]) == 2 and {r["from_arch"] for r in doc["results"]} == {"sm_80"}
    assert "wrote 2 entries for sm_90" in err
    code, out, err = run("retune", "--db", str(db), "--format", "tsv")
    assert code == 0 and tsv(out) == [[]] and "nothing to retune" in err


def test_tune_skip_tuned_goes_on_where_the_last_run_stopped(run, fake_gpu, tmp_path: Path) -> None:
    """--skip-tuned leaves out what the DB in effect already holds for this arch (a grid tuned
    over several runs); without it every problem is tuned again."""
    db = tmp_path / "t.yaml"
    argv = ["tune", "avgpool2d_bwd", "--shape", "8,64,56,56", "--kernel", "3", "--stride", "2", "--padding", "1",
            "--dtype", "bf16", "--layout", "nhwc", "--db", str(db), "--format", "json"]
    dbmod.save_entries(db, [pool_entry(0, "sm_90")])  # that very problem, tuned on sm_90
    code, out, err = run(*argv, "--dtype", "fp16", "--skip-tuned")
    assert code == 0, err
    assert "1 of 2 problems already tuned for sm_90; tuning 1" in err
    assert [r["problem"] for r in json.loads(out)["results"]] == [pool_entry(0).problem.replace("bf16", "fp16")]
    code, out, err = run(*argv, "--skip-tuned")
    assert code == 0 and "nothing to tune" in err and out == ""
    code, out, err = run(*argv)  # without the flag: tuned again
    assert code == 0 and len(json.loads(out)["results"]) == 1
    # A stale entry (rendered from a template that has changed since) does not count as tuned.
    stale_db = tmp_path / "stale.yaml"
    dbmod.save_entries(stale_db, [dataclasses.replace(pool_entry(0, "sm_90"), source_sha256="0" * 64)])
    argv[argv.index(str(db))] = str(stale_db)
    code, out, err = run(*argv, "--skip-tuned")
    assert code == 0, err
    assert "0 of 1 problem already tuned for sm_90; tuning 1 (1 with a stale entry" in err
    assert [r["problem"] for r in json.loads(out)["results"]] == [pool_entry(0).problem]


# ------------------------------------------------------------------ where things come from, what ckgen serves


def test_db_where_labels_the_installed_packages_folders_and_a_cache_that_is_a_file(run, tmp_path, monkeypatch) -> None:
    """The CLI moved into a subpackage and compared the folders with ckgen/cli/: an installed
    package's templates were labelled "the checkout"; a kernel cache that is a file was "not
    created yet"."""
    import ckgen
    from ckgen import resources

    inside = Path(ckgen.__file__).resolve().parent
    monkeypatch.setattr(resources, "templates_dir", lambda: inside / "templates")  # as a wheel holds them
    monkeypatch.setattr(resources, "tuning_spaces_dir", lambda: inside.parent / "tuning_spaces")  # as a checkout does
    cache = tmp_path / "kernels"
    cache.write_text("not a folder")
    monkeypatch.setenv("CKGEN_KERNEL_CACHE", str(cache))
    code, out, err = run("db", "where", "--format", "json")
    places = {p["what"]: p for p in json.loads(out)["places"]}
    assert places["templates"]["set_by"] == "the installed package"
    assert places["tuning spaces"]["set_by"] == "the checkout (beside the package)"
    assert code == 1 and "not created yet" not in places["compiled kernels"]["state"]
    assert "not a folder" in places["compiled kernels"]["state"], places["compiled kernels"]


@pytest.mark.parametrize("arch", ["sm_70", "sm_52", "sm_75", "gfx908", "gfx906"])
def test_an_arch_ckgen_has_no_kernels_for_is_one_line(run, arch, tmp_path) -> None:
    """`explain --arch sm_70` answered with a confident pick and `generate --target sm_70`
    printed 80 lines of NVRTC failures: ckgen's kernels need sm_80 or later (CUDA) and are built
    for gfx90a, gfx942 and gfx1100 (HIP)."""
    for argv, option in ((["explain", "groupnorm_fwd", "--arch", arch], "--arch"),
                         (["generate", "--target", arch, "--out", str(tmp_path / "gen"), "--no-compile"], "--target")):
        code, out, err = run(*argv)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and option in lines[0] and arch in lines[0], err
    with pytest.raises(ValueError, match=arch):
        import ckgen

        ckgen.explain("groupnorm_fwd", N=1, C=32, H=8, W=8, G=8, dtype="bf16", layout="nhwc", arch=arch)


def test_explain_and_db_export_on_a_terminal_escape_db_text(run, tmp_path, monkeypatch) -> None:
    """DB text from other machines (a device name with an escape sequence) reached the terminal
    raw through `print(ckgen.explain(...))` and `ckgen db export`."""
    import ckgen
    from ckgen import settings

    evil = "\x1b[2J\x1b[31mH100\x07"
    e = dataclasses.replace(make_entries(1)[0], device=evil)
    dbmod.save_entries(settings.user_db_path(), [e])
    ckgen.reload_db()
    p = get_op(e.op).problem_from_key(e.problem)
    choice = ckgen.explain(e.op, **{k: getattr(p, k) for k in ("N", "C", "H", "W", "G", "dtype", "layout")},
                           activation=p.activation, arch=e.arch)
    assert "\x1b" not in str(choice) and "\\x1b" in str(choice), str(choice)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    code, out, _ = run("db", "export")
    assert code == 0 and "\x1b" not in out and "\\x1b[2J" in out
