"""Run a study: expand, check feasibility, run trials (Ray Tune x Ray Train, or the performance
model), and record every result in the ledger first and MLflow second."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from scalestudy.metrics import Status, TrialResult
from scalestudy.plan import PlanEntry
from scalestudy.spec.sections import SearchAlgorithm
from scalestudy.spec.study import Backend, StudySpec
from scalestudy.spec.trial import trial_name
from scalestudy.sweep.ensemble import EnsembleSweep
from scalestudy.sweep.progress import SweepProgress
from scalestudy.sweep.simulate import simulate_sweep
from scalestudy.track.ledger import Ledger, ledger_path, result_to_row
from scalestudy.track.mlflow_writer import MlflowWriter, tracking_uri

if TYPE_CHECKING:
    from ray.tune.search import Searcher

log = logging.getLogger(__name__)

FAULT_ENV = "SCALESTUDY_INJECT_FAULT"
DONE_STATUSES = (Status.completed, Status.failed, Status.infeasible)


@dataclass
class SweepOutcome:
    results: list[TrialResult] = field(default_factory=list)
    skipped: int = 0
    ledger: Path | str | None = None  # a URI string under an object-store results root
    mlflow_uri: str | None = None
    mlflow_error: str | None = None
    wall_time_s: float = 0.0


def spec_hash(spec: StudySpec) -> str:
    blob = spec.model_dump_json(exclude={"spec_dir"}).encode()
    return hashlib.sha1(blob).hexdigest()[:12]


class Recorder:
    """Ledger first, then MLflow; used by both backends.

    Measured trials (minutes each): one ledger part each, then one MLflow child run each under
    the sweep's parent, its run id patched into the ledger. Predictions (batch=True, well under a
    millisecond each): rows written as one ledger part per FLUSH_ROWS rows or FLUSH_S seconds (a
    crash loses at most those not yet flushed: seconds of predictions, which --resume redoes), and
    logged to MLflow once, at close(), as one table on the parent run. What MLflow refused during
    the sweep is tried once more at close(); what is still missing, sync-mlflow uploads later.
    """

    FLUSH_ROWS = 2000
    FLUSH_S = 5.0

    def __init__(self, spec: StudySpec, ledger: Ledger, writer: MlflowWriter | None,
                 sweep_id: str, parent_run_id: str | None, progress: SweepProgress | None,
                 batch: bool = False):
        self.spec, self.ledger, self.writer = spec, ledger, writer
        self.sweep_id, self.parent_run_id, self.progress = sweep_id, parent_run_id, progress
        self.batch = batch
        self.results: list[TrialResult] = []
        self._seen: set[str] = set()
        self._name_axes = spec.name_axes  # a property that walks the spec: once, not per row
        self._meta = {"sweep_id": sweep_id, "spec_hash": spec_hash(spec),
                      "experiment": spec.experiment, "mlflow_run_id": None}
        self._unwritten: list[dict] = []  # batch rows not yet in the ledger
        self._table: list[dict] = []  # batch rows for the MLflow table
        self._unlogged: list[tuple[TrialResult, str, str]] = []  # (result, result_id, run name)
        self._flushed_at = time.monotonic()

    def record(self, result: TrialResult) -> None:
        if result.trial_id in self._seen:  # a retried Tune result must not become a second row
            return
        self._seen.add(result.trial_id)
        result_id = uuid.uuid4().hex
        run_name = trial_name(result, self._name_axes)
        row = result_to_row(result, recorded_at=time.time(), result_id=result_id, **self._meta)
        if self.batch:
            self._unwritten.append(row)
            self._table.append(row)
            if (len(self._unwritten) >= self.FLUSH_ROWS
                    or time.monotonic() - self._flushed_at >= self.FLUSH_S):
                self.flush()
        else:
            self.ledger.append_rows([row])
            if self.writer is not None and not self._log(result, result_id, run_name):
                self._unlogged.append((result, result_id, run_name))
        self.results.append(result)
        if self.progress:
            self.progress.done(result, run_name)

    def flush(self) -> None:
        """Batch rows recorded so far into the ledger, as one part."""
        rows, self._unwritten = self._unwritten, []
        self.ledger.append_rows(rows)
        self._flushed_at = time.monotonic()

    def _log(self, result: TrialResult, result_id: str, run_name: str) -> bool:
        if self.writer is None:
            return False
        run_id = self.writer.log_trial(result, self.parent_run_id, result_id, run_name)
        if run_id:
            self.ledger.update(result.trial_id, mlflow_run_id=run_id)
        return bool(run_id)

    def close(self) -> str | None:
        """Flush, log what MLflow lacks, export the ledger. The MLflow error if rows stay unlogged."""
        self.flush()
        unlogged = 0
        if self.writer is not None:
            unlogged = self._log_rest()
        try:
            self.ledger.export()
        except Exception as err:  # noqa: BLE001 - the parts hold every row; only the copy is stale
            log.warning("ledger export %s not written: %s", self.ledger.path, err)
        return (self.writer.error or "MLflow unavailable") if unlogged else None

    def _log_rest(self) -> int:
        """The batch's table, and a second try for trials MLflow refused; rows still unlogged."""
        unlogged = 0
        if self._table:
            if self.parent_run_id is None:  # start_sweep failed, MLflow may be back
                self.parent_run_id = self.writer.create_parent(self.sweep_id, f"sweep-{self.sweep_id}")
            if self.parent_run_id and self.writer.log_predictions(self.parent_run_id, self._table):
                self.ledger.update_many([r["trial_id"] for r in self._table],
                                        mlflow_run_id=self.parent_run_id)
            else:
                unlogged += len(self._table)
        for item in self._unlogged:
            unlogged += not self._log(*item)
        return unlogged


