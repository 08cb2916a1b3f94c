"""The command line as a new user meets it on a narrow terminal without a GPU (CPU tier): tables
that never cut an identifier at 60, 80 or 120 columns (list, db show, db where, explain, tune's
and retune's results); the no-GPU message's real cause (no driver library, an old driver, no
device); `ckgen explain` from the command line; progress in a log (one line per finished step,
no bars) for tune, retune and generate, and generate's summary."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckgen import cli
from ckgen.runtime import db as dbmod
from ckgen.runtime import target as target_mod
from ckgen.instance import render_instance
from ckgen.ops import all_ops, get_op
from ckgen.types import Target

from test_cli import make_entries, tsv
from test_cli_output import fake_gpu, pool_entry, run  # noqa: F401 - fixtures

WIDTHS = (60, 80, 120)
LONG_OP = get_op("groupnorm_bwd_gamma_beta")  # the longest op name


def long_entry() -> dbmod.Entry:
    """An entry of the longest op name, a long problem key and a long device name."""
    t = Target.named("sm_90")
    p = LONG_OP.parse_problem(N=16, C=1280, H=128, W=128, G=32, dtype="bf16", layout="nhwc", activation="swish")
    src = render_instance(LONG_OP, p, LONG_OP.space.default, t)
    return dbmod.Entry(op=LONG_OP.name, vendor="cuda", arch="sm_90", device="Test GPU of a long name",
                       problem=p.key(), config=LONG_OP.space.default.items, instance=src.name,
                       source_sha256=src.sha256, time_us=123.4, gbps=2345.0, default_time_us=150.0)


@pytest.fixture
def wide_db(tmp_path: Path) -> Path:
    path = tmp_path / "wide.yaml"
    dbmod.save_entries(path, make_entries(2) + [pool_entry(0), long_entry()])
    return path


def table_of(out: str, title: str) -> str:
    """The table titled `title` in a command's output (after its progress, before its notes)."""
    text = out[out.index(f"\n{title}\n"):]
    ends = [i for i in (text.find("\nfailed "), text.find("\nwrote ")) if i >= 0]
    return text[:min(ends)] if ends else text


def assert_whole(out: str, width: int, idents: set[str]) -> None:
    """No cell cut: every identifier whole on one line, no ellipsis; no line wider than `width`
    but one that is a single identifier longer than that, alone (a terminal wraps it)."""
    lines = out.splitlines()
    assert "…" not in out and "..." not in out
    for ident in idents:
        assert any(ident in ln for ln in lines), (width, ident, out)
    for ln in lines:
        assert len(ln) <= width or ln.strip() in idents, (width, ln)


def op_names() -> set[str]:
    return {o.name for o in all_ops()}


# ------------------------------------------------------------------ identifiers at any width


@pytest.mark.parametrize("width", WIDTHS)
def test_list_at_any_width(run, width: int) -> None:
    code, out, _ = run("list", "--format", "table", width=width)
    assert code == 0
    assert_whole(out, width, op_names())
    assert "N=" not in out  # the DB's entries are `db show`'s
    for name in op_names():  # each op on a row of its own, leading it
        assert sum(ln.lstrip("│ ").split(" ")[0] == name for ln in out.splitlines()) == 1, (width, name)
    code, out, _ = run("list", "--op", LONG_OP.name, "--format", "table", width=width)
    assert code == 0
    assert_whole(out, width, {LONG_OP.name, *LONG_OP.space.params, *LONG_OP.grid_names()})


@pytest.mark.parametrize("width", WIDTHS)
def test_db_show_at_any_width(run, wide_db: Path, width: int) -> None:
    entries = dbmod.InstanceDB.load(wide_db).entries
    code, out, _ = run("db", "show", "--all", "--db", str(wide_db), "--format", "table", width=width)
    assert code == 0
    assert_whole(out, width, {e.op for e in entries} | {e.problem for e in entries} | {e.instance for e in entries})
    code, out, _ = run("db", "show", "--db", str(wide_db), "--op", LONG_OP.name, "--format", "table", width=width)
    assert code == 0 and LONG_OP.name in out and "groupnorm_fwd" not in out


