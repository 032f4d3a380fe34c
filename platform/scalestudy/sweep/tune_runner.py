"""Ray Tune side of a measured sweep: search space, concurrency, and the driver-side callback
that records each trial the moment Tune reports it."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from ray import tune
from ray.tune import Callback
from ray.tune.search import Searcher

from scalestudy.metrics import Status, TrialResult, search_metric
from scalestudy.spec.sections import SearchAlgorithm
from scalestudy.spec.study import PlannedTrial, StudySpec, build_trial
from scalestudy.sweep.concurrency import (ClusterLimit, FixedLimit, Limit, LiveConcurrencyLimiter,
                                          LiveVariantGenerator, concurrency_limit, device_resource)
from scalestudy.sweep.progress import SweepProgress
from scalestudy.sweep.trainable import RESULT_KEY, trial_point, trial_trainable
from scalestudy.track import storage
from scalestudy.train.result import failure_reason

# The trainable only waits on its TorchTrainer; Tune needs a non-empty bundle for it, and a CPU
# share would starve the workers on a 2-core machine, so it reserves a little memory instead.
TRAINABLE_RESOURCES = {"CPU": 0, "memory": 64 * 1024**2}


def default_concurrency(spec: StudySpec, runnable: list[PlannedTrial]) -> int:
    """As many trials at once as the cluster's devices hold trials of the largest world size, now
    (no headroom). A sweep follows the cluster instead: see `sweep_limit`."""
    import ray

    devices = ray.cluster_resources().get(device_resource(_gpu_study(spec)), 1)
    return concurrency_limit(devices, _largest_world_size(runnable), can_grow=False)


def sweep_limit(spec: StudySpec, runnable: list[PlannedTrial], max_concurrent: int | None,
                can_grow: bool) -> Limit:
    """The user's fixed limit, else one that follows the cluster's devices while the sweep runs
    (sweep/concurrency.py): set once at submission, it stays 1 on a cluster whose head has none."""
    if max_concurrent:
        return FixedLimit(max_concurrent)
    return ClusterLimit(device_resource(_gpu_study(spec)), _largest_world_size(runnable), can_grow)


def _gpu_study(spec: StudySpec) -> bool:
    return any(h.is_gpu for h in spec.hardware)


def _largest_world_size(runnable: list[PlannedTrial]) -> int:
    return max((p.config.world_size for p in runnable), default=1)


def _param_space(spec: StudySpec, runnable: list[PlannedTrial]) -> dict:
    if spec.search.algorithm is SearchAlgorithm.grid:
        return {"point": tune.grid_search([p.axes for p in runnable])}
    return {a: tune.choice(values) for a, values in spec.axis_values().items()}


def _searcher(spec: StudySpec, limit: Limit):
    """Every algorithm gets the limit through the search algorithm, not `max_concurrent_trials`:
    Tune sets that once, and ignores it for a `BasicVariantGenerator` passed in (random search)."""
    if spec.search.algorithm is SearchAlgorithm.optuna:
        from ray.tune.search.optuna import OptunaSearch

        return LiveConcurrencyLimiter(
            OptunaSearch(metric=search_metric(spec.search.metric), mode=spec.search.mode,
                         seed=spec.seed), limit)
    if spec.search.algorithm is SearchAlgorithm.random:
        return LiveVariantGenerator(limit, random_state=spec.seed)
    return LiveVariantGenerator(limit)  # the grid: what Tune itself builds for no search_alg


def run_tune(spec, runnable, recorder, progress: SweepProgress, skip_ids, results_root: str | Path,
             max_concurrent, fault, verbose, search: Searcher | None = None) -> None:
    """`runnable` under the spec's search; or, given `search` (a plan's, sweep/plan_search.py),
    whatever that searcher suggests out of the spec's space, until it says it has finished."""
    from scalestudy.launch.ray_train import ensure_ray, fixed_local_resources
    from scalestudy.launch.warm import pool_name, reusable, warm_pool

    ensure_ray(verbose=verbose)
    available = fixed_local_resources()  # None on a cluster joined (launch/placement.py)
    # A URI stays a URI (str); a local root becomes absolute here, where the driver's cwd is known.
    study_dir = storage.absolute(storage.join(results_root, spec.name))
    trainable = tune.with_resources(
        tune.with_parameters(
            trial_trainable, spec=spec, storage=str(storage.join(study_dir, "train")), fault=fault,
            skip_ids=frozenset(skip_ids), pool=pool_name(spec.workers.reuse, recorder.sweep_id),
            available=available,
        ),
        TRAINABLE_RESOURCES,
    )
    grid = spec.search.algorithm is SearchAlgorithm.grid or search is not None
    limit = sweep_limit(spec, runnable, max_concurrent, can_grow=available is None)
    # A reused trainable actor keeps its imports (the trial's config needs torch for `precision:
    # auto`) and skips Tune's actor start: ~2.4 s per trial on 2 cores. Only where every trial
    # is warm: a warm trial past its limit has its group killed (WarmRun.abandon), which ends its
    # thread, but a cold trial's Ray Train controller dies only with the trainable's actor.
    reuse_trainables = spec.workers.reuse and all(reusable(p.config) for p in runnable)
    tuner = tune.Tuner(
        trainable,
        param_space={} if search is not None else _param_space(spec, runnable),
        tune_config=tune.TuneConfig(
            # A plan's searcher ends the experiment itself (Searcher.FINISHED); it measures a
            # layout at most twice (a halving window, then the full one): the bound Tune shows.
            num_samples=max(1, 2 * len(runnable)) if search is not None else (
                1 if grid else (spec.search.num_samples or len(runnable) or 1)),
            search_alg=(LiveConcurrencyLimiter(search, limit) if search is not None
                        else _searcher(spec, limit)),
            metric=None if grid else search_metric(spec.search.metric),
            mode=None if grid else spec.search.mode,
            reuse_actors=reuse_trainables,
        ),
        run_config=tune.RunConfig(
            name=f"tune-{recorder.sweep_id}",
            **storage.ray_storage(storage.join(study_dir, "tune")),
            verbose=1 if verbose else 0,
            callbacks=[_RecordCallback(spec, recorder, progress)],
        ),
    )
    # Tune prints its experiment banner to stdout whatever its verbosity; stdout carries a
    # command's results (`--json` rows), so Tune's own output goes to stderr.
    with warm_pool(spec.workers.reuse, recorder.sweep_id), contextlib.redirect_stdout(sys.stderr):
        tuner.fit()  # warm groups live as long as the sweep


class _RecordCallback(Callback):
    """Runs in the driver process: the ledger and MLflow are written here, never in workers."""

    def __init__(self, spec, recorder, progress):
        self.spec, self.recorder, self.progress = spec, recorder, progress

    def __getstate__(self):
        # Tuner pickles its run config into the experiment state for `Tuner.restore`; this
        # callback's live state (MLflow client, progress display) is meaningless elsewhere, and
        # resuming goes through the ledger, not Tune's restore.
        return {"spec": self.spec, "recorder": None, "progress": None}

    def _config(self, trial):
        return build_trial(*trial_point(self.spec, trial.config)).config

    def on_trial_start(self, iteration, trials, trial, **info):
        self.progress.running(self._config(trial).run_name)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if RESULT_KEY in result:
            self.recorder.record(TrialResult.model_validate_json(result[RESULT_KEY]))

    def on_trial_error(self, iteration, trials, trial, **info):
        err = trial.get_error()
        reason = failure_reason(err) if err else "trial actor failed without an error message"
        self.recorder.record(TrialResult.from_config(self._config(trial), Status.failed, reason=reason))
