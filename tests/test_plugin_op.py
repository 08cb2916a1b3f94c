"""A plug-in op end to end without a GPU: the channel-wise scale of tests/plugin_chscale.py,
three files in a temporary folder and one `ckgen.ops.register` call (docs/adding-an-op.md's
worked example). Listed by the CLI, its space enumerates, every config renders and compiles
offline for sm_90, validate refuses with a reason, the dispatcher picks for it on a DB miss
(the cost model's fallback), records and `ckgen tune --list` take it, and the reference matches
a plain loop."""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import os

import numpy as np
import pytest

import plugin_chscale
from ckgen.ops import all_ops, get_op, register, unregister
from ckgen.ops.spec import Config, Target

SM90 = Target.named("sm_90")
DTYPES = ("fp32", "fp16", "bf16")
LAYOUTS = ("nchw", "nhwc")
WORKERS = max(1, min(4, os.cpu_count() or 1))  # NVRTC releases the GIL


@pytest.fixture(scope="module")
def op(tmp_path_factory):
    spec = plugin_chscale.install(tmp_path_factory.mktemp("plugin"))
    yield spec
    plugin_chscale.uninstall()


def _problem(op, dtype="bf16", layout="nchw", **kw):
    return op.parse_problem(**{"N": 2, "C": 24, "H": 7, "W": 8, **kw}, dtype=dtype, layout=layout)


def test_registered_and_listed(op, inproc) -> None:
    from ckgen import codegen

    assert get_op("chscale") is op and op in all_ops()
    assert codegen.templates_digest() != codegen._digest(())  # tuning studies see the op's template too
    code, out, err = inproc("list")
    assert code == 0 and "chscale" in out, err
    code, out, err = inproc("list", "--op", "chscale")
    assert code == 0 and "threads" in out and "vec_bytes" in out and "small" in out, (out, err)
    code, out, err = inproc("tune", "chscale", "--grid", "nope", "--list")
    assert code == 2 and f"({op.space_path})" in err, err  # messages name its own space file


def test_register_refuses_bad_ops(op, tmp_path) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register(type(op)())
    with pytest.raises(ValueError, match="ckgen's own"):
        unregister("groupnorm_fwd")

    class NoTemplate(type(op)):
        name = "chscale_missing"
        template = "nowhere.cu.j2"

    with pytest.raises(ValueError, match="no template 'nowhere.cu.j2'"):
        register(NoTemplate())
    with pytest.raises(TypeError, match="OpSpec"):
        register(object())  # type: ignore[arg-type]


def test_register_names_the_file_of_a_broken_space_or_template(op, tmp_path) -> None:
    """A plug-in space that is not YAML gave the parser's raw error without the file's name, and
    a template with a syntax error registered fine (and failed at the first render)."""
    bad_space = tmp_path / "bad_space.yaml"
    bad_space.write_text("op: chscale_bad\nparams: [unclosed\n")
    bad_template = tmp_path / "bad.cu.j2"
    bad_template.write_text("// {{ name }}\n{% if %}\n")

    class BadSpace(type(op)):
        name = "chscale_bad_space"
        space_path = bad_space

    class BadTemplate(type(op)):
        name = "chscale_bad_template"
        template = "bad.cu.j2"
        template_dir = tmp_path

    with pytest.raises(ValueError, match=f"{bad_space}.*not valid YAML.*line [0-9]+"):
        register(BadSpace())
    with pytest.raises(ValueError, match=r"bad\.cu\.j2.*line 2"):
        register(BadTemplate())
    assert {o.name for o in all_ops()}.isdisjoint({"chscale_bad_space", "chscale_bad_template"})


def test_space_enumerates_and_validate_gives_reasons(op) -> None:
    configs = list(op.space.enumerate())
    assert len(configs) == 4 * 3 - 1  # threads x vec_bytes, less 512 x 16 (the constraint)
    assert op.space.default in configs
    bad = Config.of({"threads": 512, "vec_bytes": 16})
    why = op.validate(_problem(op), bad, SM90)
    assert not why and "4 KiB" in why.reason
    # NCHW vectors along H*W = 7*9 = 63: only one-element vectors (fp32 at 4 bytes) fit
    odd = _problem(op, "fp16", "nchw", W=9)
    why = op.validate(odd, Config.of({"threads": 256, "vec_bytes": 8}), SM90)
    assert not why and "H*W=63 is not a multiple of the vector (4 elements)" in why.reason
    assert not any(op.validate(odd, c, SM90) for c in configs)  # fp16: no 2-byte vectors in this space
    fp32 = _problem(op, "fp32", "nchw", W=9)
    assert [c for c in configs if op.validate(fp32, c, SM90)] == [c for c in configs if c["vec_bytes"] == 4]


