"""The config cost model (ckgen/model/) and the tuning records (ckgen/model/records.py), CPU
tier: the model loads and ranks with no GPU, the dispatcher's model choice is always a valid
config, a missing or corrupt model file falls back to nearest-tuned with one warning, the
held-out problems are not in the training records, the tuner seeds from the model and records
every measurement, and a leave-one-out check on the recorded sweeps."""
from __future__ import annotations

import copy
import importlib.util
import json
import logging
import math
import multiprocessing as mp
import statistics
import time
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings as hsettings, strategies as st

import ckgen
from ckgen import model as cm
from ckgen.model import records
from ckgen.model import policy, store
from ckgen.runtime import db as dbmod
from ckgen import settings
from ckgen.runtime.dispatch import Dispatcher
from ckgen.instance import render_instance
from ckgen.ops import all_ops, get_op
from ckgen.ops.spec import Config, Target

ROOT = Path(__file__).resolve().parents[1]
SM90 = Target.named("sm_90")
GN = get_op("groupnorm_fwd")


def _heldout():
    spec = importlib.util.spec_from_file_location("heldout", ROOT / "bench" / "heldout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ loading and ranking


def test_packaged_model_loads_fast_without_a_gpu(model_on):
    assert cm.model_path() == cm.packaged_model_path()
    # The CPU time of this thread, best of 3: what the parse costs, not what other processes on the
    # machine take from it. CI's 2-core machine once took 1,012 ms of wall time for a load that
    # costs 30-55 ms of CPU (CI of 6088f12), while the workers and servers of the tests before it
    # shared the cores.
    took = []
    for _ in range(3):
        store._loaded.clear()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        model = cm.load()
        took.append((time.thread_time() - cpu0, time.perf_counter() - wall0))
    assert isinstance(model, cm.CostModel)
    cpu, wall = min(took)
    print(f"\ncost model: {model.summary()}; loaded in {1e3 * cpu:.1f} ms of CPU ({1e3 * wall:.1f} ms wall)")
    # ~2.3 MB of JSON (1,326 recorded problems), most of it the residual table in flat lists
    assert cpu < 0.2
    # sm_90 records of two devices: the H200's are the GroupNorm grid tunes and sweeps of 2026-11-28
    assert model.stats["devices"] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]


def test_model_ranks_deterministically_and_prefers_fewer_launches_when_tiny(model_on):
    p = GN.parse_problem(N=1, C=32, H=4, W=4, G=8, dtype="bf16", layout="nchw")
    valid = [c for c in GN.space.enumerate() if GN.validate(p, c, SM90)]
    ranked = model_on.rank(GN, p, valid, SM90)
    assert ranked == model_on.rank(GN, p, list(reversed(valid)), SM90)
    totals = [pred.total_us for pred, _ in ranked]
    assert totals == sorted(totals)
    best = ranked[0][1]
    assert len(GN.launches(p, best, SM90)) == 1  # a tiny problem is host-bound: one launch wins
    one = [pred for pred, c in ranked if c["merge"] == "cluster"]
    two = [pred for pred, c in ranked if c["merge"] == "global"]
    assert min(x.host_us for x in two) > min(x.host_us for x in one)


def test_model_prefers_splitting_few_large_slices(model_on):
    """The issue's 53x case: 1x4x1024x1024 G=2 NHWC has 2 slices; one block per slice (the
    default) streams 8 MB each through 2 SMs. The model predicts that slow and splits."""
    p = GN.parse_problem(N=1, C=4, H=1024, W=1024, G=2, dtype="bf16", layout="nhwc")
    d = GN.space.nearest_default(lambda c: bool(GN.validate(p, c, SM90)))
    pick, pred, _ = model_on.choose(GN, p, SM90, lambda c: bool(GN.validate(p, c, SM90)))
    blocks = GN.launches(p, pick, SM90)[-1].grid[0]
    assert blocks >= 32
    assert pred.gpu_us * 4 < model_on.predict(GN, p, d, SM90).gpu_us


def test_model_file_round_trips(model_on, tmp_path):
    p = GN.parse_problem(N=2, C=320, H=64, W=64, G=32, dtype="fp16", layout="nhwc")
    again = cm.CostModel.from_doc(json.loads(cm.dumps(model_on)))
    cands = cm.candidates(GN, p, SM90, model_on.winner_configs(GN), lambda c: bool(GN.validate(p, c, SM90)))
    assert model_on.rank(GN, p, cands, SM90) == again.rank(GN, p, cands, SM90)


