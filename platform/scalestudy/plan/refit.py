"""The plan's model of this machine after a round of measurements.

First the profile's efficiencies are refitted on every measurement (perfmodel/fit.py, the `fit`
command's path). Those efficiencies are shared by every layout, so a family of layouts the model
gets wrong stays wrong after the fit alone: on a 2-core CPU, ZeRO-3's gathers made a tiny Llama's
trials 4x slower than ZeRO-1's, where the model predicts them alike. So each family with
measurements then gets a factor, measured over predicted (the geometric mean over its measured
layouts), that scales the predictions of its unmeasured layouts.

The bands the next round ranks with: the leave-one-out error of the whole procedure (refit and
factors made without the held-out layout) over the layouts of families measured more than once,
once there are MIN_HELDOUT of them; before that, the published error of the layout's family or the procedure's error on its own measurements,
whichever is larger (a model that cannot replay what it measured cannot rule anything out).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from scalestudy.perfmodel.fit import fit, tokens_per_s
from scalestudy.plan.space import FAMILY_ERROR, OVERALL_ERROR, RankedLayout, band_error
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.trial import TrialConfig

MIN_HELDOUT = 3  # held-out layouts before their error replaces the published bands


@dataclass
class Measurement:
    config: TrialConfig
    tokens_per_s: float
    family: str


@dataclass
class Refit:
    profile: HardwareProfile
    fitted: dict[str, float]          # refitted parameter -> value
    factors: dict[str, float]         # family -> measured over predicted
    errors: dict[str, float]          # family ("*": any other) -> the bands' relative error
    in_sample_error: float            # the procedure on the measurements it was made from
    heldout_error: float = math.nan   # leave-one-out (NaN below MIN_HELDOUT measurements)


def _family_factors(preds: list[float], done: list[Measurement]) -> dict[str, float]:
    logs: dict[str, list[float]] = defaultdict(list)
    for p, m in zip(preds, done):
        if p > 0 and m.tokens_per_s > 0:
            logs[m.family].append(math.log(m.tokens_per_s / p))
    return {f: math.exp(sum(v) / len(v)) for f, v in logs.items()}


def _mean_error(preds: list[float], done: list[Measurement]) -> float:
    return sum(abs(p / m.tokens_per_s - 1) for p, m in zip(preds, done)) / len(done)


def _heldout(base: HardwareProfile, done: list[Measurement]) -> float:
    """Each measurement of a family measured more than once, predicted by the procedure made
    without it: the error on an unmeasured layout of a measured family, which is what a band is
    for (every family is measured in the first round). NaN with fewer than MIN_HELDOUT of them."""
    count: dict[str, int] = defaultdict(int)
    for m in done:
        count[m.family] += 1
    held = [i for i, m in enumerate(done) if count[m.family] >= 2]
    if len(held) < MIN_HELDOUT:
        return math.nan
    preds = []
    for i in held:
        rest = done[:i] + done[i + 1:]
        res = fit([r.config for r in rest], [r.tokens_per_s for r in rest], base)
        factor = _family_factors(res.predicted_after, rest)[done[i].family]
        cfg = done[i].config.model_copy(update={"hardware_profile": res.profile})
        preds.append(tokens_per_s(cfg, res.after) * factor)
    return _mean_error(preds, [done[i] for i in held])


def refit(base: HardwareProfile, done: list[Measurement]) -> Refit:
    """The refit of `base` on the completed measurements `done` (at least one)."""
    res = fit([m.config for m in done], [m.tokens_per_s for m in done], base)
    factors = _family_factors(res.predicted_after, done)
    corrected = [p * factors[m.family] for p, m in zip(res.predicted_after, done)]
    out = Refit(res.profile, {n: getattr(res.after, n) for n in res.names}, factors, {},
                _mean_error(corrected, done))
    out.heldout_error = _heldout(base, done)
    if math.isfinite(out.heldout_error):
        out.errors = {"*": out.heldout_error}
    else:
        floor = out.in_sample_error
        out.errors = {f: max(e, floor) for f, e in FAMILY_ERROR.items()}
        out.errors["*"] = max(OVERALL_ERROR, floor)
    return out


def corrected(ranked: list[RankedLayout], factors: dict[str, float],
              errors: dict[str, float] | None) -> list[RankedLayout]:
    """`ranked` with each family's factor on its scores and bands, best first again. A score is
    larger-is-better: a negated cost (usd_per_token) is divided by the factor, as a faster layout
    costs less per token."""
    out = []
    for r in ranked:
        f = factors.get(r.family)
        if f is None or not r.feasible or not math.isfinite(r.score):
            out.append(r)
            continue
        score = r.score * f if r.score > 0 else r.score / f
        err = band_error(r.family, errors)
        band = (score * (1 - err), score * (1 + err))
        out.append(r.model_copy(update={"score": score, "low": min(band), "high": max(band),
                                        "factor": f}))
    out.sort(key=lambda x: -x.score)
    return out
