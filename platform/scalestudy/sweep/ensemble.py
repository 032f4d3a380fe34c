"""The sweep of an ensemble study (spec `ensemble:`, plan/ensemble.py): per comparison, the single
model on all N devices, then each group of k members on N / k devices each, the members of a group
started together; every trial recorded with its place in the comparison and the group's figures
(perfmodel/ensemble.py), ledger first and MLflow second (the sweep's Recorder), and the comparison's
aggregates on the sweep's parent MLflow run.

Measured: the members must train at the same time, or their aggregate is two runs' sum. A Tune
trial starts its own worker group when it is scheduled (seconds apart, and longer than a short timed
window on a busy machine), so a group's members start on the sweep's warm worker groups
(launch/warm.py) instead: first every member's group is placed and its processes started (the slow
part), then all members are handed to their groups at once; only model building and the warm-up
steps stand between that start and each timed window. Each member's window (start and end, rank 0's
wall clock) is recorded, and their overlap (ENSEMBLE_OVERLAP_FRACTION) says how far they really ran
together. (A group's pre-warm start counts as a trial in its worker_group.trials_before.)
Simulated: each group's trials are predicted and compared (plan/ensemble.py Comparison.predict).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid

from scalestudy import metrics as M
from scalestudy.metrics import Status, TrialResult
from scalestudy.plan import PlanEntry
from scalestudy.plan.ensemble import Slot, plan_ensemble
from scalestudy.perfmodel.ensemble import compare
from scalestudy.spec.study import Backend, StudySpec

log = logging.getLogger(__name__)

# Rank 0's wall-clock marks a measured result carries (train/timing.py, train/result.py's _extra):
# the trial's start in its adapter, and the end of the timed window.
TRIAL_START_MARK, WINDOW_END_MARK = "trial_start", "timed_window_done"
# The group's figures logged on the sweep's parent run, per comparison, model and k.
PARENT_METRICS = (M.ENSEMBLE_TOKENS_PER_S, M.ENSEMBLE_TOKENS_PER_J, M.ENSEMBLE_MODEL_FLOPS_PER_J,
                  M.ENSEMBLE_MODEL_FLOPS_PER_DEVICE_S, M.ENSEMBLE_DEVICE_S_PER_TOKEN,
                  M.ENSEMBLE_OVERLAP_FRACTION, M.ENSEMBLE_TIME_TO_BUDGET_S,
                  M.ENSEMBLE_ENERGY_TO_BUDGET_J)


def timed_window(r: TrialResult) -> tuple[float, float]:
    """(start, end) of a measured trial's timed window, epoch seconds of rank 0's clock: the first
    timed step's wall time (time_to_first_step_s after the trial's start) and the window's end mark.
    NaN when the trial did not get that far."""
    timing = r.extra.get("timing") or {}
    t0, end = timing.get(TRIAL_START_MARK), timing.get(WINDOW_END_MARK)
    if t0 is None or end is None or not math.isfinite(r.time_to_first_step_s):
        return math.nan, math.nan
    return t0 + r.time_to_first_step_s, float(end)


class EnsembleSweep:
    """The comparisons of an ensemble study and what is left to run of them (--resume: a group runs
    again whole unless every trial of it is in the ledger, its members must run together)."""

    def __init__(self, spec: StudySpec, planned: list[PlanEntry], done: set[str]):
        self.spec = spec
        self.comparisons = plan_ensemble(spec, planned)  # SpecError: a member cannot run
        self.todo = [(c, group) for c in self.comparisons for group in c.runs
                     if not all(s.entry.config.trial_id in done for s in group)]

    @property
    def total(self) -> int:
        return sum(len(group) for _, group in self.todo)

    def run(self, recorder, progress, fault: str | None = None, verbose: bool = False) -> None:
        recorded: list[TrialResult] = []
        if self.spec.backend is Backend.simulate:
            for comparison, group in self.todo:
                for slot in group:
                    progress.running(slot.entry.config.run_name)
                recorded += _record(recorder, comparison.predict_group(group))
        else:
            recorded = self._measure(recorder, progress, fault, verbose)
        log_comparison(recorder.writer, recorder.parent_run_id, recorded)

    def _measure(self, recorder, progress, fault: str | None, verbose: bool) -> list[TrialResult]:
        from scalestudy.launch.ray_train import ensure_ray, fixed_local_resources
        from scalestudy.launch.warm import warm_pool

        ensure_ray(verbose=verbose)
        available = fixed_local_resources()
        recorded: list[TrialResult] = []
        # Warm groups always: the members' start together needs their processes up beforehand.
        with warm_pool(True, recorder.sweep_id) as pool:
            for comparison, group in self.todo:
                for slot in group:
                    progress.running(slot.entry.config.run_name)
                results = run_together(pool, [s.entry for s in group], available, fault)
                tagged = [s.tag(with_window(r), comparison) for s, r in zip(group, results)]
                recorded += _record(recorder, compare(tagged))
        return recorded


def with_window(r: TrialResult) -> TrialResult:
    start, end = timed_window(r)
    missing = {} if math.isfinite(start) else {
        M.TIMED_WINDOW_START_EPOCH_S: "the trial did not reach its timed window",
        M.TIMED_WINDOW_END_EPOCH_S: "the trial did not reach its timed window"}
    return r.model_copy(update={M.TIMED_WINDOW_START_EPOCH_S: start,
                                M.TIMED_WINDOW_END_EPOCH_S: end,
                                "missing": {**r.missing, **missing}})


def _record(recorder, rows: list[TrialResult]) -> list[TrialResult]:
    for r in rows:
        recorder.record(r)
    return rows


def shortfall(entries: list[PlanEntry], available: dict[str, float] | None) -> str | None:
    """Why a Ray instance of fixed resources can never hold the group's trials at once, or None."""
    if available is None:  # a cluster joined: it may grow
        return None
    need: dict[str, float] = {}
    for e in entries:
        for k, v in e.resources_per_worker.items():
            need[k] = need.get(k, 0.0) + v * e.config.world_size
    short = {k: v for k, v in need.items() if available.get(k, 0.0) + 1e-9 < v}
    if not short:
        return None
    return (f"placement: the group's {len(entries)} trials need {need} at once, and the Ray "
            f"instance this process started has {available}; run it on a Ray cluster")


