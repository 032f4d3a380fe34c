"""`scalestudy plan` past `--dry-run`: measure the layouts that matter, refit the model on what was
measured, re-rank the space, and stop once no unmeasured layout could beat the best measured one.

Each round measures the layouts with the highest upper band (an upper-confidence rule), and the
best of every family no earlier round measured, so a model that is wrong about one family cannot
keep it out of sight. After a round the model is refitted on every measurement so far, with a
factor per measured family, and the bands become that procedure's leave-one-out error on them:
this machine's error, not the published rows' (plan/refit.py).

What measures is given to the loop (cli_plan_rounds.py passes a Ray Tune sweep of the chosen layouts,
recorded in the ledger and MLflow as any sweep), so this module stays pure Python: no torch, no ray.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from scalestudy.errors import SpecError
from scalestudy.metrics import Status, TrialResult
from scalestudy.plan.entry import PlanEntry
from scalestudy.plan.refit import Measurement, Refit, corrected, refit
from scalestudy.plan.space import PlanRequest, RankedLayout, price_of, rank, score_of
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.trial import trial_key

# entries to measure, the round's number, timed steps (None: the space's) -> their results (any
# order). Layouts are matched by their design point (spec/trial.py's trial_key), not by trial_id:
# a refitted profile changes the ids, and so does a shorter window.
MeasureFn = Callable[[list[PlanEntry], int, "int | None"], list[TrialResult]]


class PlanBudget(BaseModel):
    """What the plan may spend on measuring: trials, device-hours, or both (None: no limit)."""

    model_config = ConfigDict(extra="forbid")
    trials: int | None = Field(default=None, gt=0)
    device_hours: float | None = Field(default=None, gt=0)

    @classmethod
    def parse(cls, text: str | None) -> PlanBudget:
        """'12' (trials) or '0.5h' (device-hours); a SpecError names a bad one."""
        if not text:
            return cls()
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(h|trials?)?\s*", text)
        if m is None or float(m.group(1)) <= 0:
            raise SpecError("--budget", text, "give a trial count (12) or device-hours (0.5h)")
        if m.group(2) == "h":
            return cls(device_hours=float(m.group(1)))
        if not m.group(1).isdigit():
            raise SpecError("--budget", text, "a trial count is a whole number; device-hours end in h")
        return cls(trials=int(m.group(1)))


# What `scalestudy plan` leaves beside the ledger of the study it measured (cli_plan_rounds.py),
# read by the report's plan figure (scalestudy_analysis/figures_plan.py).
PLAN_RECORD = "plan_rounds.json"

@dataclass
class Measured:
    """A measured layout: as ranked when it was chosen, its result, and its measured score."""

    chosen_as: RankedLayout
    result: TrialResult
    score: float
    round: int
    window: str = "full"  # "short": only its halving window ran (it was not promoted)

    @property
    def name(self) -> str:
        return self.chosen_as.entry.config.run_name

    @property
    def completed(self) -> bool:
        return self.result.status is Status.completed and math.isfinite(self.score)


def device_hours(runs: list[TrialResult]) -> float:
    return sum((r.wall_time_s if math.isfinite(r.wall_time_s) else 0.0) * r.world_size
               for r in runs) / 3600.0


@dataclass
class PlanRound:
    index: int
    chosen: list[str]                 # run names of the layouts measured in this round
    refit: dict[str, float] = field(default_factory=dict)   # refitted parameter -> value
    factors: dict[str, float] = field(default_factory=dict)  # family -> measured / predicted
    heldout_error: float = math.nan   # leave-one-out relative error of the refit (the new bands)
    in_sample_error: float = math.nan  # the refit scored on its own measurements (replay only)


@dataclass
class PlanOutcome:
    ranked: list[RankedLayout]        # the space as last re-ranked
    measured: dict[tuple, Measured]   # design point (trial_key) -> measurement
    rounds: list[PlanRound]
    stop_reason: str
    profile: HardwareProfile          # the last refit's (the starting one if none)
    runs: list[TrialResult] = field(default_factory=list)  # every trial run, halving windows too

    @property
    def recommended(self) -> Measured | None:
        """The best completed layout by its full window (by a short one if none ran full)."""
        done = [m for m in self.measured.values() if m.completed]
        full = [m for m in done if m.window == "full"] or done
        return max(full, key=lambda m: m.score, default=None)

    @property
    def spent_trials(self) -> int:
        return len(self.runs)

    @property
    def spent_device_hours(self) -> float:
        return device_hours(self.runs)

    def predicted_now(self, key: tuple) -> RankedLayout | None:
        return next((r for r in self.ranked if key_of(r) == key), None)


def key_of(layout: RankedLayout) -> tuple:
    return trial_key(layout.entry.config)


def choose(ranked: list[RankedLayout], measured: dict[tuple, Measured], k: int) -> list[RankedLayout]:
    """The next layouts to measure: the best unmeasured layout of every family none of whose
    layouts was measured yet, then the highest upper bands, k in all (more when the families
    need it)."""
    todo = sorted((r for r in ranked if r.feasible and key_of(r) not in measured),
                  key=lambda r: -r.high)
    seen = {m.chosen_as.family for m in measured.values()}
    picked: list[RankedLayout] = []
    for r in todo:
        if r.family not in seen:
            seen.add(r.family)
            picked.append(r)
    for r in todo:
        if len(picked) >= k:
            break
        if r not in picked:
            picked.append(r)
    return picked


def _budget_left(budget: PlanBudget, runs: list[TrialResult]) -> int | None:
    """Trials the budget still allows (None: unlimited), 0 once device-hours are spent."""
    if budget.device_hours is not None and device_hours(runs) >= budget.device_hours:
        return 0
    return None if budget.trials is None else max(0, budget.trials - len(runs))


def _refit(base: HardwareProfile, measured: dict[tuple, Measured], rnd: PlanRound) -> Refit | None:
    """plan/refit.py's refit on every completed measurement so far (None: none completed)."""
    done = [Measurement(m.chosen_as.entry.config, m.result.tokens_per_s, m.chosen_as.family)
            for m in measured.values() if m.completed]
    if not done:
        return None
    out = refit(base, done)
    rnd.refit, rnd.factors = out.fitted, out.factors
    rnd.in_sample_error, rnd.heldout_error = out.in_sample_error, out.heldout_error
    return out


