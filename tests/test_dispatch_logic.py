"""CPU tests of the dispatcher's selection (tuned -> nearest -> default), without a GPU."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import pytest

import ckgen
from ckgen.runtime import db as dbmod
from ckgen import settings
from ckgen.runtime.dispatch import Choice, Dispatcher, dispatcher
from ckgen.instance import render_instance
from ckgen.ops import get_op
from ckgen.ops.spec import Config, Target

OP = get_op("groupnorm_fwd")
SM90 = Target.named("sm_90")
SM80 = Target.named("sm_80")


def problem(N=2, C=320, H=64, W=64, G=32, dtype="bf16", layout="nchw", activation="none"):
    return OP.parse_problem(N=N, C=C, H=H, W=W, G=G, dtype=dtype, layout=layout, activation=activation)


def entry(p, config: Config, target: Target = SM90, sha: str | None = None, time_us: float = 10.0):
    src = render_instance(OP, p, config, target)
    return dbmod.Entry(op=OP.name, vendor=target.vendor, arch=target.arch, device="test device",
                       problem=p.key(), config=config.items, instance=src.name,
                       source_sha256=sha or src.sha256, time_us=time_us, gbps=1000.0,
                       default_time_us=20.0, provenance={"date": "2026-01-01T00:00:00+00:00"})


def save(*entries) -> None:
    dbmod.save_entries(settings.user_db_path(), entries)


def valid(p, target: Target = SM90, **want) -> Iterator[Config]:
    """The space's configs with the knob values `want` that are valid for p, lazily (the module's
    configs below are picked at import: only as many are validated as it takes to find them)."""
    return (c for c in OP.space.enumerate() if all(c[k] == v for k, v in want.items()) and OP.validate(p, c, target))


@pytest.fixture(autouse=True)
def _no_shipped_db(tmp_path: Path, monkeypatch):
    """Only the test's user DB counts: a shipped DB in the package must not change the answers."""
    monkeypatch.setattr(dbmod, "shipped_db_path", lambda: tmp_path / "shipped-none.yaml")
    assert settings.user_db_path().parent == tmp_path / "cache"  # conftest isolated it
    ckgen.reload_db()
    yield
    ckgen.reload_db()


@pytest.fixture
def d() -> Dispatcher:
    return Dispatcher()


P = problem()
# A config valid for P (and every N of its shape) that is not the default.
X = next(c for c in valid(P, cluster=1, slice_in="regs") if c != OP.space.default)
Y = next(c for c in valid(P, cluster=1, slice_in="reload", threads=256) if c not in (X, OP.space.default))


def test_module_configs_are_distinct_and_valid() -> None:
    assert len({X, Y, OP.space.default}) == 3
    for c in (X, Y, OP.space.default):
        assert OP.validate(P, c, SM90) and OP.validate(P, c, SM80)


# ------------------------------------------------------------------ tuned


def test_exact_match_is_tuned(d: Dispatcher, caplog) -> None:
    save(entry(P, X), entry(problem(N=4), Y))
    with caplog.at_level(logging.WARNING, logger="ckgen"):
        choice, src = d.choose(OP, P, SM90)
    assert isinstance(choice, Choice)
    assert choice.source == "tuned"
    assert choice.config == X
    assert choice.entry is not None and choice.entry.problem == P.key()
    assert choice.instance == src.name == OP.instance_name(P, X)
    assert src.sha256 == choice.entry.source_sha256
    assert not [r for r in caplog.records if r.name == "ckgen"], "a tuned choice logs nothing"


def test_user_db_wins_over_shipped_db(d: Dispatcher, tmp_path: Path, monkeypatch) -> None:
    shipped = tmp_path / "shipped.yaml"
    dbmod.save_entries(shipped, [entry(P, Y), entry(problem(N=8), Y)])
    monkeypatch.setattr(dbmod, "shipped_db_path", lambda: shipped)
    save(entry(P, X))
    assert d.choose(OP, P, SM90)[0].config == X
    choice = d.choose(OP, problem(N=8), SM90)[0]
    assert (choice.source, choice.config) == ("tuned", Y)