def _prewarm(pool_name: str, entries: list[PlanEntry]) -> None:
    """Every trial's warm group placed and started, then left idle for it: the slow part of a
    start, done before any member begins (each then takes an idle group of its shape at once)."""
    import ray

    pool = ray.get_actor(pool_name)
    holders = [uuid.uuid4().hex for _ in entries]  # launch/warm_pool.py: who holds a group
    try:
        ray.get([pool.acquire.remote(e.config, h) for e, h in zip(entries, holders)])
    except Exception:
        ray.get([pool.release.remote(h, False) for h in holders])  # what did start goes
        raise
    ray.get([pool.release.remote(h, True) for h in holders])


def run_together(pool_name: str, entries: list[PlanEntry], available: dict[str, float] | None,
                 fault: str | None = None) -> list[TrialResult]:
    """The group's trials, started at once on warm groups; their results in order. A refused entry
    is recorded as such; a group the instance cannot hold, or whose groups fail to start, as a
    timeout or failure of each trial."""
    from scalestudy.launch.warm import WarmRun

    t0 = time.time()
    refused = {i: TrialResult.refused(e) for i, e in enumerate(entries) if not e.feasible}
    runnable = [(i, e) for i, e in enumerate(entries) if e.feasible]
    why = shortfall([e for _, e in runnable], available)
    if why is not None:
        return [refused.get(i) or TrialResult.from_config(e.config, Status.timeout, reason=why)
                for i, e in enumerate(entries)]
    try:
        _prewarm(pool_name, [e for _, e in runnable])
    except Exception as err:  # noqa: BLE001 - a group that cannot start fails its trials
        from scalestudy.train.result import failure_reason

        reason = f"worker groups did not start: {failure_reason(err)}"
        return [refused.get(i) or TrialResult.from_config(e.config, Status.failed, reason=reason,
                                                          wall_time_s=time.time() - t0)
                for i, e in enumerate(entries)]
    out: dict[int, TrialResult] = dict(refused)
    runs = {i: WarmRun(pool_name, e.config) for i, e in runnable}

    def _one(i: int) -> None:
        out[i] = runs[i].run(time.time(), fault)

    threads = {i: threading.Thread(target=_one, args=(i,), daemon=True, name=f"member-{i}")
               for i, _ in runnable}
    for t in threads.values():  # all at once: the members' start together
        t.start()
    for i, e in runnable:
        cfg = e.config
        limit_s = cfg.placement_timeout_s + cfg.trial_timeout_s  # as a warm Tune trial's
        threads[i].join(max(0.0, limit_s - (time.time() - t0)))
        if threads[i].is_alive() or i not in out:
            timed_out = threads[i].is_alive()
            runs[i].abandon()
            out[i] = TrialResult.from_config(
                cfg, Status.timeout, wall_time_s=time.time() - t0,
                reason=("exceeded placement_timeout_s + trial_timeout_s" if timed_out
                        else "trial thread ended without a result"))
    return [out[i] for i in range(len(entries))]


def log_comparison(writer, parent_run_id: str | None, rows: list[TrialResult]) -> None:
    """The groups' figures on the sweep's parent run: `<metric>/n<N>/<model>/k<k>` (the single
    model as k1 of its own model). Tracking never stops a sweep: a failure is a warning."""
    if writer is None or parent_run_id is None or not writer.enabled or not rows:
        return
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    seen: dict[str, float] = {}
    for r in rows:
        if r.status is not Status.completed or r.ensemble_k is None:
            continue
        for name in PARENT_METRICS:
            value = getattr(r, name)
            if math.isfinite(value):
                seen[f"{name}/n{r.world_size * r.ensemble_k}/{r.model}/k{r.ensemble_k}"] = value
    metrics = [Metric(k, v, now, 0) for k, v in seen.items()]
    try:
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit
            writer.client.log_batch(parent_run_id, metrics=metrics[start:start + 1000])
    except Exception as err:  # noqa: BLE001 - the rows are in the ledger and on the trials' runs
        log.warning("MLflow: the ensemble comparison was not logged on the parent run: %s", err)


__all__ = ["EnsembleSweep", "Slot", "run_together", "timed_window"]
