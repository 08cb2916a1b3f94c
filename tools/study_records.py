"""Tuning records (ckgen/model/records.py) from an optuna study storage: every finished trial of every
ckgen study in it (a measured config with its median time, or a failure with its reason), for
the studies whose problem a records file does not hold yet. For tuning runs whose records file
was lost (before `bench/tune_db.sh` kept it beside its DB); the storage keeps every trial.

    python tools/study_records.py sqlite:///scratch/dbtune/studies.sqlite3 \
        --have scratch/dbtune/tuned.records.jsonl -o scratch/dbtune/from-studies.records.jsonl
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("storage", help="optuna storage URL (sqlite:///path)")
    ap.add_argument("--have", action="append", default=[], help="records file whose problems to leave out")
    ap.add_argument("-o", "--out", required=True, help="records file to append to")
    args = ap.parse_args()
    import optuna

    from ckgen.model import records
    from ckgen.ops import get_op
    from ckgen.ops.spec import Config, Target
    from ckgen.tuner.sampler import FAILURE_ATTR

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    have = {(r["op"], r["problem"]) for path in args.have for r in records.read(Path(path))}
    out, studies = [], 0
    for s in optuna.get_all_study_summaries(args.storage, include_best_trial=False):
        parts = s.study_name.split("|")
        if len(parts) != 5:
            continue  # a run study of workers.py, not a problem's
        op_name, arch, device, key, _digest = parts
        op = get_op(op_name)
        problem, target = op.problem_from_key(key), Target.named(arch)
        if (op.name, problem.key()) in have:
            continue
        studies += 1
        study = optuna.load_study(study_name=s.study_name, storage=args.storage)
        for t in study.get_trials(deepcopy=False):
            date = (t.datetime_complete or t.datetime_start).astimezone().isoformat(timespec="seconds") \
                if (t.datetime_complete or t.datetime_start) else None
            cfg = Config.of(t.params)
            # a trial says when it ran, not with which kernels: the legacy records' migration rule
            version = records.legacy_kernel_version({"date": date})
            if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None:
                out.append(records.make_record(op, problem, target, device, cfg, ok=True, time_us=float(t.value),
                                               source="tune", date=date, kernel_version=version))
            elif t.state == optuna.trial.TrialState.FAIL and FAILURE_ATTR in t.user_attrs:
                out.append(records.make_record(op, problem, target, device, cfg, ok=False,
                                               reason=str(t.user_attrs[FAILURE_ATTR]), source="tune", date=date,
                                               kernel_version=version))
    records.append(Path(args.out), out)
    print(f"{args.out}: {len(out)} records from {studies} studies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
