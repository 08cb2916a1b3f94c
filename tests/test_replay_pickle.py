"""What `replay_sweeps` hands between processes: the held-out model comes back from a worker after
its replays used it, and the replays' remembering wrapper of an op or a model pickles as what it wraps."""
from __future__ import annotations

import json
import pickle

from ckgen import model as cm
from ckgen.ops import get_op
from ckgen.ops.spec import Target
from ckgen.tuner.replay import _Remembered

SM90 = Target.named("sm_90")


def _used_model():
    model = cm.CostModel.from_doc(json.loads(cm.packaged_model_path().read_text()))
    op = _Remembered(get_op("groupnorm_fwd"))
    p = op.parse_problem(N=2, C=320, H=64, W=64, G=32, dtype="bf16", layout="nhwc", activation="none")
    configs = list(model.winner_configs(op))[:8]
    assert configs
    before = model.predict_many(op, p, configs, SM90)
    return model, op, p, configs, before


def test_a_model_used_through_a_remembered_op_pickles_and_predicts_the_same():
    model, op, p, configs, before = _used_model()
    back = pickle.loads(pickle.dumps(model))
    assert back.predict_many(get_op("groupnorm_fwd"), p, configs, SM90) == before


def test_a_remembered_op_pickles_as_the_op_it_wraps():
    op = _Remembered(get_op("maxpool2d_fwd"))
    back = pickle.loads(pickle.dumps(op))
    assert isinstance(back, _Remembered) and back.name == "maxpool2d_fwd"
    assert back.space.params == get_op("maxpool2d_fwd").space.params