def test_every_config_renders_and_compiles_for_sm90(op) -> None:
    from ckgen.runtime.compile import compile_offline
    from ckgen.instance import InvalidConfig, render_instance

    jobs = []
    for dtype, layout in itertools.product(DTYPES, LAYOUTS):
        p = _problem(op, dtype, layout)
        for c in op.space.enumerate():
            if not op.validate(p, c, SM90):
                with pytest.raises(InvalidConfig):
                    render_instance(op, p, c, SM90)
                continue
            src = render_instance(op, p, c, SM90)
            assert src.name == op.instance_name(p, c) and f"void __launch_bounds__({c['threads']}) {src.name}(" in src.code
            assert src.code.startswith("// generated by ckgen from templates/chscale.cu.j2")
            jobs.append(src)
    assert len(jobs) == 6 * 11
    with cf.ThreadPoolExecutor(WORKERS) as ex:
        for src, b in zip(jobs, ex.map(lambda s: compile_offline(s, SM90), jobs)):
            assert b.cubin[:4] == b"\x7fELF" and src.name.encode() in b.cubin


def test_reference_matches_a_loop(op) -> None:
    rng = np.random.default_rng(0)
    for dtype, layout in itertools.product(DTYPES, LAYOUTS):
        p = _problem(op, dtype, layout, N=2, C=3, H=4, W=5)
        ins = op.make_inputs(p, rng)
        y = op.reference(p, ins)["y"]
        want = np.empty((2, 3, 4, 5))
        for n, c, h, w in itertools.product(range(2), range(3), range(4), range(5)):
            want[n, c, h, w] = ins["x"][n, c, h, w] * ins["s"][c]
        assert np.array_equal(y, want)
        # the buffers round-trip through the memory layout
        raw = {"y": op.pack_inputs(p, {"x": y, "s": ins["s"]})["x"]}
        assert np.allclose(op.unpack_outputs(p, raw)["y"], y, rtol=1e-2)


def test_problems_keys_grids_and_records(op) -> None:
    from ckgen.model.records import make_record

    ps = op.default_problems()
    assert len(ps) == 2 * 2 * 2 and all(op.problem_from_key(p.key()) == p for p in ps)
    assert len(op.grid_problems("small")) == 2 * 2 and op.grid_names() == ["default", "small"]
    p = ps[0]
    rec = make_record(op, p, SM90, "test", op.space.default, ok=True, time_us=1.0)
    assert rec["features"] == {"dtype_bytes": 2, "layout": p.layout, "N": p.N, "C": p.C, "HW": p.H * p.W,
                               "min_bytes": op.min_bytes(p)}
    assert op.explain_fields(p) == dict(N=p.N, C=p.C, H=p.H, W=p.W, dtype=p.dtype, layout=p.layout)
    assert op.sanitize_problems() and op.bench_ready


def test_bench_takes_the_op(op, inproc, monkeypatch) -> None:
    """`ckgen bench` has the op (it has `bench_callables`): the eager side runs (on CPU here), the
    ckgen side is the plug-in's public function, a GPU call."""
    torch = pytest.importorskip("torch")
    import ckgen.runtime.target
    from ckgen.offline.opbench import OPS, _explain_fields, callables, suite

    assert "chscale" in OPS and list(OPS)[-1] == "chscale"  # after ckgen's own, in registration order
    p = op.parse_problem(N=2, C=8, H=5, W=6, dtype="fp32", layout="nhwc")
    ours, eager, what = callables("chscale", p, device="cpu")
    y = eager()
    assert what == "x * s[None, :, None, None]" and y.shape == (2, 8, 5, 6) and torch.isfinite(y).all()
    assert y.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(TypeError, match="GPU"):
        ours()
    assert _explain_fields("chscale", suite("chscale", True)[0]).keys() == {"N", "C", "H", "W", "dtype", "layout"}
    monkeypatch.setattr(ckgen.runtime.target, "gpu_status", lambda: "faked: none here")
    code, out, err = inproc("bench", "--ops", "chscale")
    assert code == 2 and err.strip() == "ckgen bench: no usable GPU (faked: none here)", err


