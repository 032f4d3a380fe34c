"""Predicted twins of measured trials, from the performance model (pure Python, seconds).

A measured study becomes comparable with the model without a second sweep: each measured trial's
configuration is rebuilt from its row (spec/trial.py's config_from_row: catalogue model and
hardware) and predicted, so the parity figure scores the model on exactly the configurations that
were measured. Rows pair by the one trial-identity key, TRIAL_KEY.
"""

from __future__ import annotations

import pandas as pd

from scalestudy.errors import SpecError
from scalestudy.metrics import TrialResult
from scalestudy.spec.trial import config_from_row, trial_key
from scalestudy_analysis.load import MEASURED, PREDICTED, results_frame, tidy


def predicted_twins(df: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """(predicted rows for the measured configurations that have none yet, note). The note says
    what was done or why nothing was (no model, no rebuildable configuration)."""
    from scalestudy.spec.trial import Backend

    try:
        from scalestudy.perfmodel.predict import predict
    except ImportError as err:
        return df.iloc[0:0], f"no performance model to compare with ({err})"
    have = {trial_key(r) for r in df[df["source"] == PREDICTED].to_dict("records")}
    out: list[TrialResult] = []
    skipped = 0
    for row in df[df["source"] == MEASURED].to_dict("records"):
        key = trial_key(row)
        if key in have:
            continue
        try:
            cfg = config_from_row(row)
        except (SpecError, ValueError):  # outside the catalogue, or a row of an older schema
            skipped += 1
            continue
        out.append(predict(cfg.model_copy(update={"backend": Backend.simulate})))
        have.add(key)
    if not out:
        return df.iloc[0:0], None
    note = (f"{len(out)} predicted rows were computed now by the performance model for the "
            "measured configurations (they are not in the ledger)")
    if skipped:
        note += f"; {skipped} measured rows have a model or hardware outside the catalogue"
    return results_frame(out), note


def with_predictions(df: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    twins, note = predicted_twins(df)
    if twins.empty:
        return df, note
    return tidy(pd.concat([df, twins], ignore_index=True)), note
