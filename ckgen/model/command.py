"""The command line: `python -m ckgen.model fit` fits the model on the shipped records and the
user's, and writes it beside the user DB (where `load` then prefers it)."""
from __future__ import annotations

from pathlib import Path

from .. import files
from .fit import packaged_fit_data
from .store import dumps, user_model_path


def main(argv: list[str] | None = None) -> int:
    import argparse

    from . import records as recmod

    ap = argparse.ArgumentParser(prog="python -m ckgen.model", description="Fit the config cost model.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit on the shipped records and yours; write the model beside the user DB")
    f.add_argument("--out", type=Path, default=None, help=f"model file (default: {user_model_path()})")
    f.add_argument("--no-user", action="store_true", help="the shipped records only")
    args = ap.parse_args(argv)
    # fit(recmod.all_records(...)), with the shipped records prepared as the process's other fits use them
    user = [] if args.no_user else recmod.read_cached(recmod.user_records_path())
    data = packaged_fit_data()
    model = data.extended(user).fit() if user else data.fit()
    out = args.out or user_model_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    # whole or not at all: a write cut half way (a full disk) must leave the model that was there
    files.write_atomic(out, dumps(model).encode("utf-8"))
    print(f"wrote {out}: {model.summary()}")
    return 0