@pytest.mark.parametrize("width", WIDTHS)
def test_db_where_at_any_width(run, wide_db: Path, width: int) -> None:
    code, out, _ = run("db", "where", "--db", str(wide_db), "--format", "json")
    paths = {r["path"] for r in json.loads(out)["places"] if r["path"]}
    assert str(wide_db) in paths
    code, out, _ = run("db", "where", "--db", str(wide_db), "--format", "table", width=width)
    assert code == 0
    assert_whole(out, width, {"groupnorm_fwd", LONG_OP.name, "avgpool2d_bwd", "ROCm (offline HIP builds)"} | paths)


@pytest.mark.parametrize("width", WIDTHS)
def test_explain_at_any_width(run, wide_db: Path, width: int) -> None:
    e = long_entry()
    code, out, _ = run("explain", LONG_OP.name, "--shape", "16,1280,128,128", "--groups", "32", "--layout", "nhwc",
                       "--activation", "swish", "--arch", "sm_90", "--db", str(wide_db), "--format", "table",
                       width=width)
    assert code == 0
    assert_whole(out, width, {e.problem, e.instance, LONG_OP.name})


@pytest.mark.parametrize("width", WIDTHS)
def test_tune_and_retune_results_at_any_width(run, fake_gpu, tmp_path: Path, width: int) -> None:  # noqa: F811
    db = tmp_path / "t.yaml"
    code, out, err = run("tune", LONG_OP.name, "--shape", "16,1280,128,128", "--groups", "32", "--layout", "nhwc",
                         "--activation", "swish", "--dtype", "bf16", "--dtype", "fp16", "--trials", "3",
                         "--db", str(db), "--format", "table", width=width)
    assert code == 0, err
    entries = dbmod.InstanceDB.load(db).entries
    table = table_of(out, f"{LONG_OP.name} on Fake GPU")
    assert_whole(table, width, {e.problem for e in entries} | {e.instance for e in entries})
    db2 = tmp_path / "r.yaml"
    dbmod.save_entries(db2, [pool_entry(0, "sm_80"), pool_entry(1, "sm_80")])
    code, out, err = run("retune", "--db", str(db2), "--format", "table", width=width)
    assert code == 0, err
    table = table_of(out, "retune on Fake GPU")
    new = [e for e in dbmod.InstanceDB.load(db2).entries if e.arch == "sm_90"]
    assert len(new) == 2
    assert_whole(table, width, {e.problem for e in new} | {e.instance for e in new} | {"avgpool2d_bwd"})


def test_output_layouts_on_made_up_sheets() -> None:
    """to_rich: a table while identifiers and numbers fit whole (text wraps between words);
    narrower, the columns that do not fit go on lines of their own, text first, then identifiers;
    the first identifier leads its record when none is left on the row's line."""
    from rich.console import Console

    from ckgen.cli.output import Col, Sheet, to_rich

    sheet = Sheet("rows", "a title that is long enough to wrap between its words", (
        Col("name", ident=True), Col("about"), Col("n", number=True)))
    sheet.add("groupnorm_bwd_gamma_beta", "some words that wrap between them when the table is narrow", 12345)
    sheet.add("short", "", 1)

    def text(width: int) -> list[str]:
        c = Console(width=width, record=True, no_color=True, soft_wrap=True)
        c.print(to_rich(sheet, width))
        return c.export_text().splitlines()

    wide = text(120)
    assert wide[0].startswith("a title") and "┌" in wide[1] and max(map(len, wide)) <= 120
    mid = text(50)  # a table: name and n whole, about wrapped between words; the title too
    assert mid[:2] == ["a title that is long enough to wrap between its", "words"] and "┌" in mid[2]
    assert max(map(len, mid)) <= 50 and any("groupnorm_bwd_gamma_beta" in ln and "12345" in ln for ln in mid)
    assert any(ln.split("│")[2].strip() == "some words" for ln in mid if ln.count("│") == 4)
    narrow = text(36)  # about moves under its row, wrapped
    assert "┌" not in "".join(narrow) and max(map(len, narrow)) <= 36
    row = next(i for i, ln in enumerate(narrow) if ln.startswith("groupnorm_bwd_gamma_beta"))
    assert narrow[row].split() == ["groupnorm_bwd_gamma_beta", "12345"] and narrow[row + 1].lstrip().startswith("about")
    tiny = text(26)  # n too: the name leads each record
    assert "groupnorm_bwd_gamma_beta" in tiny and max(map(len, tiny)) <= 26
    assert tiny[tiny.index("groupnorm_bwd_gamma_beta") + 1].strip() == "12345"