def test_stale_entry_is_not_tuned(d: Dispatcher) -> None:
    save(entry(P, X, sha="0" * 64))
    choice, src = d.choose(OP, P, SM90)
    assert choice.source != "tuned"
    assert "stale" in choice.reason
    assert choice.source == "default" and choice.config == OP.space.default
    assert src.name == choice.instance


def test_stale_entry_falls_back_to_a_neighbour(d: Dispatcher) -> None:
    save(entry(P, X, sha="f" * 64), entry(problem(N=4), Y))
    choice, _ = d.choose(OP, P, SM90)
    assert choice.source == "nearest" and choice.config == Y
    assert "stale" in choice.reason


def test_entry_whose_config_is_invalid_here_is_unusable(d: Dispatcher) -> None:
    # A config that was valid for a small H*W (the whole slice in registers) but not for P.
    small = problem(H=8, W=8)
    cfg = next(c for c in valid(small, cluster=1, slice_in="regs") if not OP.validate(P, c, SM90))
    e = entry(small, cfg)
    save(dbmod.Entry(**{**e.__dict__, "problem": P.key()}))
    choice, _ = d.choose(OP, P, SM90)
    assert choice.source == "default"
    assert "unusable" in choice.reason


# ------------------------------------------------------------------ nearest / default


def test_untuned_problem_uses_nearest_valid_entry(d: Dispatcher) -> None:
    near, far = problem(N=4), problem(N=32, H=128, W=128)
    assert OP.distance(P, near) < OP.distance(P, far)
    save(entry(far, Y), entry(near, X))
    choice, src = d.choose(OP, P, SM90)
    assert choice.source == "nearest"
    assert choice.config == X
    assert choice.entry.problem == near.key()
    assert near.key() in choice.reason
    assert src.name == OP.instance_name(P, X)
    # the instance is rendered for the asked problem and target
    assert src.sha256 == render_instance(OP, P, X, SM90).sha256


def test_nearest_skips_entries_invalid_for_the_problem(d: Dispatcher) -> None:
    small = problem(H=8, W=8)
    cfg = next(c for c in valid(small, cluster=1, slice_in="regs") if not OP.validate(P, c, SM90))
    far = problem(N=256)
    assert OP.distance(P, small) < OP.distance(P, far)
    save(entry(small, cfg), entry(far, Y))
    choice, _ = d.choose(OP, P, SM90)
    assert (choice.source, choice.config) == ("nearest", Y)


def test_neighbour_with_float_or_bool_config_values_is_skipped(d: Dispatcher) -> None:
    """threads: 1024.0 / min_blocks: true in a DB entry compare equal to the space's ints; the
    nearest path took them and rendered `constexpr int BLOCK = 1024.0;`."""
    near = problem(N=4)
    bad_threads = X.replace(threads=float(X["threads"]))
    bad_blocks = Y.replace(min_blocks=bool(Y["min_blocks"])) if Y["min_blocks"] == 1 else \
        Y.replace(min_blocks=float(Y["min_blocks"]))
    as_read = [dbmod.Entry(**{**entry(q, c).__dict__, "config": bad.items})  # as a hand edit leaves them
               for q, c, bad in ((near, X, bad_threads), (problem(N=8), Y, bad_blocks))]
    save(*as_read)
    choice, src = d.choose(OP, P, SM90)
    assert choice.source == "default" and choice.config == OP.space.default
    assert ".0;" not in src.code and "= True" not in src.code
    assert all(type(v) is type(OP.space.default[k]) for k, v in choice.config.items)


def test_untuned_without_usable_neighbour_is_default(d: Dispatcher) -> None:
    small = problem(H=8, W=8)
    cfg = next(c for c in valid(small, cluster=1, slice_in="regs") if not OP.validate(P, c, SM90))
    save(entry(small, cfg))
    choice, src = d.choose(OP, P, SM90)
    assert choice.source == "default"
    assert choice.config == OP.space.default
    assert choice.entry is None
    assert "ckgen tune groupnorm_fwd" in choice.reason
    assert src.name == OP.instance_name(P, OP.space.default)