def test_further_launches_have_their_own_floor(model_on):
    """A call's first launch pays floor_us, each further one floor_next_us (fitted, <= floor_us);
    a model file from before the split (no floor_next_us) charges floor_us for every launch,
    and a negative floor is rejected."""
    m = model_on
    assert 0 <= m.floor_next_us <= m.floor_us
    assert m.launch_us(1) == pytest.approx(m.floor_us)
    assert m.launch_us(3) == pytest.approx(m.floor_us + 2 * m.floor_next_us)
    doc = json.loads(cm.dumps(m))
    del doc["floor_next_us"]
    old = cm.CostModel.from_doc(doc)
    assert old.launch_us(3) == pytest.approx(3 * m.floor_us)
    with pytest.raises(cm.ModelError, match="out of range"):
        cm.CostModel.from_doc({**doc, "floor_next_us": -1.0})


def test_recompute_backward_counts_the_x_it_reads_again():
    """Max pool backward with the argmax recomputed: a thread reads the x under its covering
    outputs' windows; a 1-row tile at k3 s2 reads more of it per input than a 2-row one (the
    ResNet-stem sweeps time th=1 at ~2x), stored indices read no x at all."""
    op = get_op("maxpool2d_bwd")
    reread = cm.TERM_NAMES.index("reread")

    def phi(indices, th, tw, layout="nchw"):
        p = op.problem_from_key(f"N=32,C=64,H=112,W=112,k=3x3,s=2x2,p=1x1,d=1x1,ceil=0,dtype=fp32,"
                                f"layout={layout},indices={indices}")
        c = Config.of(dict(algo="gather", block_rows=1, min_blocks=4, th=th, threads=64, tw=tw, vec_bytes=4))
        assert op.validate(p, c, SM90), (indices, th, tw, layout)
        return cm.geometry(op, p, c, SM90).phi[reread]

    for layout in ("nchw", "nhwc"):
        assert phi("recompute", 1, 8, layout) > phi("recompute", 2, 8, layout) > 0
        assert phi("stored", 1, 8, layout) == phi("stored", 2, 8, layout) == 0


def _records_for(op, p, times: dict) -> list[dict]:
    return [records.make_record(op, p, SM90, "test", c, ok=True, time_us=t) for c, t in times.items()]


def test_measured_correction_follows_nearby_timings_and_only_those():
    """A config the records time far slower than the model predicts, on a problem next to the one
    asked about, is predicted slower there too (the residual table); on another arch, or with the
    correction off, the prediction is the roofline's alone."""
    near = GN.parse_problem(N=3, C=320, H=24, W=24, G=32, dtype="bf16", layout="nhwc")
    ask = GN.parse_problem(N=3, C=320, H=24, W=24, G=32, dtype="fp16", layout="nhwc")
    recorded = {r["problem"] for r in records.read(records.packaged_records_path())}
    assert near.key() not in recorded and ask.key() not in recorded
    valid = [c for c in GN.space.enumerate() if GN.validate(near, c, SM90) and GN.validate(ask, c, SM90)][:40]
    base = copy.deepcopy(cm.packaged_fit_data().fit())  # shared: changed below
    base.residuals = {}
    pred = {c: base.predict(GN, near, c, SM90).gpu_us for c in valid}
    slow = valid[5]
    times = {c: pred[c] * (8.0 if c == slow else 1.0) for c in valid}  # the model is right but for one
    model = cm.packaged_fit_data().extended(_records_for(GN, near, times)).fit()
    corr = dict(zip(valid, model.corrections(GN, ask, valid, SM90)))
    assert corr[slow] > 0.4  # log(8) = 2.1, weighted by exp(-distance) (dtype differs: 2) and shrunk
    assert statistics.median(abs(v) for c, v in corr.items() if c != slow) < 0.1 * corr[slow]
    ratio = model.predict(GN, ask, slow, SM90).gpu_us / model.predict(GN, ask, valid[6], SM90).gpu_us
    assert ratio > 1.4 * base.predict(GN, ask, slow, SM90).gpu_us / base.predict(GN, ask, valid[6], SM90).gpu_us
    # the problem's own records never correct it (a tuned problem is served from the DB anyway)
    own = dict(zip(valid, model.corrections(GN, near, valid, SM90)))
    assert abs(own[slow]) < 0.5 * corr[slow]
    assert model.corrections(GN, ask, valid, Target.named("sm_80")) == [0.0] * len(valid)
    model.correction = {"tau": 0.0, "prior": 0.2}
    assert model.corrections(GN, ask, valid, SM90) == [0.0] * len(valid)


