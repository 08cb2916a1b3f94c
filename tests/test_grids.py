"""`ckgen tune OP --grid NAME`: the named problem lists of the tuning spaces (tuning_spaces/*.yaml,
`grids`). Every grid builds, holds distinct problems that round-trip through their keys and have a
valid config on the archs we ship for, covers the dtypes and layouts, and the models it names
(Stable Diffusion UNet/VAE GroupNorms, ResNet/VGG/detection pooling); `ckgen tune OP --list`
shows them without a GPU. No GPU needed."""
from __future__ import annotations

import itertools
import json

import pytest

from ckgen.ops import all_ops, get_op
from ckgen.ops.spec import full_shapes
from ckgen.types import Config, Target

GROUPNORM = ["groupnorm_fwd", "groupnorm_bwd", "groupnorm_bwd_data", "groupnorm_bwd_gamma_beta"]
POOL = ["maxpool2d_fwd", "maxpool2d_bwd", "avgpool2d_fwd", "avgpool2d_bwd"]


def _some_valid_config(op, problem, target, good: list[Config]) -> Config | None:
    """A valid config for `problem`: one that served an earlier problem, else the first of the
    space (walked lazily: enumerating groupnorm_fwd's whole space takes seconds)."""
    for c in good:
        if op.validate(problem, c, target):
            return c
    names = list(op.space.params)
    for combo in itertools.product(*(op.space.params[n] for n in names)):
        c = Config.of(dict(zip(names, combo)))
        if op.space.check(c) and op.validate(problem, c, target):
            good.append(c)
            return c
    return None


@pytest.mark.parametrize("name", GROUPNORM + POOL)
def test_every_grid_builds_distinct_problems_with_a_valid_config(name):
    op = get_op(name)
    assert op.grid_names()[0] == "default" and len(op.grid_names()) >= 4
    good: dict[str, list[Config]] = {}
    for grid in op.grid_names():
        problems = op.grid_problems(grid)
        assert problems and len(set(problems)) == len(problems), grid
        assert op.grid_about(grid), f"{name} grid {grid} has no `about`"
        if grid != "default":
            assert {p.dtype for p in problems} == {"fp32", "fp16", "bf16"}, grid
            assert {p.layout for p in problems} == {"nchw", "nhwc"}, grid
        for p in problems:
            assert op.problem_from_key(p.key()) == p
            for arch in ("sm_90", "gfx942"):
                assert _some_valid_config(op, p, Target.named(arch), good.setdefault(arch, [])) is not None, \
                    (grid, arch, p.key())


def test_groupnorm_ops_share_their_grids():
    ref = get_op(GROUPNORM[0])
    for name in GROUPNORM[1:]:
        op = get_op(name)
        assert op.grid_names() == ref.grid_names()
        for grid in ref.grid_names():
            assert [p.key() for p in op.grid_problems(grid)] == [p.key() for p in ref.grid_problems(grid)], grid


def test_stable_diffusion_grids_cover_the_unet_and_vae_groupnorms():
    op = get_op("groupnorm_fwd")
    for grid, sizes in (("sd15-unet", {8, 16, 32, 64}), ("sdxl-unet", {32, 64, 128}),
                        ("sd-vae", {64, 128, 256, 512})):
        ps = op.grid_problems(grid)
        assert {p.G for p in ps} == {32} and {p.activation for p in ps} == {"none", "swish"}, grid
        assert {p.H for p in ps} == sizes and all(p.H == p.W for p in ps), grid
        assert min(p.N for p in ps) == 1 and max(p.N for p in ps) >= 4, grid
    unet = {p.C for p in op.grid_problems("sd15-unet")}
    assert {320, 640, 1280} <= unet and {960, 1920, 2560} <= unet  # the decoder's skip concatenations
    assert {p.C for p in op.grid_problems("sd-vae")} == {128, 256, 512}
    assert {p.N for p in op.grid_problems("sd15-unet")} == {1, 2, 4, 8}
    # the default problems' first shape (SD 1.5, batch 2) is in the SD 1.5 grid
    assert op.default_problems()[0] in op.grid_problems("sd15-unet")


