"""One tuning pipeline (`tune.TuneRequest` -> `tune.Tuner`) behind every entry point, without a
GPU: `ckgen tune`'s `tune_problem`, online tuning's `tune_with` and a worker of `ckgen tune
--workers` run the same search and pick the same winner as a plain Tuner given the same request
and a replayed evaluator; and the runtime (ckgen/runtime/dispatch.py) never imports the tuner: online
tuning reaches it through the untuned hook it registers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckgen.runtime import dispatch
from ckgen.tuner import online, tune
from ckgen.tuner import workers as wk
from ckgen.runtime.bench import Timing
from ckgen.ops import get_op
from ckgen.ops.spec import Config, Target
from ckgen.tuner.replay import ReplayBackend, ReplayEvaluator
from ckgen.runtime.target import DeviceInfo
from ckgen.tuner.tune import Tuner, TuneRequest

OP = get_op("groupnorm_fwd")
SM90 = Target.named("sm_90")
PROBLEM = OP.parse_problem(N=8, C=320, H=64, W=64, G=32, dtype="bf16", layout="nhwc")
INFO = DeviceInfo(SM90, "replayed GPU", 132, 50 << 20)
ROOT = Path(__file__).resolve().parents[1]


def synthetic(config: Config) -> float:
    return 100.0 - 2.0 * config["vec_bytes"] + abs(config["threads"] - 256) / 64 + config["items"] / 4


def time_of(key: str, config: Config) -> float:  # module-level: a worker's backend is pickled
    return synthetic(config)


def request(**fields) -> TuneRequest:
    fields.setdefault("model", None)
    return TuneRequest.on(OP, PROBLEM, INFO, trials=8, **fields)


def plain(req: TuneRequest) -> tuple[tune.TuneResult, ReplayEvaluator]:
    ev = ReplayEvaluator(synthetic)
    return Tuner(req, ev).run(), ev


# ------------------------------------------------------------------------- the request, the steps


def test_the_tuner_runs_its_steps_in_order_and_keeps_the_evaluators_counts():
    valid = tune.valid_space(OP, PROBLEM, SM90)
    warm, inc = valid[100], valid[200]
    records = []
    ev = ReplayEvaluator(synthetic)
    tuner = Tuner(request(warm=(warm,), incumbent=inc, picks=(valid[300],)), ev,
                  record=lambda *a, **kw: records.append((a, kw)))
    result = tuner.run()
    assert ev.calls[:4] == [warm, inc, tuner.default(), valid[300]]  # warm, incumbent, default, picks
    assert len(ev.calls) == 8 and result.trials == 8 and result.warm == [ev.measured[warm]]
    assert inc in {m.config for m in result.finalists}  # the incumbent is re-timed in the final round
    assert result.best == result.finalists[0] and result.copy is None
    assert sum(kw.get("phase") == "final" for _, kw in records) == len(result.finalists)
    assert tuner.incumbent() == (inc,)
    bad = Tuner(request(incumbent=OP.space.default.replace(threads=-1)), ReplayEvaluator(synthetic))
    assert bad.incumbent() == ()  # not valid here: ignored


def test_a_request_names_the_study_of_its_device():
    assert request().study_name() == tune.study_name(OP, PROBLEM, SM90, "replayed GPU")


def test_the_model_in_use_seeds_its_picks(monkeypatch):
    asked = []
    monkeypatch.setattr(tune, "model_picks", lambda *a, **kw: asked.append((a, kw)) or ())
    assert Tuner(request(model=tune.IN_USE), ReplayEvaluator(synthetic)).picks() == ()
    assert asked and asked[0][1]["model"] is None  # model_picks' "the model in use"
    asked.clear()
    assert Tuner(request(model=None), ReplayEvaluator(synthetic)).picks() == () and not asked


# ------------------------------------------------------------------- every entry point, one result


def test_tune_problem_is_the_tuner_with_the_gpu_objective_faked(monkeypatch):
    """`ckgen tune`'s step: the evaluator is the seam; with a replayed one in place of the GPU
    objective, the same calls and winner as a plain Tuner, the dispatcher's pick as incumbent."""
    made = []

    def objective(op, problem, target, harness, timer, compile_ahead=None):
        made.append(ReplayEvaluator(synthetic))
        return made[-1]

    class FakeTimer:
        def __init__(self, l2_bytes):
            pass

        def copy_time(self, nbytes):
            return Timing(10.0, 10.0, 10.0, 1)

    monkeypatch.setattr(tune, "Objective", objective)
    monkeypatch.setattr(tune, "Harness", lambda op, problem, seed=None: None)
    monkeypatch.setattr(tune, "Timer", FakeTimer)
    inc = tune.valid_space(OP, PROBLEM, SM90)[50]
    monkeypatch.setattr(tune, "dispatcher_pick", lambda op, problem, target: inc)
    got = tune.tune_problem(request(), INFO)
    want, ev = plain(request(incumbent=inc))
    assert made[0].calls == ev.calls and made[0].calls[0] == inc
    assert got.best.config == want.best.config and got.copy == Timing(10.0, 10.0, 10.0, 1)
    assert [m.config for m in got.finalists] == [m.config for m in want.finalists]


