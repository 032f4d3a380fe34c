"""Upload ledger rows that are missing from an MLflow store (after it was down, or to a new one).

A measured row is one child run, matched by result id (a tag on every child run); predictions are
one table per sweep on the sweep's parent run, matched by the parent's PREDICTIONS_TAG. Running it
twice logs nothing twice. The ledger then gets the run ids (one small patch part per upload) and a
fresh export.
"""

from __future__ import annotations

from pathlib import Path

from scalestudy.spec.trial import name_axes_of, trial_name
from scalestudy.track.ledger import Ledger, ledger_path, row_to_result
from scalestudy.track.mlflow_writer import MlflowWriter

SIMULATE = "simulate"


def sync_mlflow(study: str, uri: str, results_root: str | Path = "results") -> tuple[int, str | None]:
    """Returns (rows logged, error or None)."""
    ledger = Ledger(ledger_path(study, results_root))
    rows = ledger.rows()
    if not rows:
        return 0, None
    logged = patched = 0
    by_experiment: dict[str, list[dict]] = {}
    for row in rows:
        by_experiment.setdefault(row.get("experiment") or study, []).append(row)
    # Names show every axis the study swept, as the sweep named them (its spec is not stored).
    axes = name_axes_of(rows)
    try:
        for experiment, exp_rows in by_experiment.items():
            writer = MlflowWriter(uri, experiment)
            present = writer.logged_results()
            if present is None:
                return logged, writer.error
            # Logged, but the run id never reached the ledger (stopped between the two).
            known = [{"trial_id": r["trial_id"], "mlflow_run_id": present[r["result_id"]]}
                     for r in exp_rows if r.get("result_id") in present
                     and r.get("mlflow_run_id") != present[r["result_id"]]]
            ledger.patch(known)
            patched += len(known)
            missing = [r for r in exp_rows if r.get("result_id") not in present]
            n, error = _sync_experiment(writer, ledger, missing, axes)
            logged += n
            if error:
                return logged, error
    finally:
        if logged or patched:
            ledger.export()
    return logged, None


def _sync_experiment(writer: MlflowWriter, ledger: Ledger, rows: list[dict],
                     axes: tuple[str, ...]) -> tuple[int, str | None]:
    logged = 0
    parents: dict[str, str | None] = {}
    tables: dict[str, list[dict]] = {}

    def parent(sweep_id: str) -> str | None:
        if sweep_id not in parents:
            parents[sweep_id] = writer.parent_for(sweep_id) or writer.create_parent(
                sweep_id, run_name=f"sync-{sweep_id}")
        return parents[sweep_id]

    for row in rows:
        sweep_id = row.get("sweep_id") or "unknown"
        if row.get("backend") == SIMULATE:  # predictions go as one table per sweep
            tables.setdefault(sweep_id, []).append(row)
            continue
        result = row_to_result(row)
        run_id = writer.log_trial(result, parent(sweep_id), row["result_id"],
                                  trial_name(result, axes))
        if run_id is None:
            return logged, writer.error
        ledger.update(result.trial_id, mlflow_run_id=run_id)
        logged += 1
    for sweep_id, table in tables.items():
        run_id = parent(sweep_id)
        if run_id is not None and writer.has_predictions(run_id):  # the sweep logged it
            continue
        if run_id is None or not writer.log_predictions(run_id, table):
            return logged, writer.error
        ledger.update_many([r["trial_id"] for r in table], mlflow_run_id=run_id)
        logged += len(table)
    return logged, None