# ------------------------------------------------------------------ no GPU: the real cause


class _RuntimeError(Exception):
    pass


_RuntimeError.__name__ = "CUDARuntimeError"


class _Runtime:
    is_hip = False

    def __init__(self, driver: int, runtime: int = 13020) -> None:
        self.driver, self.runtime = driver, runtime

    def driverGetVersion(self) -> int:
        return self.driver

    def runtimeGetVersion(self) -> int:
        return self.runtime


def _error(status: int) -> Exception:
    e = _RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")
    e.status = status  # type: ignore[attr-defined]
    return e


def test_no_driver_library_is_no_nvidia_driver(monkeypatch) -> None:
    monkeypatch.setattr(target_mod, "driver_library_missing", lambda: True)
    why = target_mod.runtime_problem(_error(35), _Runtime(0))
    assert why.startswith("no NVIDIA driver/GPU found: ") and target_mod.DRIVER_LIBRARY in why
    assert "insufficient" not in why


def test_an_old_driver_says_its_version_and_what_to_do(monkeypatch) -> None:
    monkeypatch.setattr(target_mod, "driver_library_missing", lambda: False)
    why = target_mod.runtime_problem(_error(35), _Runtime(12040, 13000))
    assert "driver is too old" in why and "CUDA 12.4" in why and "CUDA 13.0" in why and "ckgen[cuda12]" in why
    assert "no NVIDIA driver" not in why


