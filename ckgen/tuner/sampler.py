"""The tuner's sampler: proposes only configs of the enumerated valid set that no trial of the
study holds yet, so nothing invalid or repeated enters the model and no ask is wasted.

Strategies (`ValidSetSampler(strategy=...)`), compared on recorded sweeps by bench/replay_search.py:
- "gp": a Gaussian process (Matern 5/2, one length scale per feature, fitted to log time by
  maximum marginal likelihood) and expected improvement, evaluated on the unseen valid configs
  near the best so far: at most LOCAL_KNOBS knobs away from one of the LOCAL_TOP best measured
  configs (a trust region; all unseen valid configs once none is left near them). Configs still
  being compiled or measured count as measured at the model's mean ("kriging believer"), so a
  proposal made while they are in flight goes elsewhere. The default.
- "gp-global": the same GP, expected improvement over every unseen valid config (no trust region).
- "tpe": optuna's TPE (every flag set here), asked again until it proposes an unseen valid
  config; after `REJECT_TRIES` misses, its last proposal is moved to the nearest unseen valid one.
- "random": uniform over the unseen valid configs.
- "optuna-gp": optuna's GPSampler, used like "tpe" (needs torch and scipy; for comparisons).

Features of a config: log2 of each numeric knob scaled to [0, 1] over the values the valid set
holds, one-hot for the others. Only numpy is needed (no torch or scipy)."""
from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from ..types import Config

STRATEGIES = ("gp", "gp-global", "tpe", "random", "optuna-gp")
DEFAULT_STRATEGY = "gp"
# "gp"'s trust region: within LOCAL_KNOBS knobs of the LOCAL_TOP best measured configs. Two knobs,
# because the knobs trade against each other (threads x vector x items is a block's step: one
# knob changed alone mostly changes it); chosen on the recorded sweeps (bench/replay_search.py).
LOCAL_TOP = 3
LOCAL_KNOBS = 2
REJECT_TRIES = 64  # tpe: asks of the inner sampler before projecting its proposal
# Trial user attrs that mark a config as settled for good: a real failure (compile, launch, wrong
# result). Other FAIL trials (a stale RUNNING trial recovered by heartbeat, a cancelled or a
# duplicate one) do not: their config may be proposed again.
FAILURE_ATTR = "failure"


def config_of(trial: FrozenTrial, names: Sequence[str]) -> Config | None:
    """The config a trial holds or will hold (an enqueued trial's fixed params), if complete."""
    params = trial.params
    if set(params) != set(names) and trial.state == TrialState.WAITING:
        params = trial.system_attrs.get("fixed_params", {})
    if set(params) != set(names):
        return None
    return Config.of(params)


def settled(trial: FrozenTrial) -> bool:
    """Does this trial keep its config from being proposed again?"""
    if trial.state in (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING):
        return True
    return trial.state == TrialState.FAIL and FAILURE_ATTR in trial.user_attrs


class Encoder:
    """Config -> feature row: log2 of a numeric knob scaled to [0, 1] over the values the valid
    set holds, one-hot for the others (a value the valid set lacks encodes as all zeros)."""

    def __init__(self, valid: Sequence[Config], extra: Callable[[Config], dict[str, float]] | None = None):
        self.extra = extra
        self.cols: list[tuple[str, Any]] = []
        rows = [self._values(c) for c in valid]
        for n in rows[0]:
            vals = [r[n] for r in rows]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in vals):
                lo, hi = math.log2(min(vals)), math.log2(max(vals))
                if hi > lo:
                    self.cols.append((n, (lo, hi)))
            else:
                levels = sorted(set(vals), key=repr)
                if len(levels) > 1:
                    self.cols += [(n, ("=", lv)) for lv in levels]

    def _values(self, c: Config) -> dict[str, Any]:
        d = c.as_dict()
        if self.extra is not None:
            d.update({f"~{k}": v for k, v in self.extra(c).items()})
        return d

    def encode(self, configs: Sequence[Config]) -> np.ndarray:
        out = np.zeros((len(configs), max(1, len(self.cols))))
        rows = [self._values(c) for c in configs]
        for j, (n, how) in enumerate(self.cols):
            for i, c in enumerate(rows):
                v = c.get(n)
                if how[0] == "=":
                    out[i, j] = float(v == how[1])
                elif isinstance(v, (int, float)) and v > 0:
                    out[i, j] = (math.log2(v) - how[0]) / (how[1] - how[0])
        return out