def test_tune_list_and_shape_through_the_cli(op, inproc) -> None:
    code, out, err = inproc("tune", "chscale", "--list")
    assert code == 0 and "small" in out, err
    code, out, err = inproc("tune", "chscale", "--shape", "2,16,4,4", "--dtype", "fp32", "--list")
    assert code == 0 and "N=2,C=16,H=4,W=4,dtype=fp32,layout=nchw" in out, (out, err)
    code, out, err = inproc("tune", "chscale", "--shape", "2,16,4,4", "--kernel", "3", "--list")
    assert code == 2 and "--kernel: chscale takes no --kernel" in err


def test_explain_and_generate_through_the_cli(op, inproc, tmp_path) -> None:
    code, out, err = inproc("explain", "chscale", "--shape", "2,64,8,8", "--arch", "sm_90")
    assert code == 0 and "chscale_bf16_nchw_t256_v16" in out and "default" in out, (out, err)
    code, out, err = inproc("generate", "--ops", "chscale", "--defaults", "--no-compile", "--target", "sm_90",
                            "--out", str(tmp_path / "lib"))
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "lib").rglob("chscale_*.cu")) == [
        f"chscale_{d}_{l}_t256_v16.cu" for d in ("bf16", "fp32") for l in ("nchw", "nhwc")]


def test_explain_picks_without_a_tuned_entry(op) -> None:
    import ckgen
    from ckgen.runtime.dispatch import dispatcher

    p = _problem(op, "bf16", "nhwc", C=64)
    choice, src = dispatcher().choose(op, p, SM90)
    assert choice.source in ("model", "nearest", "default") and op.validate(p, choice.config, SM90)
    assert src.name == choice.instance
    assert ckgen.explain("chscale", arch="sm_90", **op.explain_fields(p)).instance == choice.instance


def test_cost_model_picks_on_a_db_miss(op, model_on) -> None:
    """With the cost model on (as users have it), an untuned problem of the plug-in gets a pick:
    the model asks the op only through OpSpec hooks, whose defaults the plug-in keeps."""
    from ckgen.runtime.dispatch import dispatcher

    p = _problem(op, "fp16", "nhwc", C=128, H=32, W=32)
    choice, _ = dispatcher().choose(op, p, SM90)
    assert choice.source in ("model", "default") and op.validate(p, choice.config, SM90), choice


def test_a_plugin_family_adds_its_cli_options(op, inproc) -> None:
    """`problem_options`: a family's group joins `ckgen tune` / `explain` (after ckgen's own), and
    only the ops naming an option in their tune_options take it."""
    from ckgen.ops.spec import OptionGroup, ProblemOption

    class WithOption(type(op)):
        name = "chscale_opt"
        tune_options = ("repeat",)
        problem_options = OptionGroup("channel scale problem", "for chscale_opt", (
            ProblemOption("--repeat", "times to apply the scale (default: 1)", type="positive_int"),))

        def problems_from_cli(self, args):
            assert args.repeat == 2
            return super().problems_from_cli(args)

    register(WithOption())
    try:
        code, out, err = inproc("tune", "--help")
        assert code == 0 and out.index("pooling problem") < out.index("channel scale problem:") < out.index("times to apply")
        code, out, err = inproc("tune", "chscale_opt", "--shape", "2,16,4,4", "--repeat", "2", "--list")
        assert code == 0 and "N=2,C=16,H=4,W=4" in out, err
        code, out, err = inproc("tune", "chscale_opt", "--shape", "2,16,4,4", "--repeat", "0", "--list")
        assert code == 2 and "must be a positive integer" in err
        code, out, err = inproc("explain", "groupnorm_fwd", "--repeat", "2", "--arch", "sm_90")
        assert code == 2 and "--repeat: groupnorm_fwd takes no --repeat (it is an option of chscale_opt)" in err
    finally:
        unregister("chscale_opt")
