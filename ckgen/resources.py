"""Where ckgen's data folders are read from: `templates/` (Jinja kernels) and `tuning_spaces/`
(<op>.yaml).

In the repository they live at the top level, beside `ckgen/`. A wheel carries them inside the
package (`ckgen/templates`, `ckgen/tuning_spaces`: pyproject.toml maps the folders in), so an
installed ckgen reads them through importlib.resources. A checkout on sys.path, or an editable
install, reads the top-level folders. This module imports nothing else of ckgen.
"""
from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

DATA_DIRS = ("templates", "tuning_spaces")


@lru_cache(maxsize=None)
def data_dir(name: str) -> Path:
    """The folder `name` (one of DATA_DIRS): inside the installed package if it is there, else
    beside the package in a checkout. FileNotFoundError names both places when neither holds it."""
    if name not in DATA_DIRS:
        raise ValueError(f"data_dir: {name!r} is not one of {DATA_DIRS}")
    packaged = resources.files("ckgen") / name
    if packaged.is_dir():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parent.parent / name
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"ckgen's {name}/ folder is missing: looked in {packaged} (installed) and {checkout} "
                            "(checkout); reinstall ckgen (pip install .)")


def templates_dir() -> Path:
    return data_dir("templates")


def tuning_spaces_dir() -> Path:
    return data_dir("tuning_spaces")