class _GP:
    """A zero-mean GP on standardized targets, Matern 5/2 with one length scale per feature,
    hyperparameters fitted by coordinate search on the log marginal likelihood."""

    NOISE = (1e-6, 1e-1)
    LENGTH = (0.05, 20.0)

    def __init__(self, dims: int):
        self.log_ls = np.zeros(dims)  # warm start of the next fit
        self.log_noise = math.log(1e-3)

    @staticmethod
    def _kernel(a: np.ndarray, b: np.ndarray, ls: np.ndarray) -> np.ndarray:
        d = np.sqrt(np.maximum(((a[:, None, :] - b[None, :, :]) / ls) ** 2, 0.0).sum(-1))
        s5 = math.sqrt(5.0) * d
        return (1.0 + s5 + s5 * s5 / 3.0) * np.exp(-s5)

    def _nll(self, x: np.ndarray, y: np.ndarray, log_ls: np.ndarray, log_noise: float) -> float:
        k = self._kernel(x, x, np.exp(log_ls)) + (math.exp(log_noise) + 1e-9) * np.eye(len(x))
        try:
            chol = np.linalg.cholesky(k)
        except np.linalg.LinAlgError:
            return math.inf
        alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, y))
        return float(0.5 * y @ alpha + np.log(np.diag(chol)).sum())

    def fit(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.mu, self.sd = x, float(y.mean()), float(y.std()) or 1.0
        self.y = (y - self.mu) / self.sd
        best = self._nll(x, self.y, self.log_ls, self.log_noise)
        lo_l, hi_l = (math.log(v) for v in self.LENGTH)
        lo_n, hi_n = (math.log(v) for v in self.NOISE)
        for step in (1.0, 0.5, 0.25):  # coordinate search, coarse to fine; deterministic
            improved = True
            while improved:
                improved = False
                for i in range(len(self.log_ls) + 1):
                    for sign in (1.0, -1.0):
                        ls, noise = self.log_ls.copy(), self.log_noise
                        if i < len(ls):
                            ls[i] = min(hi_l, max(lo_l, ls[i] + sign * step))
                        else:
                            noise = min(hi_n, max(lo_n, noise + sign * step))
                        v = self._nll(x, self.y, ls, noise)
                        if v < best - 1e-9:
                            best, self.log_ls, self.log_noise, improved = v, ls, noise, True
        self._factor(x, self.y)

    def _factor(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.yf = x, y
        k = self._kernel(x, x, np.exp(self.log_ls)) + (math.exp(self.log_noise) + 1e-9) * np.eye(len(x))
        self.chol = np.linalg.cholesky(k)
        self.alpha = np.linalg.solve(self.chol.T, np.linalg.solve(self.chol, y))

    def believe(self, xp: np.ndarray) -> None:
        """Add points at the current mean (pending evaluations): same mean, less variance there."""
        if len(xp):
            mean, _ = self.predict(xp)
            self._factor(np.vstack([self.x, xp]), np.concatenate([self.yf, mean]))

    def predict(self, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ks = self._kernel(xs, self.x, np.exp(self.log_ls))
        mean = ks @ self.alpha
        v = np.linalg.solve(self.chol, ks.T)
        var = np.maximum(1.0 - (v * v).sum(0), 1e-12)
        return mean, np.sqrt(var)


def _expected_improvement(mean: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    z = (best - mean) / sd
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return (best - mean) * cdf + sd * pdf


def make_tpe(seed: int | None, n_startup_trials: int) -> optuna.samplers.TPESampler:
    """optuna's TPE with every flag given, so the search does not change with optuna's defaults
    (5.0 changed multivariate and constant_liar). Flags a version deprecates are still passed
    (their values are that version's defaults), and ones it lacks are left out."""
    flags: dict[str, Any] = dict(
        consider_prior=True, prior_weight=1.0, consider_magic_clip=True, consider_endpoints=False,
        n_startup_trials=n_startup_trials, n_ei_candidates=24, seed=seed, multivariate=True,
        group=False, warn_independent_sampling=False, constant_liar=True,
    )
    accepted = inspect.signature(optuna.samplers.TPESampler.__init__).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation and experimental notices of these flags
        return optuna.samplers.TPESampler(**{k: v for k, v in flags.items() if k in accepted})


def make_optuna_gp(seed: int | None, n_startup_trials: int) -> optuna.samplers.BaseSampler:
    """optuna's GPSampler with its flags given (experimental; needs torch and scipy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=n_startup_trials,
                                         deterministic_objective=False,
                                         independent_sampler=optuna.samplers.RandomSampler(seed=seed))


class ValidSetSampler(optuna.samplers.BaseSampler):
    """Proposes an unseen config of `valid` (see the module doc). `choices` are the categorical
    distributions the trials are suggested with (the space's values: resumable studies keep
    the same distributions whatever the valid set)."""

    def __init__(self, valid: Sequence[Config], choices: dict[str, Sequence[Any]], strategy: str = DEFAULT_STRATEGY,
                 seed: int | None = 0, n_startup_trials: int = 4,
                 extra: Callable[[Config], dict[str, float]] | None = None,
                 prior: Sequence[float] | None = None):
        if strategy not in STRATEGIES:
            raise ValueError(f"sampler: {strategy!r} is not one of {list(STRATEGIES)}")
        if not valid:
            raise ValueError("sampler: no valid config to propose")
        self.valid = list(valid)
        self.index = {c: i for i, c in enumerate(self.valid)}
        self.names = list(choices)
        self.space = {n: CategoricalDistribution(list(v)) for n, v in choices.items()}
        # The inner samplers see only the values the valid set holds (fewer invalid proposals).
        self.inner_space = {n: CategoricalDistribution(sorted({c[n] for c in self.valid}, key=list(v).index))
                            for n, v in choices.items()}
        self.strategy, self.seed = strategy, seed
        self.n_startup = n_startup_trials
        self.rng = np.random.default_rng(seed)
        self.encoder = Encoder(self.valid, extra)
        self.x = self.encoder.encode(self.valid)
        # each knob's value as its index among the choices: configs' knob distance (how many differ)
        self.codes = np.asarray([[list(choices[n]).index(c[n]) for n in self.names] for c in self.valid],
                                dtype=np.int64).reshape(len(self.valid), len(self.names))
        self.gp = _GP(self.x.shape[1])
        # the GP's prior mean: log of a model's predicted time per valid config (0: none)
        self.prior = np.zeros(len(self.valid)) if prior is None else np.asarray(prior, dtype=np.float64)
        self.inner = (make_tpe(seed, n_startup_trials) if strategy == "tpe"
                      else make_optuna_gp(seed, n_startup_trials) if strategy == "optuna-gp" else None)
        self.proposals = 0  # model-made proposals (enqueued trials are not)

    # -- what the study holds
    def state(self, study: optuna.Study, exclude: int | None = None) -> tuple[dict[int, list[float]], set[int]]:
        """({valid index: measured values}, indices settled by any trial but `exclude`)."""
        values: dict[int, list[float]] = {}
        taken: set[int] = set()
        for t in study.get_trials(deepcopy=False):
            if t.number == exclude:
                continue
            cfg = config_of(t, self.names)
            i = self.index.get(cfg) if cfg is not None else None
            if i is None:
                continue
            if t.state == TrialState.COMPLETE and t.value is not None and math.isfinite(t.value):
                values.setdefault(i, []).append(t.value)
            if settled(t):
                taken.add(i)
        return values, taken

    def unseen(self, study: optuna.Study) -> int:
        """Valid configs no trial holds (what the model may still propose)."""
        return len(self.valid) - len(self.state(study)[1])

    def available(self, study: optuna.Study) -> int:
        """Valid configs still to measure: the unseen ones plus those enqueued (WAITING)."""
        held = set()
        for t in study.get_trials(deepcopy=False):
            if t.state != TrialState.WAITING and settled(t):
                cfg = config_of(t, self.names)
                if cfg in self.index:
                    held.add(self.index[cfg])
        return len(self.valid) - len(held)

    # -- optuna's sampler interface
    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self.space)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space:
            return {}
        values, taken = self.state(study, exclude=trial.number)
        pending = [i for i in taken if i not in values]  # running or waiting elsewhere
        free = np.asarray([i for i in range(len(self.valid)) if i not in taken], dtype=int)
        if len(free) == 0:
            return {}  # nothing left: the caller checks unseen() first, so only under a race
        self.proposals += 1
        if self.strategy == "random" or len(values) < self.n_startup:
            pick = int(self.rng.choice(free))
        elif self.strategy in ("gp", "gp-global"):
            pick = self._gp_pick(values, pending, free, local=self.strategy == "gp")
        else:
            pick = self._inner_pick(study, trial, taken, free)
        return self.valid[pick].as_dict()

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        # Only reached when every valid config is taken (a race between processes): any value;
        # the search loop then sees a config that is a duplicate or invalid and drops the trial.
        choices = list(getattr(param_distribution, "choices", [None]))
        return choices[int(self.rng.integers(len(choices)))]

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if self.inner is not None:
            self.inner.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        if self.inner is not None:
            self.inner.after_trial(study, trial, state, values)

    # -- strategies
    def near(self, values: dict[int, list[float]], free: np.ndarray) -> np.ndarray:
        """The configs of `free` within LOCAL_KNOBS knobs of one of the LOCAL_TOP best measured."""
        top = sorted(values, key=lambda i: (min(values[i]), i))[:LOCAL_TOP]
        dist = np.min([(self.codes[free] != self.codes[i]).sum(1) for i in top], axis=0)
        return free[dist <= LOCAL_KNOBS]

    def _gp_pick(self, values: dict[int, list[float]], pending: list[int], free: np.ndarray,
                 local: bool = False) -> int:
        idx = np.asarray(sorted(values), dtype=int)
        y = np.log(np.asarray([min(values[i]) for i in idx]))
        if local:
            near = self.near(values, free)
            free = near if len(near) else free
        self.gp.fit(self.x[idx], y - self.prior[idx])
        self.gp.believe(self.x[np.asarray(pending, dtype=int)] if pending else np.zeros((0, self.x.shape[1])))
        mean, sd = self.gp.predict(self.x[free])  # of the residual, standardized
        mean = self.prior[free] + self.gp.mu + self.gp.sd * mean  # log time
        ei = _expected_improvement(mean, self.gp.sd * sd, float(y.min()))
        top = np.flatnonzero(ei >= ei.max() * (1.0 - 1e-9))
        return int(free[top[int(self.rng.integers(len(top)))]])

    def _inner_pick(self, study: optuna.Study, trial: FrozenTrial, taken: set[int], free: np.ndarray) -> int:
        assert self.inner is not None
        last: dict[str, Any] = {}
        # GPSampler maximizes a deterministic acquisition: asking again would repeat its answer.
        for _ in range(REJECT_TRIES if self.strategy == "tpe" else 1):
            last = self.inner.sample_relative(study, trial, self.inner_space)
            if not last:  # the inner sampler is still in its startup phase
                return int(self.rng.choice(free))
            i = self.index.get(Config.of(last)) if set(last) == set(self.names) else None
            if i is not None and i not in taken:
                return i
        # Project the last proposal onto the nearest unseen valid config (feature distance).
        target = self.encoder.encode([Config.of({n: last.get(n) for n in self.names})])[0]
        d = ((self.x[free] - target) ** 2).sum(1)
        return int(free[np.argmin(d)])
