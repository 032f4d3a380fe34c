"""Fit the model's efficiency parameters to measured trials (least squares on log tokens/s).

Which parameters are free depends on the device: on CPU the framework costs dominate small models
(a real step against its benchmarked parts, the per-step engine cost, the slowdown of cores sharing a
node); on GPUs the kernel and link efficiencies do. All others keep their profile/default values.
Working in log space makes every trial's relative error count the same and keeps the parameters
positive; the bounds are the physical ranges of ModelParams (an efficiency never exceeds 1, a
slowdown is at least 1). A study of one shape cannot tell a per-step cost from a factor on compute:
expect one of in_step_slowdown and step_overhead_s at its bound there.

Published rows (tests/validation): `fit_rows` fits shared parameters over rows that each carry their
own profile and settings (attention kernel, interconnect), and `leave_one_group_out` refits without
each source group so every calibration row is scored by a fit that never saw its source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from scalestudy.perfmodel.params import ModelParams, params_for
from scalestudy.perfmodel.predict import simulate
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.study import TrialConfig

# The efficiencies a fit frees, by whether the profile is a GPU's (HardwareProfile.is_gpu).
FREE_PARAMS = {
    False: ("in_step_slowdown", "step_overhead_s", "shared_node_slowdown"),
    True: ("gemm_efficiency", "attention_efficiency", "network_efficiency", "overlap_slowdown"),
}
_BOUNDS = {  # (low, high) of the physical range, in the parameter's own units
    "op_overhead_s": (1e-7, 1e-2), "step_overhead_s": (1e-6, 10.0),
    "in_step_slowdown": (0.5, 10.0), "shared_node_slowdown": (1.0, 10.0),
    "gemm_efficiency": (0.05, 1.0),
    "attention_efficiency": (0.05, 1.0), "network_efficiency": (0.05, 1.0),
    "overlap_slowdown": (1e-3, 1.0), "software_efficiency": (0.3, 1.0),
}


def _clip(name: str, value: float) -> float:
    low, high = _BOUNDS[name]
    return float(min(max(value, low), high))


@dataclass(frozen=True)
class FitResult:
    names: tuple[str, ...]
    before: ModelParams
    after: ModelParams
    measured: list[float]
    predicted_before: list[float]
    predicted_after: list[float]
    profile: HardwareProfile

    @staticmethod
    def mape(pred: list[float], meas: list[float]) -> float:
        return float(np.mean([abs(p / m - 1) for p, m in zip(pred, meas)]))


def tokens_per_s(cfg: TrialConfig, p: ModelParams) -> float:
    st, _ = simulate(cfg, p)
    return cfg.tokens_per_step / st.step_s


def fit(cfgs: list[TrialConfig], measured: list[float], hw: HardwareProfile,
        names: tuple[str, ...] | None = None) -> FitResult:
    """Least-squares fit of `names` (default: FREE_PARAMS of the device kind) on log tokens/s."""
    from scipy.optimize import least_squares  # scipy only here: predict() stays numpy-free

    if not cfgs or len(cfgs) != len(measured):
        raise ValueError("fit needs one measured tokens/s per trial, at least one trial")
    cfgs = [c.model_copy(update={"hardware_profile": hw}) for c in cfgs]
    names = names or FREE_PARAMS[hw.is_gpu]
    base = params_for(hw)
    log_meas = np.log(np.asarray(measured, dtype=float))
    lo = np.log([_BOUNDS[n][0] for n in names])
    hi = np.log([_BOUNDS[n][1] for n in names])
    x0 = np.clip(np.log([max(getattr(base, n), _BOUNDS[n][0]) for n in names]), lo, hi)

    def params(x: np.ndarray) -> ModelParams:
        # Clipped to the physical range: the solver's bounds are widened by 1e-12 in log space,
        # and a slowdown of 0.999999999999 would fail the profile's own validation.
        return base.model_copy(update={n: _clip(n, math.exp(v)) for n, v in zip(names, x)})

    def residuals(x: np.ndarray) -> np.ndarray:
        p = params(x)
        return np.log([tokens_per_s(c, p) for c in cfgs]) - log_meas

    sol = least_squares(residuals, x0, bounds=(lo - 1e-12, hi + 1e-12), x_scale=1.0)
    after = params(sol.x)
    cal = dict(hw.calibration)
    cal.update({n: getattr(after, n) for n in names})
    profile = hw.model_copy(update={"calibration": cal})
    return FitResult(
        names=tuple(names), before=base, after=after, measured=list(measured),
        predicted_before=[tokens_per_s(c, base) for c in cfgs],
        predicted_after=[tokens_per_s(c, after) for c in cfgs], profile=profile,
    )


LOO_MAX_TRIALS = 12  # leave-one-out up to here; K_FOLDS folds beyond (each fit costs n predictions)
K_FOLDS = 10


def held_out_predictions(cfgs: list[TrialConfig], measured: list[float], hw: HardwareProfile,
                         names: tuple[str, ...] | None = None) -> tuple[list[float], str]:
    """(tokens/s of each trial predicted by a fit that did not see it, how the trials were split):
    leave-one-out up to LOO_MAX_TRIALS trials, else K_FOLDS folds (trial i in fold i mod K). A fit
    scored on the trials it fitted says how well it can replay them, not how well it predicts."""
    n = len(cfgs)
    if n < 2:
        raise ValueError("an out-of-sample error needs at least two trials")
    k = n if n <= LOO_MAX_TRIALS else K_FOLDS
    label = "leave-one-out" if k == n else f"{k}-fold"
    out = [math.nan] * n
    for fold in range(k):
        train = [i for i in range(n) if i % k != fold]
        res = fit([cfgs[i] for i in train], [measured[i] for i in train], hw, names)
        for i in range(fold, n, k):
            cfg = cfgs[i].model_copy(update={"hardware_profile": res.profile})
            out[i] = tokens_per_s(cfg, res.after)
    return out, label


def fit_rows(cfgs: list[TrialConfig], measured: list[float], bases: list[ModelParams],
             names: tuple[str, ...], upper: dict[str, float] | None = None) -> dict[str, float]:
    """Values of `names` shared by all rows that minimise the squared log error of tokens/s per
    device; each row keeps its own profile (cfg.hardware_profile) and base parameters. `upper`
    tightens a parameter's physical upper bound (e.g. gemm_efficiency at the device's measured best
    GEMM rate: no fit may make kernels faster than they were measured to run)."""
    from scipy.optimize import least_squares

    if not cfgs:
        return {}
    upper = upper or {}
    lo = np.log([_BOUNDS[n][0] for n in names])
    hi = np.log([min(_BOUNDS[n][1], upper.get(n, math.inf)) for n in names])
    # Start strictly inside the bounds: scipy's trf solver does not move off a start on a bound
    # (it returned a start of 1.0 unchanged for software_efficiency, bounded above by 1).
    inside = 0.02 * (hi - lo)
    x0 = np.clip(np.log([getattr(bases[0], n) for n in names]), lo + inside, hi - inside)
    log_meas = np.log(np.asarray(measured, dtype=float))

    def residuals(x: np.ndarray) -> np.ndarray:
        upd = {n: float(math.exp(v)) for n, v in zip(names, x)}
        pred = [tokens_per_s(c, b.model_copy(update=upd)) / c.world_size for c, b in zip(cfgs, bases)]
        return np.log(pred) - log_meas

    sol = least_squares(residuals, x0, bounds=(lo - 1e-12, hi + 1e-12))
    return {n: float(math.exp(v)) for n, v in zip(names, sol.x)}


def leave_one_group_out(groups: list[str], fit_without) -> dict[str, dict[str, float]]:
    """group -> the fit made without that group's rows (`fit_without(group)` returns it)."""
    return {g: fit_without(g) for g in sorted(set(groups))}
