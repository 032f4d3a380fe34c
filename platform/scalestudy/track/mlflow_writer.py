"""MLflow tracking: one experiment per study, a parent run per sweep, a child run per measured
trial; a sweep of predictions logs them as one table on its parent run (thousands of runs would
make MLflow's UI and search unusable, and cost a round trip each).

Only the sweep driver writes here (never the Ray workers), so one sqlite file is safe. The ledger is
written first. An HTTP request is retried with exponential back-off (MLflow's own retries, bounded
here to seconds rather than MLflow's minutes); a call that still fails is a warning and the next
call tries again; after MAX_FAILURES_IN_A_ROW failed calls in a row the server is taken as down and
the writer stops for the rest of the command. What never reached MLflow, `scalestudy sync-mlflow`
uploads later (the ledger is the truth).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path

from scalestudy import metrics as M
from scalestudy.metrics import Status, TrialResult
from scalestudy.spec.trial import config_columns

log = logging.getLogger(__name__)

DEFAULT_URI = "sqlite:///mlflow.db"
ROLE_TAG = "scalestudy.role"
# On a sweep's parent run: the number of predictions logged in its table (PREDICTIONS_ARTIFACT).
PREDICTIONS_TAG = "scalestudy.predictions"
PREDICTIONS_ARTIFACT = "predictions.parquet"
# Parent-run summary of a prediction table: the best value of a metric, the count of a status.
BEST_PREFIX = "best/"
COUNT_PREFIX = "trials/"
SUMMARY_METRICS = (M.TOKENS_PER_S_PER_DEVICE, M.TOKENS_PER_S, M.MFU, M.TOKENS_PER_J_ESTIMATED)
RESULT_ID_TAG = "scalestudy.result_id"
SWEEP_ID_TAG = "scalestudy.sweep_id"
# MLflow 3 sorts experiments into GenAI apps and model training. Its UI's own kind selector stores
# the choice in this tag (MLflow 3.17 server/js: setExperimentTag "mlflow.experimentKind"); the
# values are "genai_development" and "custom_model_development" (shown as "Machine learning").
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
VERSION_PACKAGES = ("torch", "ray", "deepspeed", "transformers", "mlflow")
# MLflow's HTTP retries (urllib3, on connection errors and 429/5xx): 3 with back-off 1, 2, 4 s
# (+ up to 1 s jitter each), a 10 s timeout per try: a blip is ridden out; a server that is down
# costs about half a minute, not MLflow's default 7 retries from 2 s (over 4 minutes per call).
HTTP_RETRY_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                  "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
MAX_FAILURES_IN_A_ROW = 3


def tracking_uri(spec_uri: str | None) -> str:
    return spec_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


@functools.cache
def software_tags() -> dict[str, str]:
    tags = {}
    for pkg in VERSION_PACKAGES:
        try:
            tags[f"version.{pkg}"] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        if commit:
            tags["git_commit"] = commit
    except (OSError, subprocess.SubprocessError):
        pass
    return tags


class MlflowWriter:
    """Thin wrapper over MlflowClient that turns tracking failures into one warning."""

    def __init__(self, uri: str, experiment: str):
        for name, value in HTTP_RETRY_ENV.items():  # a user's own setting wins
            os.environ.setdefault(name, value)
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.experiment = experiment
        self.client = MlflowClient(tracking_uri=uri)
        self.error: str | None = None  # the latest failure, kept after later calls succeed
        self.failures_in_a_row = 0
        self.experiment_id: str | None = None
        self._guard(lambda: None)  # the experiment, now: a store that is down shows at once

    @property
    def enabled(self) -> bool:
        return self.failures_in_a_row < MAX_FAILURES_IN_A_ROW

    def _guard(self, fn, *args, **kwargs):
        """fn's value, or None when MLflow failed (a warning; the caller keeps its row unlogged)."""
        if not self.enabled:
            return None
        try:
            if self.experiment_id is None:  # not made yet, or the first try failed
                self._ensure_experiment()
            value = fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - tracking must never stop a sweep
            first = (str(err).splitlines() or [type(err).__name__])[0]
            self.error = f"MLflow at {self.uri} unavailable ({first[:200]})"
            self.failures_in_a_row += 1
            then = ("off for the rest of this command" if not self.enabled
                    else "the next call tries again")
            log.warning("%s; %s; results stay in the ledger, upload later with sync-mlflow",
                        self.error, then)
            return None
        self.failures_in_a_row = 0
        return value

    def _ensure_experiment(self) -> None:
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            self.experiment_id = self.client.create_experiment(
                self.experiment, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
            return
        self.experiment_id = exp.experiment_id
        # Older stores hold experiments created before the tag; a kind someone chose stays.
        if EXPERIMENT_KIND_TAG not in exp.tags:
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)

    # --- parent run -------------------------------------------------------------------------
    def start_sweep(self, sweep_id: str, spec_text: str, run_name: str) -> str | None:
        return self._guard(self._start_sweep, sweep_id, spec_text, run_name)

    def _start_sweep(self, sweep_id: str, spec_text: str, run_name: str) -> str:
        import mlflow

        mlflow.set_tracking_uri(self.uri)
        run = mlflow.start_run(
            experiment_id=self.experiment_id, run_name=run_name, log_system_metrics=True,
            tags={ROLE_TAG: "sweep", SWEEP_ID_TAG: sweep_id, **software_tags()},
        )
        mlflow.log_text(spec_text, "spec.yaml")
        return run.info.run_id

    def end_sweep(self, failed: bool = False) -> None:
        import mlflow

        if not mlflow.active_run():
            return
        if self.enabled:
            self._guard(mlflow.end_run, "FAILED" if failed else "FINISHED")
            return
        # Off after failures: end the run anyway (its system-metrics thread, and a later
        # start_run in this process, which an active run would refuse), whatever the store says.
        try:
            mlflow.end_run("FAILED")
        except Exception as err:  # noqa: BLE001
            log.warning("MLflow: could not end the sweep's run: %s", err)

    def parent_for(self, sweep_id: str) -> str | None:
        """An existing parent run of that sweep in this store, if any (for sync-mlflow)."""
        def _find():
            runs = self.client.search_runs(
                [self.experiment_id],
                filter_string=f"tags.`{ROLE_TAG}` = 'sweep' and tags.`{SWEEP_ID_TAG}` = '{sweep_id}'",
                max_results=1,
            )
            return runs[0].info.run_id if runs else None

        return self._guard(_find)

    def create_parent(self, sweep_id: str, run_name: str) -> str | None:
        def _create():
            run = self.client.create_run(
                self.experiment_id, run_name=run_name,
                tags={ROLE_TAG: "sweep", SWEEP_ID_TAG: sweep_id, **software_tags()},
            )
            self.client.set_terminated(run.info.run_id)
            return run.info.run_id

        return self._guard(_create)

    # --- a sweep's predictions: one table on its parent run -----------------------------------
    def has_predictions(self, run_id: str) -> bool | None:
        return self._guard(lambda: PREDICTIONS_TAG in self.client.get_run(run_id).data.tags)

    def log_predictions(self, run_id: str, rows: list[dict]) -> bool:
        """Ledger rows (predictions) as PREDICTIONS_ARTIFACT (+ a CSV the UI shows as a table),
        the best value of SUMMARY_METRICS and the count of each status on the run. False if
        MLflow failed."""
        return bool(self._guard(self._log_predictions, run_id, rows))

    def _log_predictions(self, run_id: str, rows: list[dict]) -> bool:
        import pyarrow as pa
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq
        from mlflow.entities import Metric, RunTag

        from scalestudy.track.ledger import rows_table

        table = rows_table(rows)
        # CSV holds scalars only: list columns (per-step series) left out, all-null ones as text.
        flat = table.select([f.name for f in table.schema if not pa.types.is_nested(f.type)])
        flat = flat.cast(pa.schema([pa.field(f.name, pa.string()) if pa.types.is_null(f.type)
                                    else f for f in flat.schema]))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / PREDICTIONS_ARTIFACT
            pq.write_table(table, path)
            pacsv.write_csv(flat, path.with_suffix(".csv"))
            self.client.log_artifact(run_id, str(path))
            self.client.log_artifact(run_id, str(path.with_suffix(".csv")))
        now = int(time.time() * 1000)
        metrics = []
        for name in SUMMARY_METRICS:
            values = [r.get(name) for r in rows]
            finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
            if finite:
                metrics.append(Metric(f"{BEST_PREFIX}{name}", max(finite), now, 0))
        for status in {r.get("status") for r in rows}:
            count = sum(r.get("status") == status for r in rows)
            metrics.append(Metric(f"{COUNT_PREFIX}{status}", count, now, 0))
        self.client.log_batch(run_id, metrics=metrics,
                              tags=[RunTag(PREDICTIONS_TAG, str(len(rows)))])
        return True

    # --- child runs -------------------------------------------------------------------------
    def logged_results(self) -> dict[str, str] | None:
        """result id -> run id of every trial run in the experiment."""
        def _ids():
            runs = self.client.search_runs(
                [self.experiment_id], filter_string=f"tags.`{ROLE_TAG}` = 'trial'",
                max_results=50000,
            )
            return {r.data.tags.get(RESULT_ID_TAG): r.info.run_id for r in runs}

        return self._guard(_ids)

    def log_trial(self, result: TrialResult, parent_run_id: str | None, result_id: str,
                  run_name: str) -> str | None:
        return self._guard(self._log_trial, result, parent_run_id, result_id, run_name)

    def _log_trial(self, result: TrialResult, parent_run_id: str | None, result_id: str,
                   run_name: str) -> str:
        from mlflow.entities import Metric, Param, RunTag

        tags = {
            ROLE_TAG: "trial", RESULT_ID_TAG: result_id, "trial_id": result.trial_id,
            "status": result.status.value, "reason": result.reason or "",
            "backend": result.backend, "hardware": result.hardware, "model": result.model,
            "energy_source": result.energy_source, **software_tags(),
        }
        if result.uncalibrated:  # a prediction's figures its profile did not calibrate
            tags["uncalibrated"] = "; ".join(result.uncalibrated)[:5000]
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        run_id = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id
        now = int(time.time() * 1000)
        config = {k: v for k, v in result.model_dump(mode="json").items()
                  if k in CONFIG_PARAMS}
        params = [Param(k, str(v)) for k, v in config.items()]
        metrics = [Metric(k, v, now, 0) for k, v in result.scalar_metrics().items()]
        metrics += [Metric(M.TRAIN_LOSS, v, now, i) for i, v in enumerate(result.losses)]
        metrics += [Metric(M.TRAIN_STEP_TIME_S, v, now, i) for i, v in enumerate(result.step_times_s)]
        self.client.log_batch(run_id, metrics=metrics[:1000], params=params,
                              tags=[RunTag(k, v) for k, v in result.missing.items()][:100])
        self._log_artifacts(run_id, result)
        status = "FAILED" if result.status in (Status.failed, Status.timeout) else "FINISHED"
        self.client.set_terminated(run_id, status)
        return run_id

    def _log_artifacts(self, run_id: str, result: TrialResult) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        ds_config = result.extra.get("deepspeed_config")
        if ds_config:
            self.client.log_dict(run_id, ds_config, "deepspeed_config.json")
        self.client.log_dict(run_id, json.loads(result.model_dump_json()), "trial_result.json")
        if result.losses or result.step_times_s:
            # Losses cover every step; step times only the timed window, which ends the run.
            n = max(len(result.losses), len(result.step_times_s))
            nan = float("nan")
            losses = [nan] * (n - len(result.losses)) + list(result.losses)
            timed = [nan] * (n - len(result.step_times_s)) + list(result.step_times_s)
            table = pa.table({"step": list(range(n)), "loss": losses, M.STEP_TIME_S: timed})
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "steps.parquet"
                pq.write_table(table, path)
                self.client.log_artifact(run_id, str(path))


def experiment_ui_url(ui_base: str, experiment_id: str) -> str:
    """The experiment's runs in `mlflow ui`. MLflow 3.17's UI picks GenAI or model-training pages
    from a per-browser switch (default GenAI, whose overview shows zero traces here), not from the
    experiment's tag; `workflowType=machine_learning` in the link opens the runs table instead."""
    return f"{ui_base.rstrip('/')}/#/experiments/{experiment_id}?workflowType=machine_learning"


# Every config column is an MLflow param (the precision a trial ran at included).
CONFIG_PARAMS: frozenset[str] = frozenset(config_columns())