def test_pooling_grids_cover_resnet_vgg_and_detection():
    mx, avg = get_op("maxpool2d_fwd"), get_op("avgpool2d_fwd")
    stem = [p for p in mx.grid_problems("resnet")]
    assert {(p.C, p.H, p.kernel, p.stride, p.padding) for p in stem} == {(64, 112, (3, 3), (2, 2), (1, 1))}
    assert {p.return_indices for p in stem} == {False, True} and {1, 256} <= {p.N for p in stem}
    vgg = mx.grid_problems("vgg")
    assert {(p.H, p.kernel, p.stride) for p in vgg} == {(h, (2, 2), (2, 2)) for h in (224, 112, 56, 28, 14)}
    assert {p.kernel for p in mx.grid_problems("detection")} >= {(3, 3), (1, 1), (5, 5)}
    gap = [p for p in avg.grid_problems("resnet") if p.kernel == (7, 7)]
    assert gap and all(p.H == p.W == 7 and p.OH == p.OW == 1 for p in gap)  # the global average
    assert {p.C for p in gap} == {512, 2048}
    assert {p.indices for p in get_op("maxpool2d_bwd").grid_problems("resnet")} == {"stored", "recompute"}


def test_batches_multiply_shapes_that_omit_n():
    assert full_shapes({"batches": [1, 8]}, [64, 112, 112], 4) == [(1, 64, 112, 112), (8, 64, 112, 112)]
    assert full_shapes({}, [2, 64, 112, 112], 4) == [(2, 64, 112, 112)]
    with pytest.raises(ValueError, match="expected 3 numbers"):
        full_shapes({"batches": [1]}, [2, 64, 112, 112], 4)


def test_tune_list_shows_the_problems_it_would_tune_then_the_grids_without_a_gpu(inproc, monkeypatch):
    from ckgen.runtime import target

    monkeypatch.setattr(target, "gpu_status", lambda: "no GPU here")  # --list never asks
    code, out, err = inproc("tune", "groupnorm_fwd", "--list", "--format", "json")
    assert code == 0, err
    op = get_op("groupnorm_fwd")
    doc = json.loads(out)
    assert [p["problem"] for p in doc["problems"]] == [p.key() for p in op.default_problems()]
    code, out, err = inproc("tune", "groupnorm_fwd", "--list", "--dtype", "fp32", "--format", "tsv")
    assert code == 0, err
    assert out.split("\n\n")[0].splitlines()[2:] == [p.key() for p in op.default_problems(["fp32"])]
    assert [(g["grid"], g["problems"]) for g in doc["grids"]] == [(g, len(op.grid_problems(g)))
                                                                  for g in op.grid_names()]
    code, out, err = inproc("tune", "groupnorm_fwd", "--grid", "sd-vae", "--list", "--dtype", "bf16", "--layout",
                            "nhwc", "--activation", "swish", "--format", "tsv")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "problem"
    assert lines[1:] == [p.key() for p in op.grid_problems("sd-vae", ["bf16"], ["nhwc"], ["swish"])]
    code, out, err = inproc("tune", "maxpool2d_fwd", "--grid", "vgg", "--list", "--format", "table")
    assert code == 0 and "maxpool2d_fwd, grid vgg: 180 problems" in out
    code, out, err = inproc("tune", "maxpool2d_fwd", "--grid", "vgg", "--shape", "1,2,3,4", "--kernel", "2", "--list")
    assert code == 2 and "--grid: give either --grid or --shape" in err


def test_ckgen_list_names_each_ops_grids(inproc):
    code, out, err = inproc("list", "--format", "json")
    assert code == 0, err
    got = {o["op"]: o["grids"] for o in json.loads(out)["ops"]}
    assert got == {op.name: op.grid_names() for op in all_ops()}