def finished_rows(ledger: Ledger) -> list[dict]:
    """The ledger's rows of trials that ended (DONE_STATUSES): what a resumed sweep skips."""
    finished = {s.value for s in DONE_STATUSES}
    return [r for r in ledger.rows() if r.get("status") in finished]


def run_sweep(
    spec: StudySpec,
    planned: list[PlanEntry],
    spec_text: str,
    resume: bool = False,
    max_concurrent: int | None = None,
    results_root: str | Path = "results",
    show_progress: bool = True,
    verbose: bool = False,
    search: Searcher | None = None,
) -> SweepOutcome:
    """Run `planned` (the spec's plan) and record every result. Given `search` (a plan's searcher,
    sweep/plan_search.py), Tune runs what it suggests out of the feasible entries instead, as many
    as it asks for; nothing is recorded for the entries it never suggests."""
    t0 = time.time()
    ledger = Ledger(ledger_path(spec.name, results_root))
    done = {r["trial_id"] for r in finished_rows(ledger)} if resume else set()
    todo = [p for p in planned if p.config.trial_id not in done]
    outcome = SweepOutcome(skipped=len(planned) - len(todo), ledger=ledger.path)
    if spec.backend is Backend.measure:
        _check_storage(todo, results_root, verbose)

    # One large model or several smaller ones (issue 36): planned before MLflow (a member that
    # cannot run is an error of the spec), run by its own runner.
    ensemble = EnsembleSweep(spec, planned, done) if spec.ensemble is not None else None

    uri = tracking_uri(spec.tracking.mlflow_uri)
    writer = MlflowWriter(uri, spec.experiment)
    sweep_id = uuid.uuid4().hex[:12]
    parent = writer.start_sweep(sweep_id, spec_text, run_name=f"sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    grid = spec.search.algorithm is SearchAlgorithm.grid
    # A search draws num_samples points, by default one per runnable point (Tune's and simulate's)
    total = len(todo) if grid else spec.search.num_samples or sum(p.feasible for p in todo) or 1
    total = ensemble.total if ensemble is not None else total
    total = None if search is not None else total  # the searcher decides how many
    rec = Recorder(spec, ledger, writer, sweep_id, parent, None,
                   batch=spec.backend is Backend.simulate)
    try:
        with SweepProgress(total, enabled=show_progress) as progress:
            progress.set_study(spec.name)
            rec.progress = progress
            if ensemble is not None:
                ensemble.run(rec, progress, os.environ.get(FAULT_ENV), verbose)
            else:
                for p in todo:
                    if not p.feasible and grid and search is None:
                        rec.record(TrialResult.refused(p))
                runnable = [p for p in todo if p.feasible]
                if spec.backend is Backend.simulate:
                    simulate_sweep(spec, planned, done, rec.record, progress)
                # (a plan's searcher runs even with nothing left to run: it answers from the ledger)
                elif runnable or not grid or search is not None:
                    from scalestudy.sweep.tune_runner import run_tune

                    run_tune(spec, runnable, rec, progress, done, results_root,
                             max_concurrent, os.environ.get(FAULT_ENV), verbose, search)
    finally:
        try:
            outcome.mlflow_error = rec.close()
        finally:
            writer.end_sweep()
    if resume and outcome.mlflow_error is None:
        # Rows an interrupted sweep recorded but never got into MLflow (stopped between the two):
        # the ledger is the truth, and resuming a study finishes it in both.
        from scalestudy.track.sync import sync_mlflow

        outcome.mlflow_error = sync_mlflow(spec.name, uri, results_root)[1]
    outcome.results = rec.results
    outcome.mlflow_uri = uri
    outcome.wall_time_s = time.time() - t0
    return outcome


def _check_storage(todo: list[PlanEntry], results_root: str | Path, verbose: bool) -> None:
    """Before MLflow or any trial: refuse checkpointing trials a root other nodes cannot see."""
    from scalestudy.sweep.shared_storage import check_checkpoint_storage
    from scalestudy.train.resume import wants_checkpoints

    if any(p.feasible and wants_checkpoints(p.config) for p in todo):
        from scalestudy.launch.ray_train import ensure_ray

        ensure_ray(verbose=verbose)
        check_checkpoint_storage(results_root, checkpointing=True)


def sorted_for_table(results: list[TrialResult]) -> list[TrialResult]:
    def key(r: TrialResult) -> float:
        v = r.tokens_per_s_per_device
        return -v if math.isfinite(v) else math.inf

    return sorted(results, key=key)
