"""The simulate backend's sweep: predictions in this process (a fraction of a millisecond each), no
Ray and no Tune.

A grid predicts every runnable point. A search predicts the points it picks, num_samples of them
(default: as many as the grid has runnable points), as the measure backend's Tune search picks
them (tune_runner._param_space: one categorical choice per axis over the spec's values):
  * random: each axis drawn uniformly from its values (Tune's tune.choice), seeded by the spec's
    seed. A point drawn twice is recorded once (the recorder keeps one row per trial).
  * optuna: Optuna's TPE sampler over the same categorical axes, seeded likewise and told each
    prediction's search metric (ask/tell); a point that cannot run is told as failed.
A drawn point that cannot run is recorded as infeasible with its reason, as a Tune trial records
it; one already in the ledger (--resume) is skipped and counts as drawn, as in Tune.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from scalestudy.metrics import TrialResult, search_metric
from scalestudy.spec.sections import SearchAlgorithm
from scalestudy.spec.study import AXES, PlannedTrial, StudySpec
from scalestudy.sweep.progress import SweepProgress


def _key(axes: dict) -> tuple:
    return tuple(axes[a] for a in AXES)


def simulate_sweep(spec: StudySpec, planned: list[PlannedTrial], done: set[str],
                   record: Callable[[TrialResult], None], progress: SweepProgress) -> None:
    """Predict the study's trials and record each (planned: the whole grid, memory-checked)."""
    from scalestudy.perfmodel.predict import predict_planned

    results: dict[str, TrialResult] = {}

    def run(p: PlannedTrial) -> TrialResult | None:
        trial_id = p.config.trial_id
        if trial_id in done:
            return None
        if trial_id in results:  # drawn again: one row per trial, but the bar counts every draw
            progress.done(results[trial_id], f"{p.config.run_name} (drawn again)")
            return results[trial_id]
        progress.running(p.config.run_name)
        results[trial_id] = predict_planned(p)  # infeasible with its reason when p cannot run
        record(results[trial_id])
        return results[trial_id]

    if spec.search.algorithm is SearchAlgorithm.grid:
        for p in planned:
            if p.feasible:
                run(p)
        return
    by_key = {_key(p.axes): p for p in planned}
    # Tune's default (tune_runner.run_tune): one sample per runnable point not yet in the ledger
    samples = spec.search.num_samples or sum(
        p.feasible and p.config.trial_id not in done for p in planned) or 1
    values = spec.axis_values()
    if spec.search.algorithm is SearchAlgorithm.random:
        rng = random.Random(spec.seed)
        for _ in range(samples):
            # an axis of one value draws nothing, so a spec's draws do not depend on how many
            # single-valued axes (layout options it leaves at their defaults) the spec schema has
            run(by_key[_key({a: rng.choice(v) if len(v) > 1 else v[0] for a, v in values.items()})])
        return
    _optuna(spec, by_key, values, samples, run)


def _optuna(spec: StudySpec, by_key: dict[tuple, PlannedTrial], values: dict[str, list],
            samples: int, run: Callable[[PlannedTrial], TrialResult | None]) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    direction = "maximize" if spec.search.mode == "max" else "minimize"
    study = optuna.create_study(direction=direction,
                                sampler=optuna.samplers.TPESampler(seed=spec.seed))
    for _ in range(samples):
        trial = study.ask()
        # Optuna's categorical choices must be None, bool, int, float or str: every axis value is.
        point = by_key[_key({a: trial.suggest_categorical(a, v) for a, v in values.items()})]
        result = run(point)
        metric = search_metric(spec.search.metric)
        value = getattr(result, metric, math.nan) if result is not None else math.nan
        if isinstance(value, (int, float)) and math.isfinite(value):
            study.tell(trial, float(value))
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
