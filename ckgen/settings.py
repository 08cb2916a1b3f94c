"""Every setting read from the environment, in one place."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import platformdirs

ENV_DB = "CKGEN_DB"  # path of the user instance DB
ENV_CACHE = "CKGEN_CACHE_DIR"  # folder for the user DB and optuna studies
ENV_KERNEL_CACHE = "CKGEN_KERNEL_CACHE"  # folder for compiled kernels (default: <cache dir>/kernels)
ENV_QUIET = "CKGEN_QUIET"  # "1" (or true/yes/on): no fallback notices (the dispatcher's, and ckgen.torch's fallbacks to PyTorch)
ENV_ROCM = "CKGEN_ROCM_PATH"  # a ROCm root (include/hip, device bitcode) for offline HIP builds
ENV_SHIPPED = "CKGEN_SHIPPED_DB"  # another file in place of the packaged DB (a missing file: none)
ENV_MODEL = "CKGEN_MODEL"  # the config cost model file in place of the user's/packaged one; "off": none
ENV_TUNE = "CKGEN_TUNE"  # "1" (or true/yes/on): online tuning (ckgen/tuner/online.py): a problem's first call tunes it if no DB entry has it
ENV_TUNE_TRIALS = "CKGEN_TUNE_TRIALS"  # online tuning: configs measured per problem (default TUNE_TRIALS)
ENV_TUNE_MAX_S = "CKGEN_TUNE_MAX_S"  # online tuning: wall-time cap per problem's search, in seconds (default none)
TUNE_TRIALS = 12
# Trials of one problem's search at most: no op's tuning space holds more than some thousands of
# valid configs, and a larger count (say 10^23) only reaches the tuner's int arithmetic and
# optuna as a number nothing was built for.
MAX_TUNE_TRIALS = 1_000_000


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or platformdirs.user_cache_dir("ckgen"))


def kernel_cache_dir() -> Path:
    """Compiled kernels (cubins / HIP code objects), named by instance and source sha256, so one
    folder can serve any number of DBs and processes."""
    return Path(os.environ.get(ENV_KERNEL_CACHE) or cache_dir() / "kernels")


def user_db_path() -> Path:
    return Path(os.environ.get(ENV_DB) or cache_dir() / "instances.yaml")


def study_storage_url() -> str:
    """Default optuna storage: a SQLite file in the cache dir (created if missing)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{cache_dir() / 'studies.sqlite3'}"


def quiet() -> bool:
    return flag(ENV_QUIET)


TRUTHY = ("1", "true", "yes", "on")
FALSY = ("", "0", "false", "no", "off")


class SettingWarning(UserWarning):
    """An environment variable of ckgen holds a value it does not understand; its default is used."""


_warned: set[tuple[str, str]] = set()


def _warn_once(name: str, value: str, message: str) -> None:
    if (name, value) not in _warned:
        _warned.add((name, value))
        warnings.warn(message, SettingWarning, stacklevel=3)


def flag(name: str) -> bool:
    """An on/off variable: 1/true/yes/on (any case) is on; unset, empty, 0/false/no/off is off.
    Anything else is off too, with one SettingWarning naming the variable and the value (a typo
    must not pass for a choice)."""
    value = os.environ.get(name, "")
    word = value.strip().lower()
    if word in TRUTHY:
        return True
    if word not in FALSY:
        _warn_once(name, value, f"${name}={value[:40]!r} is neither on ({'/'.join(TRUTHY)}) nor off "
                                f"({'/'.join(FALSY[1:])}); taken as off")
    return False


def tune_enabled() -> bool:
    """$CKGEN_TUNE is on (`flag`; what a `ckgen.tuning()` block says wins over it)."""
    return flag(ENV_TUNE)


def tune_trials() -> int:
    """$CKGEN_TUNE_TRIALS (an integer from 1 to MAX_TUNE_TRIALS), else TUNE_TRIALS; ValueError
    naming it if malformed."""
    value = os.environ.get(ENV_TUNE_TRIALS, "").strip()
    if not value:
        return TUNE_TRIALS
    try:
        n = int(value[:40])  # a longer text is no count (and int() of a huge one costs seconds)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_TUNE_TRIALS or len(value) > 40:
        raise ValueError(f"${ENV_TUNE_TRIALS}: expected a positive integer, at most {MAX_TUNE_TRIALS:,}, "
                         f"got {value[:40]!r}")
    return n


def tune_max_seconds() -> float | None:
    """$CKGEN_TUNE_MAX_S (seconds > 0; inf: no cap, as math.inf in a `ckgen.tuning()` block),
    else None (no cap); ValueError naming it if malformed."""
    value = os.environ.get(ENV_TUNE_MAX_S, "").strip()
    if not value:
        return None
    try:
        s = float(value)
    except ValueError:
        s = float("nan")
    if not s > 0:  # also NaN
        raise ValueError(f"${ENV_TUNE_MAX_S}: expected a number of seconds > 0 (or inf: no cap), got {value[:40]!r}")
    return s


def shipped_db_override() -> Path | None:
    value = os.environ.get(ENV_SHIPPED)
    return Path(value) if value else None


def rocm_path() -> Path | None:
    """$CKGEN_ROCM_PATH, else the private ROCm that tools/hip-toolchain unpacks into the cache dir, else None."""
    value = os.environ.get(ENV_ROCM)
    if value:
        return Path(value)
    private = cache_dir() / "rocm" / "usr"
    return private if private.is_dir() else None