def test_a_driver_without_a_gpu_says_so(monkeypatch) -> None:
    monkeypatch.setattr(target_mod, "driver_library_missing", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    why = target_mod.runtime_problem(_error(100), _Runtime(13020))
    assert why.startswith("no NVIDIA driver/GPU found: ") and "sees no GPU" in why and "CUDA_VISIBLE_DEVICES=''" in why
    why = target_mod.runtime_problem(_error(35), _Runtime(0))
    assert why.startswith("no NVIDIA driver/GPU found: ") and "reports no driver" in why
    other = _error(2)
    assert target_mod.runtime_problem(other, _Runtime(13020)) == f"the CUDA runtime says {other}"


needs_no_driver = pytest.mark.skipif(target_mod.gpu_status() is None or "no NVIDIA driver" not in
                                     (target_mod.gpu_status() or ""), reason="this machine has an NVIDIA driver")


@needs_no_driver
@pytest.mark.parametrize("argv", [["tune", "groupnorm_fwd"], ["retune"], ["bench", "--ops", "maxpool2d_fwd"],
                                  ["explain", "groupnorm_fwd"]])
def test_commands_without_a_driver_say_so(run, argv) -> None:
    if argv[0] == "bench":
        pytest.importorskip("torch")
    code, out, err = run(*argv)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and out == "" and len(lines) == 1, err
    assert "no NVIDIA driver/GPU found" in lines[0] and "insufficient" not in lines[0]
    if argv[0] == "explain":
        assert lines[0].endswith("pass --arch (e.g. --arch sm_90)")


@needs_no_driver
def test_explain_api_without_a_driver_suggests_arch() -> None:
    import ckgen

    with pytest.raises(target_mod.NoGPUError, match='pass arch= \\(e.g. arch="sm_90"\\)') as e:
        ckgen.explain("groupnorm_fwd", N=2, C=32, H=4, W=4, G=4, dtype="bf16", layout="nchw")
    assert "no NVIDIA driver/GPU found" in str(e.value)


# ------------------------------------------------------------------ ckgen explain


def test_explain_from_the_command_line(run, tmp_path: Path, monkeypatch) -> None:
    e = make_entries(1)[0]
    db = tmp_path / "u.yaml"
    dbmod.save_entries(db, [e])
    monkeypatch.setattr(target_mod, "gpu_status", lambda: (_ for _ in ()).throw(AssertionError("no GPU look")))
    code, out, err = run("explain", "groupnorm_fwd", "--shape", "2,320,64,64", "--groups", "32", "--dtype", "bf16",
                         "--dtype", "fp16", "--arch", "sm_90", "--db", str(db))
    assert code == 0, err
    (rows,) = tsv(out)
    assert [r["problem"] for r in rows] == [e.problem, e.problem.replace("bf16", "fp16")]
    assert rows[0]["instance"] == e.instance and rows[0]["source"] == "tuned" and "Test GPU" in rows[0]["reason"]
    assert rows[1]["source"] in ("nearest", "default", "model")
    code, out, _ = run("explain", "maxpool2d_fwd", "--arch", "sm_80", "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["arch"] == "sm_80"
    assert len(doc["choices"]) == len(get_op("maxpool2d_fwd").default_problems())
    code, out, _ = run("explain", "avgpool2d_fwd", "--grid", "resnet", "--dtype", "fp16", "--arch", "sm_90")
    assert code == 0 and len(tsv(out)[0]) == len(get_op("avgpool2d_fwd").grid_problems("resnet", ["fp16"]))


@pytest.mark.parametrize("argv,option", [
    (["explain", "groupnorm_fwd", "--arch", "sm_9x"], "--arch"),
    (["explain", "maxpool2d_fwd", "--shape", "1,8,8,8", "--groups", "2", "--arch", "sm_90"], "--groups"),
    (["explain", "maxpool2d_fwd", "--kernel", "3", "--arch", "sm_90"], "--kernel"),
    (["explain", "maxpool2d_fwd", "--shape", "1,8,8,8", "--arch", "sm_90"], "--kernel"),
    (["explain", "groupnorm_fwd", "--shape", "1,32,8,8", "--groups", "5", "--arch", "sm_90"], "--groups"),
    (["explain", "groupnorm_fwd", "--grid", "nope", "--arch", "sm_90"], "--grid"),
    (["explain", "conv2d"], "OP"),
    (["explain", "groupnorm_fwd", "--format", "yaml"], "--format"),
])
def test_explain_bad_options_are_one_line(run, monkeypatch, argv, option) -> None:
    monkeypatch.setattr(target_mod, "gpu_status", lambda: (_ for _ in ()).throw(AssertionError("no GPU look")))
    code, out, err = run(*argv)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("ckgen explain: ") and option in lines[0], lines[0]
    if argv[2:4] == ["--kernel", "3"]:
        assert "without --shape, explain takes the default problems" in lines[0]


# ------------------------------------------------------------------ progress in a log


def test_tune_progress_in_a_log_is_one_line_per_problem(run, fake_gpu, tmp_path: Path) -> None:  # noqa: F811
    argv = ["tune", LONG_OP.name, "--shape", "16,1280,128,128", "--groups", "32", "--layout", "nhwc",
            "--dtype", "bf16", "--dtype", "fp16", "--trials", "3", "--db", str(tmp_path / "t.yaml"),
            "--format", "table"]
    code, out, err = run(*argv, width=80)
    assert code == 0, err
    keys = [p.key() for p in LONG_OP.problems_from_cli(cli.parser().parse_args(argv))]
    steps = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert [ln.split(" ")[1].rstrip(":") for ln in steps] == keys  # whole keys, one line each, in order
    assert steps[0].startswith("[1/2] ") and " us (3 trials, " in steps[0]
    assert "━" not in out and "\x1b" not in out and "\r" not in out  # no bars
    code, out, err = run(*argv[:-1], "tsv")  # the data on stdout, the progress on stderr
    assert code == 0 and sum(ln.startswith("[") for ln in err.splitlines()) == 2 and "[" not in out
    code, out, err = run(*argv, width=80, terminal=True)  # a terminal: a live display of bars
    assert code == 0 and "\x1b[?25l" in out and not any(ln.startswith("[1/2]") for ln in out.splitlines())


def test_retune_progress_in_a_log_is_one_line_per_problem(run, fake_gpu, tmp_path: Path) -> None:  # noqa: F811
    db = tmp_path / "r.yaml"
    dbmod.save_entries(db, [pool_entry(0, "sm_80"), pool_entry(1, "sm_80")])
    code, out, err = run("retune", "--db", str(db), "--format", "tsv")
    assert code == 0, err
    steps = [ln for ln in err.splitlines() if ln.startswith("[")]
    assert [ln.split(" ")[1:3] for ln in steps] == [["avgpool2d_bwd", pool_entry(i).problem + ":"] for i in (0, 1)]


@pytest.fixture
def quick_builds(monkeypatch):
    """library.build without a compiler: every instance 'builds' at once, one of them fails."""
    from ckgen.offline import library

    def fake(inst):
        ok = not inst.source.name.endswith(("_m4", "_br2_m2"))
        return library.Built(inst, ok, "" if ok else "error: made up", {})

    monkeypatch.setattr(library, "_build_cuda", fake)
    # nothing kept from (or for) real builds: the tests share one kernel cache (conftest)
    monkeypatch.setattr(library, "_kept", lambda inst, compiler: None)
    monkeypatch.setattr(library, "_keep", lambda built, compiler: None)
    monkeypatch.setattr(library, "toolchain_missing", lambda vendor: None if vendor == "cuda" else "no clang (made up)")


def test_generate_progress_in_a_log_and_its_summary(run, tmp_path: Path, quick_builds) -> None:
    from ckgen.offline import library

    out_dir = tmp_path / "g"
    argv = ("generate", "--ops", "maxpool2d_fwd,avgpool2d_fwd", "--target", "sm_90,gfx90a", "--defaults",
            "--out", str(out_dir))
    code, out, err = run(*argv, width=80)  # a pipe: the summary as TSV on stdout, the progress on stderr
    assert code == 1  # a failure and instances not built
    lines = err.splitlines()
    rendered = [ln for ln in lines if ln.startswith("[") and " rendered " in ln]
    assert [ln.split(" ")[2:4] for ln in rendered] == [["sm_90", "maxpool2d_fwd:"], ["sm_90", "avgpool2d_fwd:"],
                                                        ["gfx90a", "maxpool2d_fwd:"], ["gfx90a", "avgpool2d_fwd:"]]
    assert rendered[0].startswith("[1/4] rendered sm_90 maxpool2d_fwd: 10 problems (")
    built = [ln for ln in lines if ln.startswith("[") and " built " in ln]
    assert sorted(ln.split(" ")[3] for ln in built) == ["avgpool2d_fwd:", "maxpool2d_fwd:"]  # sm_90 only
    assert "━" not in err and "\x1b" not in err and "\r" not in err
    instances = library.plan(["sm_90"], ["maxpool2d_fwd", "avgpool2d_fwd"], from_db=False)
    failed = sum(i.source.name.endswith(("_m4", "_br2_m2")) for i in instances)
    (rows,) = tsv(out)
    assert {r["target"]: [r["instances"], r["built"], r["failed"], r["not_built"]] for r in rows}["sm_90"] == [
        str(len(instances)), str(len(instances) - failed), str(failed), "0"]
    code, out, err = run(*argv, "--format", "table", width=80)  # the same as a table, and the notes beside it
    lines = out.splitlines()
    summary = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:6]]
               for ln in lines if ln.startswith("│ ") and ("sm_90" in ln or "gfx90a" in ln)}
    assert summary["sm_90"] == [str(len(instances)), str(len(instances) - failed), str(failed), "0"]
    assert summary["gfx90a"][1:] == ["0", "0", summary["gfx90a"][0]]
    assert f"{2 * len(instances)} instances under {out_dir} in " in " ".join(lines)
    assert f"built {len(instances) - failed} of {2 * len(instances)} instances" in out
    code, out, _ = run("generate", "--ops", "maxpool2d_fwd", "--target", "sm_90", "--defaults", "--no-compile",
                       "--out", str(out_dir), "--format", "table", width=80)
    assert code == 0 and "not built (--no-compile)" in out and not any(" built " in ln for ln in out.splitlines()
                                                                        if ln.startswith("["))
