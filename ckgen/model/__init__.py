"""The config cost model: what the dispatcher asks for a problem no DB entry covers, and where
the tuner takes its first seeds from.

**Why an analytical model with fitted terms, not a learner.** The training records
(ckgen/model/records.py) are thin: two exhaustive sweeps (GroupNorm forward, bf16, one NCHW and one
NHWC shape), tuning runs of the grid problems, and about two timings per problem (winner and
default) for the rest. A gradient-boosted or ranking model fit on that learns the swept problems
and has little to generalise with across shapes (`bench/costmodel_loo.py` measures it). So the
model's *form* is physics: time = a launch floor (the call's first launch, less for each further
one) + the bytes the op must move / bandwidth, scaled by exp(w . phi), where phi are deficits that
make a memory-bound kernel slower than its roofline (bytes in flight below what the GPU needs to
hide latency, SMs left idle, the last wave's tail, narrow vectors, re-reads, splits, ...). Only
the weights w, one intercept per op, the per-launch floor and the bytes-in-flight knee are fitted,
on within-problem differences (a ranking, not absolute times across problems), then corrected by
the measured residuals of nearby recorded problems. numpy only, deterministic; nothing here
imports CuPy.

The modules, one job each (no module imports one listed after it):
  - document: the model file's format, bounds and validators; `ModelError`, `ModelWarning`.
  - lattice: a tuning space's product as integer codes, and the class checks over them.
  - features: the phi terms and `geometry` of a (problem, config), from the op's hooks
    (`OpSpec.model_*`: docs/cost-model.md, "What the model asks of an op").
  - candidates: the candidate walk (which configs are ranked for a problem).
  - predictor: `CostModel`: predictions, the measured correction, ranking and selection.
  - fit: fitting on the records (`fit`, `FitData`).
  - parsed: the parse cache of a model file.
  - store: where the model file is, `load`, `dumps`.
  - policy: the pick (`dispatch_pick`, `NEAREST_MARGIN`) and the tuner's model seeds.
  - evaluate: leave-one-out over the records.
  - command: `python -m ckgen.model fit`.

`ckgen.model.fit` and `ckgen.model.candidates` are the functions re-exported here; names of their
modules are imported with `from ckgen.model.fit import ...` (or importlib).
"""
from __future__ import annotations

from .candidates import MAX_CANDIDATES, MAX_STEPS, MIN_CANDIDATES, candidate_tiers, candidates, neighbours, related_winners
from .command import main
from .document import (FORMAT, MAX_CORRECTION, MAX_NEED_BYTES, MAX_RESIDUAL, MAX_US, MAX_WEIGHT, VERSION, ModelError,
                       ModelWarning)
from .evaluate import LooResult, leave_one_out
from .features import (BW_BYTES_PER_US, CHAIN, CHAIN_US, KEEP_WS_BYTES, PREDICT_NARROW_ROWS, PRIOR, TERM_NAMES, TERMS,
                       Geometry, chain_steps, geometry, geometry_many, num_sms)
from .fit import (FLOOR_GRID, FLOOR_NEXT_GRID, NARROW_ROWS_FROM_KERNEL_VERSION, NEED_GRID, RIDGE, WINNERS_PER_PROBLEM,
                  FitData, best_configs, fit, packaged_fit_data, recmod_by_problem, timed_configs)
from .policy import (NEAREST_DISTANCE, NEAREST_MARGIN, SPLIT_KNOBS, carried_winners, dispatch_pick, grid_matched,
                     nearest_recorded_winner, nearest_recorded_winners, recorded_winners, top_configs)
from .predictor import ACCEPT_TRIES, CORR_PRIOR, CORR_TAU, HOST, WIDE_MARGIN, CostModel, Prediction, launch_floor
from .store import dumps, load, model_path, packaged_model_path, user_model_path

__all__ = [
    "ACCEPT_TRIES", "BW_BYTES_PER_US", "CHAIN", "CHAIN_US", "CORR_PRIOR", "CORR_TAU", "FLOOR_GRID", "FLOOR_NEXT_GRID",
    "FORMAT", "HOST", "KEEP_WS_BYTES", "MAX_CANDIDATES", "MAX_CORRECTION", "MAX_NEED_BYTES", "MAX_RESIDUAL",
    "MAX_STEPS", "MAX_US", "MAX_WEIGHT", "MIN_CANDIDATES", "NARROW_ROWS_FROM_KERNEL_VERSION", "NEAREST_DISTANCE",
    "NEAREST_MARGIN", "NEED_GRID", "PREDICT_NARROW_ROWS", "PRIOR", "RIDGE", "SPLIT_KNOBS", "TERMS", "TERM_NAMES",
    "VERSION", "WIDE_MARGIN", "WINNERS_PER_PROBLEM",
    "CostModel", "FitData", "Geometry", "LooResult", "ModelError", "ModelWarning", "Prediction",
    "best_configs", "candidate_tiers", "candidates", "carried_winners", "chain_steps", "dispatch_pick", "dumps", "fit",
    "geometry", "geometry_many", "grid_matched", "launch_floor", "leave_one_out", "load", "main", "model_path",
    "nearest_recorded_winner", "nearest_recorded_winners", "neighbours", "num_sms", "packaged_fit_data",
    "packaged_model_path", "recmod_by_problem", "recorded_winners", "related_winners", "timed_configs", "top_configs",
    "user_model_path",
]