def test_empty_db_and_invalid_default_gives_nearest_valid_to_default(d: Dispatcher) -> None:
    p = problem(layout="nhwc")  # C/G = 10: the default's 8-wide bf16 vector does not fit
    assert not OP.validate(p, OP.space.default, SM90)
    choice, _ = d.choose(OP, p, SM90)
    assert choice.source == "default"
    want = next(c for c in OP.space.by_distance_from_default() if OP.validate(p, c, SM90))
    assert choice.config == want
    assert "nearest the default" in choice.reason


def test_other_arch_entry_is_not_used(d: Dispatcher) -> None:
    save(entry(P, X, SM80), entry(problem(N=4), X, SM80))
    choice, _ = d.choose(OP, P, SM90)
    assert choice.source == "default"
    assert choice.config == OP.space.default != X
    assert choice.entry is None
    on80, src80 = d.choose(OP, P, SM80)
    assert (on80.source, on80.config) == ("tuned", X)
    assert src80.sha256 == on80.entry.source_sha256


def test_other_op_and_activation_are_different_problems(d: Dispatcher) -> None:
    save(entry(problem(activation="swish"), X))
    choice, _ = d.choose(OP, P, SM90)
    assert choice.source == "nearest"  # a neighbour, never an exact hit
    assert choice.instance == OP.instance_name(P, X) and "swish" not in choice.instance


# ------------------------------------------------------------------ alignment


def test_max_vec_bytes_forces_narrow_vectors(d: Dispatcher) -> None:
    wide = next(c for c in valid(P, cluster=1, vec_bytes=16) if c != OP.space.default)
    save(entry(P, wide))
    assert d.choose(OP, P, SM90)[0].source == "tuned"
    for max_vec in (8, 4, 2):
        choice, src = d.choose(OP, P, SM90, max_vec_bytes=max_vec)
        assert choice.source != "tuned"
        assert choice.config["vec_bytes"] <= max_vec
        assert "unusable" in choice.reason and f"{max_vec}-byte" in choice.reason
        assert OP.validate(P, choice.config, SM90)
        assert src.name == OP.instance_name(P, choice.config)


def test_max_vec_bytes_applies_to_neighbours(d: Dispatcher) -> None:
    wide = next(c for c in valid(P, cluster=1, vec_bytes=16) if c != OP.space.default)
    narrow = next(c for c in valid(P, cluster=1, vec_bytes=4) if c != OP.space.default)
    save(entry(problem(N=4), wide), entry(problem(N=16), narrow))
    assert d.choose(OP, P, SM90)[0].config == wide
    choice = d.choose(OP, P, SM90, max_vec_bytes=4)[0]
    assert (choice.source, choice.config) == ("nearest", narrow)


def test_no_config_at_all_raises(d: Dispatcher) -> None:
    p = problem(dtype="fp32")
    with pytest.raises(ValueError, match="no config"):
        d.choose(OP, p, SM90, max_vec_bytes=2)  # no fp32 vector fits in 2 bytes


# ------------------------------------------------------------------ the fallback notice


