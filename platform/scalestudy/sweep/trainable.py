"""The Ray Tune function trainable: one Tune trial = one Ray Train TorchTrainer run.

The trainable turns the sampled axis values into a TrialConfig, checks feasibility, runs the trial
(the same run_trial as `scalestudy run`), enforces the per-trial time limit and reports ONE result:
the whole TrialResult as JSON, plus the search metric for Tune's searchers.
"""

from __future__ import annotations

import threading
import time
from typing import Any

RESULT_KEY = "trial_result_json"
BACKSTOP_S = 120.0  # beyond both limits: time for run_trial to abort the trial and return
# A Tune config's timed steps for this trial alone (a plan's halving window, sweep/plan_search.py):
# the study's `steps` are spec-wide, a searcher's window is per trial.
WINDOW_KEY = "measure_steps"


def trial_point(spec, config: dict[str, Any]):
    """The spec a Tune trial runs under and its typed grid point: the sampled axes (a grid's
    `point`, or one key per axis) resolved against the spec, with a searcher's window applied."""
    from scalestudy.spec.study import AXES, resolve_point

    if config.get(WINDOW_KEY):
        steps = spec.steps.model_copy(update={"measure": int(config[WINDOW_KEY])})
        spec = spec.model_copy(update={"steps": steps})
    axes = config.get("point") or {a: config[a] for a in AXES}
    return spec, resolve_point(spec, axes)


def trial_trainable(
    config: dict[str, Any], *, spec, storage: str, fault: str | None, skip_ids: frozenset[str],
    pool: str | None = None,
    available: dict[str, float] | None = None,
) -> None:
    from ray import tune

    from scalestudy.metrics import Status, TrialResult, search_metric
    from scalestudy.plan import plan_point
    from scalestudy.track.storage import ray_storage
    from scalestudy.launch.ray_train import run_trial, unplaceable
    from scalestudy.launch.warm import warm_run

    t0 = time.time()
    planned = plan_point(*trial_point(spec, config))
    cfg = planned.config
    if cfg.trial_id in skip_ids:  # resume of a random/optuna sweep: already in the ledger
        tune.report({"skipped": 1})
        return
    if not planned.feasible:
        result = TrialResult.refused(planned)
    elif (turned_away := unplaceable(cfg, available, t0)) is not None:
        result = turned_away  # a Ray instance of fixed resources that can never hold it
    else:
        box: dict[str, TrialResult] = {}
        warm = warm_run(pool, cfg)  # None: a cold Ray Train worker group of its own

        def _run() -> None:
            box["r"] = (warm.run(t0, fault) if warm else
                        run_trial(cfg, t0=t0, fault=fault, **ray_storage(storage)))

        # Daemon thread: on timeout this function returns, Tune stops the trial's actor, and the
        # Train controller and workers it owns die with it.
        worker = threading.Thread(target=_run, daemon=True, name="trial")
        worker.start()
        # A cold trial's run_trial enforces both limits itself (launch/deadline.py: the wait for
        # nodes, then the run from the worker group's start), so its join is only a backstop; a
        # warm trial's wait for a new group is bounded by the pool (placement_timeout_s), so here
        # it gets the same sum: its run is trial_timeout_s at most once its group is up.
        limit_s = cfg.placement_timeout_s + cfg.trial_timeout_s + (0 if warm else BACKSTOP_S)
        worker.join(limit_s)
        # Decided before the abandon below: killing a warm group makes the trial's thread end
        # with "actor died", which is the consequence of the timeout, not the trial's outcome.
        timed_out = worker.is_alive()
        if timed_out and warm:
            warm.abandon()  # its workers belong to the sweep's pool, not to this actor
        if timed_out or "r" not in box:
            result = TrialResult.from_config(
                cfg, Status.timeout, wall_time_s=time.time() - t0,
                reason=("exceeded placement_timeout_s + trial_timeout_s "
                        f"({cfg.placement_timeout_s:g} + {cfg.trial_timeout_s:g} s)")
                if timed_out else "trial thread ended without a result",
            )
        else:
            result = box["r"]
    name = search_metric(spec.search.metric)
    tune.report({RESULT_KEY: result.model_dump_json(), name: getattr(result, name, float("nan"))})
