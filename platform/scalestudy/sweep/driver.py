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

from scalestudy.metrics import Status, TrialResult
from scalestudy.spec.study import Backend, PlannedTrial, SearchAlgorithm, StudySpec
from scalestudy.spec.trial import trial_name
from scalestudy.sweep.feasibility import check_all
from scalestudy.sweep.progress import SweepProgress
from scalestudy.sweep.simulate import simulate_sweep
from scalestudy.track.ledger import Ledger, ledger_path
from scalestudy.track.mlflow_writer import MlflowWriter, tracking_uri

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
    """Ledger first (atomic), then MLflow; used by both backends and by sync-mlflow."""

    def __init__(self, spec: StudySpec, ledger: Ledger, writer: MlflowWriter | None,
                 sweep_id: str, parent_run_id: str | None, progress: SweepProgress | None):
        self.spec, self.ledger, self.writer = spec, ledger, writer
        self.sweep_id, self.parent_run_id, self.progress = sweep_id, parent_run_id, progress
        self.results: list[TrialResult] = []
        self._seen: set[str] = set()

    def record(self, result: TrialResult) -> None:
        if result.trial_id in self._seen:  # a retried Tune result must not become a second row
            return
        self._seen.add(result.trial_id)
        result_id = uuid.uuid4().hex
        run_name = trial_name(result, self.spec.name_axes)
        self.ledger.append(result, result_id=result_id, sweep_id=self.sweep_id,
                           spec_hash=spec_hash(self.spec), experiment=self.spec.experiment,
                           mlflow_run_id=None)
        if self.writer is not None:
            run_id = self.writer.log_trial(result, self.parent_run_id, result_id, run_name)
            if run_id:
                self.ledger.update(result.trial_id, mlflow_run_id=run_id)
        self.results.append(result)
        if self.progress:
            self.progress.done(result, run_name)


def run_sweep(
    spec: StudySpec,
    planned: list[PlannedTrial],
    spec_text: str,
    resume: bool = False,
    max_concurrent: int | None = None,
    results_root: str | Path = "results",
    show_progress: bool = True,
    verbose: bool = False,
) -> SweepOutcome:
    t0 = time.time()
    planned = check_all(planned)
    ledger = Ledger(ledger_path(spec.name, results_root))
    finished = {s.value for s in DONE_STATUSES}
    done = {r["trial_id"] for r in ledger.rows() if r.get("status") in finished} if resume else set()
    todo = [p for p in planned if p.config.trial_id not in done]
    outcome = SweepOutcome(skipped=len(planned) - len(todo), ledger=ledger.path)
    if spec.backend is Backend.measure:
        _check_storage(todo, results_root, verbose)

    uri = tracking_uri(spec.tracking.mlflow_uri)
    writer = MlflowWriter(uri, spec.experiment)
    sweep_id = uuid.uuid4().hex[:12]
    parent = writer.start_sweep(sweep_id, spec_text, run_name=f"sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    grid = spec.search.algorithm is SearchAlgorithm.grid
    # A search draws num_samples points, by default one per runnable point (Tune's and simulate's)
    total = len(todo) if grid else spec.search.num_samples or sum(p.feasible for p in todo) or 1
    try:
        with SweepProgress(total, enabled=show_progress) as progress:
            progress.set_study(spec.name)
            rec = Recorder(spec, ledger, writer, sweep_id, parent, progress)
            for p in todo:
                if not p.feasible and spec.search.algorithm is SearchAlgorithm.grid:
                    rec.record(TrialResult.from_config(p.config, Status.infeasible, reason=p.reason))
            runnable = [p for p in todo if p.feasible]
            if spec.backend is Backend.simulate:
                simulate_sweep(spec, planned, done, rec.record, progress)
            elif runnable or spec.search.algorithm is not SearchAlgorithm.grid:
                from scalestudy.sweep.tune_runner import run_tune

                run_tune(spec, runnable, rec, progress, done, results_root,
                         max_concurrent, os.environ.get(FAULT_ENV), verbose)
    finally:
        writer.end_sweep()
    outcome.results = rec.results
    outcome.mlflow_uri, outcome.mlflow_error = uri, writer.error
    outcome.wall_time_s = time.time() - t0
    return outcome


def _check_storage(todo: list[PlannedTrial], results_root: str | Path, verbose: bool) -> None:
    """Before MLflow or any trial: refuse checkpointing trials a root other nodes cannot see."""
    from scalestudy.sweep.shared_storage import check_checkpoint_storage
    from scalestudy.train.resume import wants_checkpoints

    if any(p.feasible and wants_checkpoints(p.config) for p in todo):
        from scalestudy.train.launch import ensure_ray

        ensure_ray(verbose=verbose)
        check_checkpoint_storage(results_root, checkpointing=True)


def sorted_for_table(results: list[TrialResult]) -> list[TrialResult]:
    def key(r: TrialResult) -> float:
        v = r.tokens_per_s_per_device
        return -v if math.isfinite(v) else math.inf

    return sorted(results, key=key)
