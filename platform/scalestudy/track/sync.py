"""Upload ledger rows that are missing from an MLflow store (after it was down, or to a new one).

Rows are matched by result id (a tag on every child run), so running it twice logs nothing twice.
"""

from __future__ import annotations

from pathlib import Path

from scalestudy.spec.trial import name_axes_of, trial_name
from scalestudy.track.ledger import Ledger, ledger_path, row_to_result
from scalestudy.track.mlflow_writer import MlflowWriter


def sync_mlflow(study: str, uri: str, results_root: str | Path = "results") -> tuple[int, str | None]:
    """Returns (runs logged, error or None)."""
    ledger = Ledger(ledger_path(study, results_root))
    rows = ledger.rows()
    if not rows:
        return 0, None
    logged = 0
    by_experiment: dict[str, list[dict]] = {}
    for row in rows:
        by_experiment.setdefault(row.get("experiment") or study, []).append(row)
    # Names show every axis the study swept, as the sweep named them (its spec is not stored).
    axes = name_axes_of(rows)
    for experiment, exp_rows in by_experiment.items():
        writer = MlflowWriter(uri, experiment)
        present = writer.logged_result_ids()
        if present is None:
            return logged, writer.error
        parents: dict[str, str | None] = {}
        for row in exp_rows:
            if row.get("result_id") in present:
                continue
            sweep_id = row.get("sweep_id") or "unknown"
            if sweep_id not in parents:
                parents[sweep_id] = writer.parent_for(sweep_id) or writer.create_parent(
                    sweep_id, run_name=f"sync-{sweep_id}"
                )
            result = row_to_result(row)
            run_id = writer.log_trial(result, parents[sweep_id], row["result_id"],
                                      trial_name(result, axes))
            if run_id is None:
                return logged, writer.error
            ledger.update(result.trial_id, mlflow_run_id=run_id)
            logged += 1
    return logged, None
