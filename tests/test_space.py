"""CPU tests of tuning spaces (ckgen.space) against tuning_spaces/groupnorm_fwd.yaml."""
from __future__ import annotations

import copy
import itertools
import math
import time

import pytest
import yaml

from ckgen.ops.spec import Config
from ckgen.resources import tuning_spaces_dir
from ckgen.space import Space, _parse, load_space

OP = "groupnorm_fwd"


@pytest.fixture(scope="module")
def space() -> Space:
    return load_space(OP)


@pytest.fixture(scope="module")
def doc() -> dict:
    text = (tuning_spaces_dir() / f"{OP}.yaml").read_text()
    return yaml.safe_load(text)


def _product(space: Space):
    names = list(space.params)
    for values in itertools.product(*(space.params[n] for n in names)):
        yield Config.of(dict(zip(names, values)))


# ------------------------------------------------------------------ loading


def test_yaml_loads_with_the_expected_shape(space: Space, doc: dict) -> None:
    assert space.op == OP == doc["op"]
    assert set(space.params) == set(doc["params"]["tile"]) | set(doc["params"]["algo"])
    for name, values in space.params.items():
        assert len(values) >= 1, name
        assert len(set(values)) == len(values), f"{name} lists a value twice"
    assert space.default == Config.of(doc["default"])
    assert len(space.constraints) == len(doc.get("constraints", []))
    shapes = space.default_problems["shapes"]
    assert shapes and all(len(s) == 5 for s in shapes)


def test_load_space_unknown_op_raises() -> None:
    with pytest.raises(ValueError, match="nosuchop"):
        load_space("nosuchop")


def test_default_passes_check(space: Space) -> None:
    ok = space.check(space.default)
    assert ok, ok.reason
    assert ok.reason == ""


# ------------------------------------------------------------------ enumerate


def _brute_force(space: Space) -> list[Config]:
    """The plain definition of the valid set: the whole product in declaration order, each point
    kept if every constraint's expression, evaluated on its values, holds."""
    codes = [compile(c.expr, "<constraint>", "eval") for c in space.constraints]
    names = list(space.params)
    out = []
    for values in itertools.product(*(space.params[n] for n in names)):
        point = dict(zip(names, values))
        if all(eval(code, {"__builtins__": {}}, dict(point)) for code in codes):  # noqa: S307
            out.append(Config.of(point))
    return out


SPACES = sorted(p.stem for p in tuning_spaces_dir().glob("*.yaml"))