def test_model_with_a_malformed_residual_table_is_rejected():
    doc = json.loads(cm.packaged_model_path().read_text())
    assert doc["residuals"] and doc["correction"]["tau"] > 0
    gn = doc["residuals"]["groupnorm_fwd"]
    out_of_range = {**gn, "problem": [len(gn["problems"])] + gn["problem"][1:]}
    not_finite = {**gn, "residual": [float("inf")] + gn["residual"][1:]}
    for bad in ({"groupnorm_fwd": []}, {"groupnorm_fwd": {"problems": []}}, [],
                {"groupnorm_fwd": out_of_range}, {"groupnorm_fwd": not_finite}):
        with pytest.raises(cm.ModelError, match="residuals"):
            cm.CostModel.from_doc({**doc, "residuals": bad})
    with pytest.raises(cm.ModelError, match="correction"):
        cm.CostModel.from_doc({**doc, "correction": {"tau": float("nan")}})


def test_packaged_model_is_fit_from_the_packaged_records():
    """A drift check, as for generated/: tools/build_records.py refits it (deterministic)."""
    fitted = cm.packaged_fit_data().fit()
    assert cm.dumps(fitted) == cm.packaged_model_path().read_text()


def test_fits_of_prepared_records_are_the_fits_of_those_records():
    """`FitData` prepares records once for several fits (leave-one-out, the replays' held-out
    models): its fit without one problem, and its fit with records added, are `fit` on exactly
    those records (the pooling forward records: a fit of seconds)."""
    recs = [r for r in records.read_cached(records.packaged_records_path())
            if r["op"] in ("maxpool2d_fwd", "avgpool2d_fwd")]
    data = cm.FitData(recs)
    held = next((r["op"], r["problem"]) for r in recs if r["op"] == "avgpool2d_fwd")
    rest = [r for r in recs if (r["op"], r["problem"]) != held]
    assert cm.dumps(data.fit(exclude=held)) == cm.dumps(cm.fit(rest))
    assert data.fit(exclude=held) is data.fit(exclude=held)  # remembered
    more, base = recs[: len(recs) // 3], recs[len(recs) // 3:]
    assert cm.dumps(cm.FitData(base).extended(more).fit()) == cm.dumps(cm.fit(base + more))
    assert cm.dumps(data.fit()) != cm.dumps(data.fit(exclude=held))


# ------------------------------------------------------------------ validity, property-based


def _gn_problem(op, data):
    G = data.draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    return op.parse_problem(N=data.draw(st.integers(1, 64)), C=G * data.draw(st.integers(1, 64)),
                            H=data.draw(st.integers(1, 96)), W=data.draw(st.integers(1, 96)), G=G,
                            dtype=data.draw(st.sampled_from(["fp32", "fp16", "bf16"])),
                            layout=data.draw(st.sampled_from(["nchw", "nhwc"])),
                            activation=data.draw(st.sampled_from(["none", "swish"])))


def _pool_problem(op, data):
    k = data.draw(st.integers(1, 5))
    kw = dict(N=data.draw(st.integers(1, 16)), C=data.draw(st.integers(1, 256)), H=data.draw(st.integers(1, 80)),
              W=data.draw(st.integers(1, 80)), dtype=data.draw(st.sampled_from(["fp32", "fp16", "bf16"])),
              layout=data.draw(st.sampled_from(["nchw", "nhwc"])), kernel=k, stride=data.draw(st.integers(1, 3)),
              padding=data.draw(st.integers(0, k // 2)), ceil_mode=data.draw(st.booleans()))
    if op.name == "maxpool2d_fwd":
        kw.update(dilation=data.draw(st.integers(1, 2)), return_indices=data.draw(st.booleans()))
    elif op.name == "maxpool2d_bwd":
        kw.update(dilation=data.draw(st.integers(1, 2)), indices=data.draw(st.sampled_from(["stored", "recompute"])))
    else:
        kw.update(count_include_pad=data.draw(st.booleans()))
    return op.parse_problem(**kw)


@pytest.mark.parametrize("op_name", [op.name for op in all_ops()])
@hsettings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_model_choice_is_always_a_valid_config(model_on, op_name, data):
    op = get_op(op_name)
    try:
        p = (_gn_problem if op_name.startswith("groupnorm") else _pool_problem)(op, data)
    except ValueError:
        assume(False)
    max_vec = data.draw(st.sampled_from([2, 4, 8, 16]))
    try:
        choice, src = Dispatcher().choose(op, p, SM90, max_vec)
    except ValueError as e:  # only when no config of the space runs it at all
        assert "no config of the tuning space" in str(e)
        assert not any(op.validate(p, c, SM90) and c["vec_bytes"] <= max_vec for c in op.space.enumerate())
        return
    assert choice.source == "model", choice
    assert op.validate(p, choice.config, SM90), choice
    assert choice.config["vec_bytes"] <= max_vec
    assert src.name == op.instance_name(p, choice.config)
    assert "predicts" in choice.reason


def test_tuner_seeds_are_valid_and_from_the_model(model_on):
    p = GN.parse_problem(N=3, C=96, H=40, W=24, G=24, dtype="fp32", layout="nhwc")
    ok = lambda c: bool(GN.validate(p, c, SM90))  # noqa: E731
    seeds = cm.top_configs(GN, p, SM90, 5, ok)
    assert len(seeds) == 5 == len(set(seeds)) and all(ok(c) for c in seeds)
    assert seeds[0] == model_on.choose(GN, p, SM90, ok)[0]


# ------------------------------------------------------------------ the dispatcher and its fallback


def _entry(p, config):
    src = render_instance(GN, p, config, SM90)
    return dbmod.Entry(op=GN.name, vendor="cuda", arch="sm_90", device="test device", problem=p.key(),
                       config=config.items, instance=src.name, source_sha256=src.sha256, time_us=10.0,
                       gbps=1000.0, default_time_us=20.0, provenance={"date": "2026-01-01T00:00:00+00:00"})


def test_explain_says_model_with_its_prediction(model_on, caplog):
    with caplog.at_level(logging.WARNING, logger="ckgen"):
        choice = ckgen.explain("groupnorm_fwd", N=2, C=96, H=30, W=30, G=8, dtype="fp16", layout="nhwc",
                               arch="sm_90")
    assert choice.source == "model"
    assert "cost model predicts" in choice.reason and " us " in choice.reason
    assert "[model]" in str(choice)
    assert "[model]" not in caplog.text  # returned to the caller, not logged as well


def test_exact_entry_still_wins_over_the_model(model_on):
    p = GN.parse_problem(N=2, C=96, H=30, W=30, G=8, dtype="fp16", layout="nhwc")
    cfg = next(c for c in GN.space.enumerate() if GN.validate(p, c, SM90))
    dbmod.save_entries(settings.user_db_path(), [_entry(p, cfg)])
    ckgen.reload_db()
    choice, _ = Dispatcher().choose(GN, p, SM90)
    assert choice.source == "tuned" and choice.config == cfg


def test_db_winners_are_candidates(model_on):
    p = GN.parse_problem(N=2, C=96, H=30, W=30, G=8, dtype="fp16", layout="nhwc")
    q = GN.parse_problem(N=4, C=96, H=30, W=30, G=8, dtype="fp16", layout="nhwc")
    odd = next(c for c in GN.space.enumerate() if GN.validate(p, c, SM90) and GN.validate(q, c, SM90)
               and c not in model_on.winner_configs(GN) and c["threads"] == 128 and c["min_blocks"] == 4)
    mine = [_entry(q, odd)]
    usable = lambda c: bool(GN.validate(p, c, SM90))  # noqa: E731
    without = cm.candidates(GN, p, SM90, model_on.winner_configs(GN), usable)
    assert odd not in without[:1]
    picked = cm.dispatch_pick(GN, p, SM90, mine, usable)
    assert picked is not None
    cands, near = cm.candidate_tiers(GN, p, SM90, [odd, *model_on.winner_configs(GN)], usable)
    assert cands[0] == odd and picked[2] == len(cands)  # both tiers ranked
    assert cm.candidates(GN, p, SM90, [odd, *model_on.winner_configs(GN)], usable) == cands[:near]


def test_split_winners_are_carried_with_their_grid(model_on, monkeypatch):
    """A winner with a split knob, tuned at batch 8 (16 blocks per sample: 128 blocks), is also a
    candidate at batch 1 with 128 blocks per sample, so the GPU is as full as where it won."""
    q = GN.parse_problem(N=8, C=320, H=64, W=64, G=32, dtype="bf16", layout="nhwc")
    p = GN.parse_problem(N=1, C=8, H=512, W=512, G=2, dtype="bf16", layout="nhwc")
    w = GN.space.default.replace(threads=1024, vec_bytes=8, items=4, slice_in="rows", merge="global",
                                 global_split=16, min_blocks=1)
    assert GN.validate(q, w, SM90) and GN.validate(p, w, SM90)
    g = cm.grid_matched(GN, q, p, w, SM90)
    assert g == w.replace(global_split=128)
    assert [l.grid[0] for l in GN.launches(p, g, SM90)] == [q.N * 16] * 2
    assert cm.grid_matched(GN, q, q, w, SM90) is None  # the same grid already
    assert cm.grid_matched(GN, q, p, w.replace(global_split=1, merge="cluster", slice_in="reload"), SM90) is None
    pool = get_op("maxpool2d_fwd")
    pp = pool.parse_problem(N=1, C=64, H=56, W=56, dtype="bf16", layout="nhwc", kernel=3, stride=2, padding=1)
    assert cm.grid_matched(pool, pp, pp, pool.space.default, SM90) is None  # no split knob
    # the backward's split: multi_stage at batch 16, 8 blocks per (n, group tile), carried to batch 2
    bwd = get_op("groupnorm_bwd")
    bq = bwd.parse_problem(N=16, C=512, H=64, W=64, G=32, dtype="bf16", layout="nchw")
    bp = bwd.parse_problem(N=2, C=512, H=64, W=64, G=32, dtype="bf16", layout="nchw")
    bw = bwd.space.default.replace(scheme="multi_stage", split=8)
    bg = cm.grid_matched(bwd, bq, bp, bw, SM90)
    assert bg == bw.replace(split=64)  # 8x the blocks per slice; 64 is the space's largest
    # and dispatch_pick hands both to the model as candidates
    seen = []
    real = cm.CostModel.choose

    def spy(self, op, prob, target, usable, extra_winners=(), accept=None, admitted=None):
        extra_winners = list(extra_winners)
        seen.append(extra_winners)
        return real(self, op, prob, target, usable, extra_winners, accept, admitted)

    monkeypatch.setattr(cm.CostModel, "choose", spy)
    cm.dispatch_pick(GN, p, SM90, [_entry(q, w)], lambda c: bool(GN.validate(p, c, SM90)))
    assert seen and seen[0][:2] == [w, g]


def _patch_where_tune_looks(monkeypatch, name, value):
    """`name` replaced in ckgen.model, where ckgen/tuner/tune.py looks it up."""
    from ckgen import model

    monkeypatch.setattr(model, name, value)


def test_the_tuners_seeds_carry_recorded_winners_with_their_grid(model_on, monkeypatch):
    """`tune.model_picks` hands the model the recorded winners carried with their grid, as the
    dispatcher does with the DB's: a rows winner of batch 8 (16 blocks per sample) reaches the
    batch-1 search at 128 blocks per sample, and the carry is ranked like any candidate."""
    from ckgen.model import records as recmod
    from ckgen.tuner import tune

    q = GN.parse_problem(N=8, C=320, H=64, W=64, G=32, dtype="bf16", layout="nhwc")
    p = GN.parse_problem(N=1, C=8, H=512, W=512, G=2, dtype="bf16", layout="nhwc")
    w = GN.space.default.replace(threads=1024, vec_bytes=8, items=4, slice_in="rows", merge="global",
                                 global_split=16, min_blocks=1)
    slow = GN.space.default.replace(threads=256, vec_bytes=4, items=4, slice_in="reload", merge="global",
                                    global_split=4, min_blocks=1)
    assert GN.validate(q, slow, SM90)
    recs = [recmod.make_record(GN, q, SM90, "test", c, ok=True, time_us=t) for c, t in ((w, 10.0), (slow, 12.0))]
    assert cm.recorded_winners(recs, GN, "sm_90") == [(w, q.key())]
    assert cm.recorded_winners(recs, GN, "sm_80") == []
    g = w.replace(global_split=128)
    assert cm.carried_winners(GN, p, SM90, cm.recorded_winners(recs, GN, "sm_90")) == [g]
    seen = []
    real = cm.top_configs

    def spy(op, prob, target, count, allowed, model=None, extra_winners=()):
        seen.append(list(extra_winners))
        return real(op, prob, target, count, allowed, model=model, extra_winners=extra_winners)

    _patch_where_tune_looks(monkeypatch, "top_configs", spy)
    picks = tune.model_picks(GN, p, SM90, 40, records=recs)
    assert seen == [[g]]
    assert w in picks  # the neighbour's own winner, as before
    # and the model ranks the carry among its candidates: picked first when predicted fastest
    best = min(model_on.rank(GN, p, [g, *picks], SM90), key=lambda x: x[0].total_us)[1]
    assert best != g or picks[0] == g


def test_a_tuned_siblings_winner_stays_unless_the_model_is_sure(model_on, monkeypatch):
    """The same shape tuned in another dtype: its winner is kept unless the model's own pick is
    predicted NEAREST_MARGIN faster; a farther tuned problem's winner is only a candidate."""
    p = GN.parse_problem(N=6, C=320, H=48, W=48, G=32, dtype="fp16", layout="nhwc")
    sib = GN.parse_problem(N=6, C=320, H=48, W=48, G=32, dtype="bf16", layout="nhwc")  # distance 2
    far = GN.parse_problem(N=24, C=320, H=48, W=48, G=32, dtype="bf16", layout="nhwc")
    assert GN.distance(p, sib) <= cm.NEAREST_DISTANCE < GN.distance(p, far)
    usable = lambda c: bool(GN.validate(p, c, SM90))  # noqa: E731
    monkeypatch.setattr(policy, "NEAREST_MARGIN", None)
    free, free_pred, _, none = cm.dispatch_pick(GN, p, SM90, [], usable)
    assert none is None
    assert free_pred.gpu_us > free_pred.host_us  # GPU-bound: configs differ in time per call
    ranked = model_on.rank(GN, p, [c for c in GN.space.enumerate() if usable(c) and GN.validate(sib, c, SM90)
                                   and GN.validate(far, c, SM90)], SM90)
    close = next(c for pred, c in ranked if free_pred.total_us * 1.05 < pred.total_us < free_pred.total_us * 1.2)
    slow = next(c for pred, c in ranked if pred.total_us > free_pred.total_us * 2)
    assert cm.dispatch_pick(GN, p, SM90, [_entry(sib, close)], usable)[0] != close  # no incumbent rule
    monkeypatch.setattr(policy, "NEAREST_MARGIN", 0.3)
    got = cm.dispatch_pick(GN, p, SM90, [_entry(sib, close)], usable)
    assert got[0] == close and got[1].gpu_us == pytest.approx(model_on.predict(GN, p, close, SM90).gpu_us)
    assert got[3] == sib.key()
    dbmod.save_entries(settings.user_db_path(), [_entry(sib, close)])
    ckgen.reload_db()
    choice, _ = Dispatcher().choose(GN, p, SM90)
    assert choice.source == "model" and choice.config == close and f"tuned sibling {sib.key()}" in choice.reason
    assert cm.dispatch_pick(GN, p, SM90, [_entry(far, close)], usable)[0] != close  # not a sibling
    assert cm.dispatch_pick(GN, p, SM90, [_entry(sib, slow)], usable)[0] != slow  # the model is sure


@pytest.mark.parametrize("content", [None, b"{not json", b'{"format": "ckgen-costmodel", "version": 1}',
                                     b'{"format": "something else"}', b"\xff\xfe binary", b"[]"])
def test_missing_or_corrupt_model_falls_back_to_nearest_with_one_warning(tmp_path, monkeypatch, content):
    path = tmp_path / "model.json"
    if content is not None:
        path.write_bytes(content)
    monkeypatch.setenv("CKGEN_MODEL", str(path))
    near = GN.parse_problem(N=2, C=320, H=64, W=64, G=32, dtype="bf16", layout="nchw")
    cfg = next(c for c in GN.space.enumerate() if GN.validate(near, c, SM90) and c != GN.space.default)
    dbmod.save_entries(settings.user_db_path(), [_entry(near, cfg)])
    ckgen.reload_db()
    d = Dispatcher()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, _ = d.choose(GN, GN.parse_problem(N=4, C=320, H=64, W=64, G=32, dtype="bf16", layout="nchw"), SM90)
        b, _ = d.choose(GN, GN.parse_problem(N=8, C=320, H=64, W=64, G=32, dtype="bf16", layout="nchw"), SM90)
        assert cm.top_configs(GN, near, SM90, 3, lambda c: True) == []
    assert a.source == b.source == "nearest" and a.config == b.config == cfg
    mine = [w for w in caught if issubclass(w.category, cm.ModelWarning)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert str(path) in str(mine[0].message) and "nearest" in str(mine[0].message)


def test_model_off_gives_todays_fallback(monkeypatch):
    monkeypatch.setenv("CKGEN_MODEL", "off")
    assert cm.model_path() is None and cm.load() is None
    choice, _ = Dispatcher().choose(GN, GN.parse_problem(N=2, C=96, H=30, W=30, G=8, dtype="fp16",
                                                         layout="nhwc"), SM90)
    assert choice.source == "default"


def test_user_fitted_model_is_preferred(tmp_path, monkeypatch, model_on):
    monkeypatch.delenv("CKGEN_MODEL", raising=False)
    assert cm.main(["fit", "--no-user"]) == 0
    assert cm.model_path() == cm.user_model_path()
    assert cm.user_model_path().parent == settings.user_db_path().parent
    assert isinstance(cm.load(), cm.CostModel)


# ------------------------------------------------------------------ records


def test_heldout_problems_are_not_in_the_training_records():
    shipped = records.read(records.packaged_records_path())
    assert len(shipped) > 3000
    trained = {(r["op"], r["problem"]) for r in shipped}
    h = _heldout()
    for case in h.load_cases():
        op, p = h.problem_of(case)
        assert (op.name, p.key()) not in trained, f"held-out {op.name} {p.key()} is in the training records"
    model = json.loads(cm.packaged_model_path().read_text())
    # the fit learns from timed records: a problem whose every trial failed (grid-s4's max pool
    # bwd 16x512x20x20 k5 s1 fp32 NHWC, which the fixed fp32 tolerance rejected) brings none
    timed = {(r["op"], r["arch"], r["problem"]) for r in shipped if r.get("ok")}
    assert model["stats"]["problems"] == len(timed)
    assert len({(r["op"], r["arch"], r["problem"]) for r in shipped}) - len(timed) <= 1


def test_shipped_records_hold_every_shipped_db_winner():
    shipped = records.read(records.packaged_records_path())
    winners = {(r["op"], r["problem"], json.dumps(r["config"], sort_keys=True))
               for r in shipped if r["phase"] == "winner"}
    db = dbmod.InstanceDB.load(dbmod.packaged_db_path())
    for e in db.entries:
        assert (e.op, e.problem, json.dumps(e.config_dict(), sort_keys=True)) in winners


def test_records_read_skips_malformed_lines_with_one_warning(tmp_path):
    rec = records.make_record(GN, GN.parse_problem(N=1, C=8, H=4, W=4, G=2, dtype="bf16", layout="nchw"), SM90,
                              "dev", GN.space.default, ok=True, time_us=5.0)
    path = tmp_path / "r.jsonl"
    records.append(path, [rec])
    with open(path, "a") as f:
        f.write("{broken\n")
        f.write(json.dumps({**rec, "op": "nope"}) + "\n")
        f.write(json.dumps({**rec, "time_us": -1}) + "\n")
    records.append(path, [rec])
    with pytest.warns(records.RecordsWarning, match="skipped 3 malformed"):
        got = records.read(path)
    assert len(got) == 2 and got[0]["time_us"] == 5.0
    assert records.read(tmp_path / "missing.jsonl") == []


def _append_many(path: str, who: int, n: int) -> None:
    rec = records.make_record(GN, GN.parse_problem(N=1, C=8, H=4, W=4, G=2, dtype="bf16", layout="nchw"), SM90,
                              f"proc {who}", GN.space.default, ok=True, time_us=1.0 + who)
    for _ in range(n):
        records.append(path, [rec])


def test_concurrent_appends_lose_no_record(tmp_path):
    path = tmp_path / "records.jsonl"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(path), i, 60)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    got = records.read(path)
    assert len(got) == 180
    assert sorted({r["device"] for r in got}) == ["proc 0", "proc 1", "proc 2"]


def test_search_seeds_from_the_model_and_records_every_trial(tmp_path):
    """A `tune.Tuner`'s search (what tune_problem runs on the GPU) with a replayed device: the model's picks
    are measured right after the default, and every measured trial is recorded, failures too."""
    from ckgen.tuner.replay import ReplayEvaluator
    from ckgen.tuner.tune import Tuner, TuneRequest

    p = GN.parse_problem(N=8, C=320, H=64, W=64, G=32, dtype="bf16", layout="nhwc")
    valid = [c for c in GN.space.enumerate() if GN.validate(p, c, SM90)]
    picks = (valid[7], valid[70])
    bad = valid[70]
    ev = ReplayEvaluator(lambda c: None if c == bad else 50.0 + c["items"])
    rec = records.Recorder(GN, p, SM90, "replayed", tmp_path / "records.jsonl")
    tuner = Tuner(TuneRequest(GN, p, SM90, trials=12, model=None, picks=picks), ev, record=rec)
    tuner.search()
    default = tuner.default()
    assert ev.calls[:3] == [default, *picks]
    got = records.read(tmp_path / "records.jsonl")
    assert len(got) == len(ev.calls) == 12
    assert [r["ok"] for r in got].count(False) == 1
    failed = next(r for r in got if not r["ok"])
    assert failed["config"] == bad.as_dict() and "replayed failure" in failed["reason"]
    assert all(r["problem"] == p.key() and r["device"] == "replayed" and r["phase"] == "trial" for r in got)


def test_user_records_sit_beside_the_user_db():
    assert records.user_records_path().parent == settings.user_db_path().parent
    assert records.user_records_path().name == "instances.records.jsonl"


# ------------------------------------------------------------------ leave one out (quality tier)


@pytest.fixture(scope="module")
def sweep_loo():
    """Each exhaustive sweep held out in turn (`costmodel.leave_one_out`): the model fit on every
    other record picks among its candidates that the sweep timed. The held-out fits are those the
    replays seed from (`costmodel.packaged_fit_data()`), made once per test run."""
    res = cm.leave_one_out(cm.packaged_fit_data())
    print("\nleave-one-out on the sweeps (time / the sweep's best):")
    for r in res:
        print(f"  {r.op} {r.problem}: model {r.model:.3f}x, best candidate {r.oracle:.3f}x, nearest "
              f"{r.nearest:.3f}x, default {r.default:.3f}x ({r.candidates} candidates timed, {r.recorded} recorded)")
    return {(r.op, r.problem): r for r in res}


def _geo(xs) -> float:
    return math.exp(statistics.mean(math.log(x) for x in xs))


OLD_NCHW = "N=16,C=512,H=64,W=64,G=32,dtype=bf16,layout=nchw,act=none"  # the two first-format sweeps
OLD_NHWC = "N=8,C=320,H=64,W=64,G=32,dtype=bf16,layout=nhwc,act=none"


def _gn(sweep_loo):
    return [r for (op, _), r in sweep_loo.items() if op.startswith("groupnorm")]


def _pool(sweep_loo):
    return [r for (op, _), r in sweep_loo.items() if "pool" in op]


@pytest.mark.quality
def test_leave_one_out_on_the_recorded_sweeps(sweep_loo):
    """Every sweep (GroupNorm forward and backward, pooling) is held out: the model's picks
    within 1.2x of the sweeps' best (geomean), the first-format NCHW 16x512x64x64 sweep's within
    1.5x. A floor against regressions of the model or its records, not the target; the fixture
    prints each sweep's pick beside the best candidate, the nearest-tuned fallback and the default."""
    assert len(sweep_loo) >= 18 and len(_gn(sweep_loo)) >= 10
    assert _geo([r.model for r in sweep_loo.values()]) <= 1.2
    assert sweep_loo[("groupnorm_fwd", OLD_NCHW)].model <= 1.5


@pytest.mark.quality
def test_leave_one_out_groupnorm_nchw_picks_within_1_5x(sweep_loo):
    """Every GroupNorm NCHW sweep held out: the model's pick within 1.5x of its best."""
    assert all(r.model <= 1.5 for r in _gn(sweep_loo) if r.layout == "nchw"), \
        {k: r.model for k, r in sweep_loo.items() if r.layout == "nchw"}


@pytest.mark.quality
@pytest.mark.xfail(strict=True, reason="on the GroupNorm sweeps the model's picks are worse than the "
                   "nearest recorded winner's (geomean); strict: when it passes, make it a plain test")
def test_leave_one_out_groupnorm_model_no_worse_than_nearest(sweep_loo):
    assert _geo([r.model for r in _gn(sweep_loo)]) <= _geo([r.nearest for r in _gn(sweep_loo)]) + 1e-9


@pytest.mark.quality
@pytest.mark.xfail(strict=True, reason="held out, the first-format NHWC 8x320x64x64 sweep's pick is a "
                   "cluster=8 config over 1.5x its best; this pick moves from refit to refit, so a refit that "
                   "passes or fails here needs a look; strict: when it passes, make it a plain test")
def test_leave_one_out_nhwc_sweep_pick_within_1_5x(sweep_loo):
    """The first-format NHWC 8x320x64x64 sweep held out: the model's pick within 1.5x its best."""
    assert sweep_loo[("groupnorm_fwd", OLD_NHWC)].model <= 1.5


@pytest.mark.quality
def test_leave_one_out_pooling_sweeps_floor(sweep_loo):
    """The 8 pooling sweeps (the ResNet stem shape, both layouts, max and average, forward and
    backward), each held out: the model's picks within 1.3x of the best (geomean); a floor against
    regressions, not the target. Problems tuned more than once are not sweeps (`leave_one_out`
    takes the sweeps' records only)."""
    assert len(_pool(sweep_loo)) == 8
    assert _geo([r.model for r in _pool(sweep_loo)]) <= 1.3


@pytest.mark.quality
def test_leave_one_out_pooling_model_no_worse_than_nearest(sweep_loo):
    """The 8 pooling sweeps held out: the model's picks no worse than the nearest tuned problem's
    winner (geomean). The margin is under 1%: a refit that fails here needs a look, not an xfail
    by reflex."""
    assert _geo([r.model for r in _pool(sweep_loo)]) <= _geo([r.nearest for r in _pool(sweep_loo)])


def test_choose_takes_the_first_accepted_of_the_best_few(model_on):
    """`accept` (the dispatcher's compiled spill check) is asked in ranking order: the first
    config it accepts wins; if it accepts none of the best ACCEPT_TRIES, the best stands; it is
    asked of no more than those."""
    p = GN.parse_problem(N=2, C=96, H=30, W=30, G=8, dtype="fp16", layout="nhwc")
    usable = lambda c: bool(GN.validate(p, c, SM90))  # noqa: E731
    cands, near = cm.candidate_tiers(GN, p, SM90, model_on.winner_configs(GN), usable)
    ranked = [c for _, c in model_on.select(GN, p, cands, near, SM90)]
    assert len(ranked) > cm.ACCEPT_TRIES + 1
    assert model_on.choose(GN, p, SM90, usable)[0] == ranked[0]
    asked = []

    def reject_two(c):
        asked.append(c)
        return c not in ranked[:2]

    assert model_on.choose(GN, p, SM90, usable, accept=reject_two)[0] == ranked[2]
    assert asked == ranked[:3]
    asked.clear()
    assert model_on.choose(GN, p, SM90, usable, accept=lambda c: asked.append(c) and False)[0] == ranked[0]
    assert asked == ranked[:cm.ACCEPT_TRIES]