def _converged(ranked: list[RankedLayout], measured: dict[tuple, Measured]) -> str | None:
    done = [m for m in measured.values() if m.completed]
    if not done:
        return None
    best = max(m.score for m in done)
    rival = [r for r in ranked if r.feasible and key_of(r) not in measured
             and r.high > best]
    if rival:
        return None
    return ("converged: no unmeasured layout's band reaches the best measured layout's "
            f"{best:.4g}")


@dataclass
class Batch:
    """What to measure next: the round's layouts, for `steps` timed steps (None: the space's)."""

    index: int
    layouts: list[RankedLayout]
    steps: int | None = None
    window: str = "full"

    @property
    def entries(self) -> list[PlanEntry]:
        return [r.entry for r in self.layouts]


class PlanLoop:
    """The rounds as a state machine that whoever measures drives: `next_batch` says what to
    measure (None: the plan is over, `outcome.stop_reason` says why), `complete` takes that
    batch's results. `run_plan` drives it with a function; sweep/plan_search.py with a Ray Tune
    searcher, so that every round runs inside one Tune experiment on the same warm groups.

    A round measures its layouts for the space's window; with `halving_steps` and four layouts or
    more, every layout for that many timed steps first, then the better half (by that window) for
    the full one (successive halving on step count: poor layouts stop early)."""

    def __init__(self, req: PlanRequest, profile: HardwareProfile, *, top_k: int, rounds: int,
                 budget: PlanBudget, halving_steps: int | None = None, **settings) -> None:
        self.req, self.base, self.settings = req, profile, settings
        self.top_k, self.rounds, self.budget, self.halving_steps = top_k, rounds, budget, halving_steps
        self.outcome = PlanOutcome(rank(req, profile, **settings), {}, [],
                                   f"rounds spent ({rounds})", profile)
        self.finished = False
        self._index = 0
        self._picked: list[RankedLayout] = []
        self._promoted: list[RankedLayout] = []
        self._left: int | None = None
        self._pending: Batch | None = None

    def next_batch(self) -> Batch | None:
        """The next layouts to measure; None once the plan is over."""
        if self._pending is not None:
            raise RuntimeError(f"round {self._pending.index}'s batch has no results yet")
        if self._promoted:
            self._pending = Batch(self._index, self._promoted)
            self._promoted = []
        elif not self.finished:
            self._pending = self._start_round()
        return self._pending

    def _start_round(self) -> Batch | None:
        out = self.outcome
        left = _budget_left(self.budget, out.runs)
        if self._index >= self.rounds:
            if left == 0:
                out.stop_reason = "budget spent"
            return self._finish()
        picked = choose(out.ranked, out.measured, self.top_k)
        if left is not None:
            picked = picked[:left]
        if not picked:
            out.stop_reason = "budget spent" if left == 0 else "every admissible layout was measured"
            return self._finish()
        self._index += 1
        self._picked, self._left = picked, left
        if self.halving_steps is None or len(picked) < 4:
            return Batch(self._index, picked)
        return Batch(self._index, picked, self.halving_steps, "short")

    def _finish(self) -> None:
        self.finished = True
        return None

    def complete(self, results: list[TrialResult]) -> None:
        """The pending batch's results (any order, matched by design point); ends its round
        (refit, re-rank, convergence) unless a halving window's better half runs next."""
        batch, self._pending = self._pending, None
        if batch is None:
            raise RuntimeError("no batch is being measured")
        got = self._record(batch, results)
        if batch.window == "short":
            keep = (len(batch.layouts) + 1) // 2
            if self._left is not None:  # the trials the budget allowed when the round began
                keep = min(keep, max(0, self._left - len(batch.layouts)))
            best = sorted((m for m in got if m.completed), key=lambda m: -m.score)[:keep]
            self._promoted = [m.chosen_as for m in best]
            if self._promoted:
                return
        self._end_round()

    def _record(self, batch: Batch, results: list[TrialResult]) -> list[Measured]:
        price, out = price_of(self.req), self.outcome
        by_key = {key_of(r): r for r in batch.layouts}
        got = []
        for res in results:
            out.runs.append(res)
            chosen = by_key.get(trial_key(res))
            if chosen is not None:
                m = Measured(chosen, res, score_of(res, self.req, price), batch.index, batch.window)
                out.measured[trial_key(res)] = m
                got.append(m)
        return got

    def _end_round(self) -> None:
        out = self.outcome
        rnd = PlanRound(self._index, [r.entry.config.run_name for r in self._picked])
        out.rounds.append(rnd)
        model = _refit(self.base, out.measured, rnd)
        if model is not None:
            out.profile = model.profile
            out.ranked = corrected(rank(self.req, out.profile, model.errors, **self.settings),
                                   model.factors, model.errors)
        reason = _converged(out.ranked, out.measured)
        if reason:
            out.stop_reason = reason
            self.finished = True


def run_plan(req: PlanRequest, profile: HardwareProfile, measure: MeasureFn, *, top_k: int,
             rounds: int, budget: PlanBudget, halving_steps: int | None = None,
             **settings) -> PlanOutcome:
    """Rounds of choose -> measure -> refit -> re-rank (settings: spec fields for the space, as
    space_spec takes them), each batch measured by `measure`. Stops when converged, when the
    budget or the rounds are spent, or when every admissible layout was measured."""
    loop = PlanLoop(req, profile, top_k=top_k, rounds=rounds, budget=budget,
                    halving_steps=halving_steps, **settings)
    while (batch := loop.next_batch()) is not None:
        loop.complete(measure(batch.entries, batch.index, batch.steps))
    return loop.outcome
