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
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.trial import config_from_row, trial_key
from scalestudy_analysis.load import MEASURED, PREDICTED, PROFILES_ATTR, results_frame, tidy


def is_calibrated(hw: HardwareProfile) -> bool:
    """Whether `scalestudy calibrate` measured this profile (its GEMM curve is measured, never typed)."""
    return any(k.startswith("gemm_tflops_") for k in hw.calibration)


def profile_label(hw: HardwareProfile) -> str:
    if is_calibrated(hw):
        return f"{hw.name}, calibrated ({hw.description.rsplit('(calibrated', 1)[-1].strip(' )')})"
    return f"{hw.name}, UNCALIBRATED catalogue figures"


def predicted_twins(df: pd.DataFrame, profile: HardwareProfile | None = None
                    ) -> tuple[pd.DataFrame, str | None, dict[str, str]]:
    """(predicted rows for the measured configurations that have none yet, note, {hardware: label of
    the profile that predicted it}). Rows of `profile`'s hardware name are predicted with `profile`
    (a calibrated one: `scalestudy report --profile`), others with the catalogue's. The note says
    what was done or why nothing was (no model, no rebuildable configuration)."""
    from scalestudy.spec.trial import Backend

    try:
        from scalestudy.perfmodel.params import params_for
        from scalestudy.perfmodel.predict import predict
    except ImportError as err:
        return df.iloc[0:0], f"no performance model to compare with ({err})", {}
    have = {trial_key(r) for r in df[df["source"] == PREDICTED].to_dict("records")}
    out: list[TrialResult] = []
    used: dict[str, str] = {}
    skipped = 0
    for row in df[df["source"] == MEASURED].to_dict("records"):
        key = trial_key(row)
        if key in have:
            continue
        try:
            cfg = config_from_row(row, profile if profile and row["hardware"] == profile.name
                                  else None)
        except (SpecError, ValueError):  # outside the catalogue, or a row of an older schema
            skipped += 1
            continue
        # Priced as the measured trial ran: AutoTP, as parallelism.py prices the measure backend.
        autotp = params_for(cfg.hardware_profile, tp_all_reduce_per_linear=True)
        out.append(predict(cfg.model_copy(update={"backend": Backend.simulate}), params=autotp))
        used[cfg.hardware] = profile_label(cfg.hardware_profile)
        have.add(key)
    if not out:
        return df.iloc[0:0], None, used
    note = (f"{len(out)} predicted rows were computed now by the performance model for the "
            "measured configurations (they are not in the ledger)")
    note += " with " + "; ".join(used.values())
    if skipped:
        note += f"; {skipped} measured rows have a model or hardware outside the catalogue"
    return results_frame(out), note, used


def with_predictions(df: pd.DataFrame, profile: HardwareProfile | None = None
                     ) -> tuple[pd.DataFrame, str | None]:
    """df and the predicted twins of its measured rows; df.attrs[PROFILES_ATTR] names the profile
    each hardware's predictions came from (the parity figure's title shows it)."""
    twins, note, used = predicted_twins(df, profile)
    if twins.empty:
        return df, note
    out = tidy(pd.concat([df, twins], ignore_index=True))
    out.attrs[PROFILES_ATTR] = used
    return out, note