@pytest.mark.parametrize("op", SPACES)
def test_enumerate_is_the_filtered_product_in_declaration_order(op: str) -> None:
    """The pruned enumeration (each constraint tested as soon as its knobs are bound) yields the
    same points in the same order as filtering the whole product; `check` agrees on a spread of
    the product's points, valid and not."""
    space = load_space(op)
    expected = _brute_force(space)
    assert space.enumerate() == tuple(expected)
    assert expected and space.default in expected
    valid = set(expected)
    size = math.prod(len(v) for v in space.params.values())
    assert len(valid) < size  # the constraints prune something
    names = list(space.params)
    sample = [Config.of(dict(zip(names, values))) for values in
              itertools.islice(itertools.product(*space.params.values()), 0, None, max(1, size // 3000))]
    assert {c for c in sample if space.check(c)} == {c for c in sample if c in valid}
    assert 0 < len(valid & set(sample)) < len(sample)  # both kinds of point are checked


def test_enumerating_the_largest_space_is_fast(doc: dict) -> None:
    """groupnorm_fwd (466,560 points in the product) enumerates from a fresh parse in well under
    2 s of this thread's CPU: every tuner, replay and test that lists valid configs starts here."""
    space = _parse(doc)
    cpu0 = time.thread_time()
    configs = space.enumerate()
    took = time.thread_time() - cpu0
    assert configs == load_space(OP).enumerate()
    assert took < 2.0, took


def test_enumerate_is_nonempty_and_exactly_the_valid_product(space: Space) -> None:
    configs = space.enumerate()
    assert len(configs) > 0
    assert len(set(configs)) == len(configs), "enumerate yields duplicates"
    assert all(space.check(c) for c in configs)
    assert space.default in configs
    # The constraints really prune something.
    assert len(configs) < math.prod(len(v) for v in space.params.values())


def test_every_enumerated_config_satisfies_each_constraint(space: Space) -> None:
    for c in space.enumerate():
        values = c.as_dict()
        assert set(values) == set(space.params)
        for k, v in values.items():
            assert v in space.params[k]
        for con in space.constraints:
            assert con.check(values), (c.key(), con.expr)


# ------------------------------------------------------------------ rejections with reasons


def test_unknown_key_is_rejected_naming_it(space: Space) -> None:
    cfg = Config.of(dict(space.default.as_dict(), bogus_knob=3))
    ok = space.check(cfg)
    assert not ok
    assert "bogus_knob" in ok.reason


@pytest.mark.parametrize("name", ["threads", "vec_bytes", "slice_in", "cluster"])
def test_missing_key_is_rejected_naming_it(space: Space, name: str) -> None:
    values = space.default.as_dict()
    del values[name]
    ok = space.check(Config.of(values))
    assert not ok
    assert name in ok.reason


@pytest.mark.parametrize("name, value", [("threads", 96), ("vec_bytes", 32), ("items", 3),
                                         ("slice_in", "smem"), ("cluster", 16), ("min_blocks", 0)])
def test_out_of_list_value_is_rejected_naming_it(space: Space, name: str, value: object) -> None:
    assert value not in space.params[name]
    ok = space.check(space.default.replace(**{name: value}))
    assert not ok
    assert name in ok.reason and repr(value) in ok.reason


@pytest.mark.parametrize("name, value", [("threads", 1024.0), ("threads", 256.0), ("min_blocks", True),
                                         ("cluster", True), ("vec_bytes", 16.0), ("items", "4")])
def test_value_of_the_wrong_type_is_rejected_even_if_equal(space: Space, name: str, value: object) -> None:
    """1024.0 == 1024 and True == 1: membership alone let them through,
    and the nearest path rendered `constexpr int BLOCK = 1024.0;`."""
    good = space.default.replace(**{name: type(space.default[name])(value)})
    assert space.check(good), "the same value with the space's type is a point of the space"
    ok = space.check(space.default.replace(**{name: value}))  # after the good one: memo keys by type
    assert not ok
    assert name in ok.reason and type(value).__name__ in ok.reason


def test_numpy_integers_are_ints_of_the_space(space: Space) -> None:
    np = pytest.importorskip("numpy")
    cfg = space.default.replace(threads=np.int64(space.default["threads"]))
    assert space.check(cfg)
    assert not space.check(space.default.replace(min_blocks=np.bool_(True)))


def test_each_yaml_constraint_rejects_with_its_reason(space: Space) -> None:
    assert space.constraints, "the space declares no constraints"
    for con in space.constraints:
        # A point of the product that breaks this constraint and only this one.
        hit = next((c for c in _product(space)
                    if not con.check(c.as_dict())
                    and all(o.check(c.as_dict()) for o in space.constraints if o is not con)), None)
        assert hit is not None, f"constraint {con.expr!r} never binds alone"
        ok = space.check(hit)
        assert not ok
        assert ok.reason == con.reason
        assert hit not in space.enumerate()


def test_named_constraints_mention_the_offending_knobs(space: Space) -> None:
    base = space.default.as_dict()
    ok = space.check(Config.of(dict(base, slice_in="reload", items=16)))
    assert not ok and "reload" in ok.reason
    ok = space.check(Config.of(dict(base, threads=1024, min_blocks=4)))
    assert not ok and "min_blocks" in ok.reason


# ------------------------------------------------------------------ ordering


def test_by_distance_from_default_starts_with_default(space: Space) -> None:
    order = space.by_distance_from_default()
    assert order[0] == space.default
    assert set(order) == set(space.enumerate()) and len(order) == len(space.enumerate())
    d = space.default.as_dict()
    diffs = [sum(c.as_dict()[k] != d[k] for k in d) for c in order]
    assert diffs == sorted(diffs), "not ordered by the number of differing knobs"
    assert diffs[1] == 1


# ------------------------------------------------------------------ _parse


def _mini_doc(op: str) -> dict:
    return {
        "op": op,
        "params": {"tile": {"threads": [128, 256], "vec_bytes": [4, 8]},
                   "algo": {"mode": ["a", "b"]}},
        "constraints": [{"expr": "threads * vec_bytes <= 1024", "reason": "tile too big"}],
        "default": {"threads": 128, "vec_bytes": 4, "mode": "a"},
    }


def test_parse_mini_space() -> None:
    sp = _parse(_mini_doc("test_space_mini_ok"))
    assert sp.check(sp.default)
    got = {(c["threads"], c["vec_bytes"], c["mode"]) for c in sp.enumerate()}
    assert got == {(t, v, m) for t in (128, 256) for v in (4, 8) for m in "ab" if t * v <= 1024}
    assert sp.check(Config.of({"threads": 256, "vec_bytes": 8, "mode": "a"})).reason == "tile too big"


def test_space_of_many_knobs_enumerates_the_filtered_product() -> None:
    """More knobs than the generated enumeration nests loops for: the leading knobs share one loop
    over their product, and the order and the set stay those of the filtered product."""
    knobs = {f"k{i:02d}": [0, 1] if i in (0, 1, 2, 17) else [i] for i in range(18)}
    doc = {"op": "test_space_many_knobs", "params": {"tile": knobs},
           "constraints": [{"expr": "k00 + k01 <= 1", "reason": "head"},
                           {"expr": "k17 >= k02", "reason": "last"}],
           "default": {k: v[0] for k, v in knobs.items()}}
    sp = _parse(doc)
    assert sp.enumerate() == tuple(_brute_force(sp))
    assert len(sp.enumerate()) == 3 * 3  # (k00, k01) in 3 of 4, (k02, k17) in 3 of 4
    assert sp.check(sp.default.replace(k00=1, k01=1)).reason == "head"


@pytest.mark.parametrize("expr, words", [("threads * ", "not a Python expression"),
                                         ("threads * warps <= 1024", "warps")])
def test_parse_rejects_a_constraint_it_cannot_evaluate(expr: str, words: str) -> None:
    d = _mini_doc("test_space_bad_constraint")
    d["constraints"].append({"expr": expr, "reason": "bad"})
    with pytest.raises(ValueError, match=words):
        _parse(d)


def test_constraints_name_knobs_only_not_builtins() -> None:
    d = _mini_doc("test_space_no_builtins")
    d["constraints"] = [{"expr": "len(mode) == 1", "reason": "uses a builtin"}]
    with pytest.raises(ValueError, match="len"):
        _parse(d)


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d["default"].update(threads=512), "threads"),
    (lambda d: d["default"].pop("mode"), "mode"),
    (lambda d: d["default"].update(extra=1), "extra"),
    (lambda d: d["default"].update(threads=256, vec_bytes=8), "tile too big"),
])
def test_parse_rejects_invalid_default(mutate, words: str) -> None:
    d = _mini_doc(f"test_space_bad_{words.replace(' ', '_')}")
    mutate(d)
    with pytest.raises(ValueError, match=words) as info:
        _parse(d)
    assert "default" in str(info.value)


def test_parse_rejects_invalid_default_of_real_doc_under_new_name(doc: dict) -> None:
    d = copy.deepcopy(doc)
    d["op"] = "test_space_copy"
    d["params"]["tile"]["threads"] = [128, 256]  # the default's 512 is now out of the list
    with pytest.raises(ValueError, match="threads"):
        _parse(d)


def test_parse_rejects_invalid_default_of_same_op(space: Space, doc: dict) -> None:
    space.check(space.default)  # the real space has seen its default
    d = copy.deepcopy(doc)
    d["params"]["tile"]["threads"] = [128, 256]
    with pytest.raises(ValueError, match="threads"):
        _parse(d)