def test_online_tuning_is_the_tuner(monkeypatch):
    want, ev = plain(request())
    ev2 = ReplayEvaluator(synthetic)
    entry = online.tune_with(request(), ev2)
    assert ev2.calls == ev.calls
    assert Config.of(entry.config_dict()) == want.best.config
    assert entry.time_us == round(want.best.timing.median_us, 3)
    assert entry.provenance_dict()["tuned_by"] == "online" and entry.device == "replayed GPU"


def test_a_worker_is_the_tuner_with_claims_around_it(tmp_path):
    """A worker (in this process) searches and runs the final round of a one-problem run: the
    same measurements and winner as a plain Tuner on a study of its own."""
    spec = wk.RunSpec(OP.name, (PROBLEM.key(),), 8, f"sqlite:///{tmp_path / 'w.sqlite3'}",
                      backend=ReplayBackend(time_of, device=INFO.name), poll_s=0.05)
    events = []
    worker = wk._Worker(0, spec, spec.backend(), lambda *ev: events.append(ev))
    calls = []
    real = spec.backend.evaluator

    def evaluator(op, problem):
        ev = real(op, problem)
        calls.append(ev)
        return ev

    worker.backend.evaluator = evaluator
    worker.run()
    (result,) = [ev[2] for ev in events if ev[0] == "result"]
    want, ev = plain(request(storage=f"sqlite:///{tmp_path / 'one.sqlite3'}"))
    assert [c.key() for c in calls[0].calls] == [c.key() for c in ev.calls]
    assert result["entry"]["config"] == dict(want.best.config.items)
    assert result["trials"] == 8 and result["time_us"] == want.best.timing.median_us


# ------------------------------------------------------------------ the runtime never imports tuning

def test_importing_dispatch_alone_imports_no_tuning_module():
    """A fresh interpreter imports ckgen.runtime.dispatch without running ckgen/__init__.py (which imports
    online tuning to register it): no tuning module comes with it."""
    code = ("import importlib.util, sys; root = sys.argv[1]; "
            "spec = importlib.util.spec_from_file_location('ckgen', root + '/__init__.py', "
            "submodule_search_locations=[root]); "
            "sys.modules['ckgen'] = importlib.util.module_from_spec(spec); import ckgen.runtime.dispatch; "
            "print(sorted(m for m in sys.modules if m.startswith('ckgen.')))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "ckgen")], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    loaded = set(eval(out))  # noqa: S307 - our own print of a list of names
    assert "ckgen.runtime.dispatch" in loaded and not {m for m in loaded if m.startswith("ckgen.tuner")}, sorted(loaded)


def test_online_tuning_registers_its_hook_and_ckgen_tuning_reaches_it(monkeypatch):
    import ckgen

    hook = dispatch.untuned_hook()
    asked = []
    monkeypatch.setattr(online, "maybe_tune", lambda *a: asked.append(a) or False)
    site = dispatch.Site(0, lambda: False)
    assert hook.on_untuned(OP, PROBLEM, SM90, site) is False and asked == [(OP, PROBLEM, SM90, site)]
    assert online.Site is dispatch.Site
    with ckgen.tuning(trials=3) as budget:
        assert budget == online.Budget(3, None)


def test_the_dispatcher_asks_the_registered_hook(monkeypatch):
    seen = []
    tried = set()

    def on_untuned(op, problem, target, site):
        seen.append(problem.key())
        tried.add((op.name, problem.key(), target.arch))
        return False

    monkeypatch.setattr(dispatch, "_hook", dispatch._hook)  # restored after the test
    dispatch.set_untuned_hook(on_untuned, lambda *k: k in tried)
    d = dispatch.Dispatcher()
    choice, _ = d.choose(OP, PROBLEM, SM90, site=dispatch.Site(0, lambda: False))
    assert choice.source != "tuned" and seen == [PROBLEM.key()]
    assert not d._untuned  # attempted: not dropped by the next `ckgen.tuning()` block
    d.choose(OP, PROBLEM, SM90)  # no site (not building a plan): the hook is not asked
    assert seen == [PROBLEM.key()]
    dispatch.set_untuned_hook(None)
    d2 = dispatch.Dispatcher()
    d2.choose(OP, PROBLEM, SM90, site=dispatch.Site(0, lambda: False))
    assert seen == [PROBLEM.key()] and d2._untuned  # no hook: never tuned, still droppable


@pytest.mark.parametrize("name", ["_Objective", "_Heartbeat", "_valid_space", "_claim_lock", "search"])
def test_the_old_private_names_are_gone(name):
    assert not hasattr(tune, name)