def _notices(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ckgen" and r.levelno >= logging.WARNING]


def test_fallback_notice_logged_once_per_problem(d: Dispatcher, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="ckgen"):
        first = d.choose(OP, P, SM90)
        second = d.choose(OP, P, SM90)
        d.choose(OP, P, SM90, max_vec_bytes=8)  # another cache key, same problem: still quiet
    assert first == second
    notes = _notices(caplog)
    assert len(notes) == 1
    assert P.key() in notes[0].getMessage() and "default" in notes[0].getMessage()
    with caplog.at_level(logging.WARNING, logger="ckgen"):
        d.choose(OP, problem(N=3), SM90)
    assert len(_notices(caplog)) == 2  # a new problem gets its own notice


def test_fallback_notice_again_after_reload(d: Dispatcher, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="ckgen"):
        d.choose(OP, P, SM90)
        d.reload()
        d.choose(OP, P, SM90)
    assert len(_notices(caplog)) == 2


def test_quiet_setting_silences_the_notice(d: Dispatcher, caplog, monkeypatch) -> None:
    monkeypatch.setenv(settings.ENV_QUIET, "1")
    with caplog.at_level(logging.WARNING, logger="ckgen"):
        choice, _ = d.choose(OP, P, SM90)
    assert choice.source == "default"
    assert not _notices(caplog)


def test_choice_is_cached_until_reload(d: Dispatcher) -> None:
    assert d.choose(OP, P, SM90)[0].source == "default"
    save(entry(P, X))
    assert d.choose(OP, P, SM90)[0].source == "default"  # DB read once
    d.reload()
    assert d.choose(OP, P, SM90)[0].source == "tuned"


# ------------------------------------------------------------------ explain


def test_explain_without_gpu() -> None:
    kw = dict(N=2, C=320, H=64, W=64, G=32, dtype="bf16", layout="nhwc")
    choice = ckgen.explain("groupnorm_fwd", **kw, arch="sm_90")
    p = problem(layout="nhwc")
    assert isinstance(choice, Choice)
    assert choice.op == "groupnorm_fwd" and choice.problem == p.key()
    assert choice.source == "default"
    assert choice.instance.startswith("ckgen_groupnorm_fwd_bf16_nhwc")
    assert OP.validate(p, choice.config, SM90)
    assert "groupnorm_fwd" in str(choice) and "[default]" in str(choice)

    cfg = next(valid(p, cluster=2))
    save(entry(p, cfg))
    ckgen.reload_db()
    tuned = ckgen.explain("groupnorm_fwd", **kw, arch="sm_90")
    assert (tuned.source, tuned.config) == ("tuned", cfg)
    # the same DB entry is for sm_90 only
    other = ckgen.explain("groupnorm_fwd", **kw, arch="sm_80")
    assert other.source == "default" and other.config["cluster"] == 1


def test_explain_returns_the_choice_without_logging_it(caplog) -> None:
    """`print(ckgen.explain(...))` shows the choice once: explain does not log it, and the
    problem's later selections (its calls) count it as told; another problem is still told."""
    kw = dict(N=2, C=320, H=64, W=64, G=32, dtype="bf16", layout="nhwc")
    with caplog.at_level(logging.WARNING, logger="ckgen"):
        choice = ckgen.explain("groupnorm_fwd", **kw, arch="sm_90")
        assert choice.source == "default" and not _notices(caplog)
        ckgen.explain("groupnorm_fwd", **kw, arch="sm_90")
        dispatcher().choose(OP, problem(layout="nhwc"), SM90, max_vec_bytes=8)  # as a call of it would
        assert not _notices(caplog)
        dispatcher().choose(OP, problem(N=5), SM90)
    (note,) = _notices(caplog)
    assert problem(N=5).key() in note.getMessage()


def test_explain_rejects_bad_problems() -> None:
    with pytest.raises(ValueError, match="groups"):
        ckgen.explain("groupnorm_fwd", N=2, C=320, H=8, W=8, G=30, dtype="bf16", layout="nchw", arch="sm_90")
    with pytest.raises(ValueError, match="nosuchop"):
        ckgen.explain("nosuchop", N=1, arch="sm_90")
    with pytest.raises(ValueError, match="arch"):
        ckgen.explain("groupnorm_fwd", N=2, C=32, H=8, W=8, G=4, dtype="bf16", layout="nchw", arch="volta")


def test_explain_without_arch_needs_a_gpu() -> None:
    from ckgen.runtime.target import NoGPUError, gpu_status

    why = gpu_status()
    if why is None:
        pytest.skip("a GPU is usable here; explain uses it")
    with pytest.raises(NoGPUError):
        ckgen.explain("groupnorm_fwd", N=2, C=32, H=8, W=8, G=4, dtype="bf16", layout="nchw")
