"""Predicted twins of measured trials, from the performance model (pure Python, seconds).

A measured study becomes comparable with the model without a second sweep: each measured trial's
configuration is rebuilt from its row (spec/trial.py's config_from_row: catalogue model and
hardware) and predicted, so the parity figure scores the model on exactly the configurations that
were measured. Rows pair by the one trial-identity key, TRIAL_KEY.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from scalestudy.errors import SpecError
from scalestudy.metrics import TrialResult
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.trial import config_from_row, trial_key
from scalestudy_analysis.load import MEASURED, PREDICTED, PROFILES_ATTR, results_frame, tidy
from scalestudy_analysis.profiles import is_calibrated, measured_against

Profiles = HardwareProfile | Mapping[str, HardwareProfile] | None


def profile_label(hw: HardwareProfile) -> str:
    return f"{hw.name}, {measured_against(hw)}"


def _by_name(profile: Profiles) -> dict[str, HardwareProfile]:
    if profile is None:
        return {}
    if isinstance(profile, HardwareProfile):
        return {profile.name: profile}
    return {k: v for k, v in profile.items() if v is not None}


def predicted_twins(df: pd.DataFrame, profile: Profiles = None,
                    labels: Mapping[str, str] | None = None
                    ) -> tuple[pd.DataFrame, str | None, dict[str, str]]:
    """(predicted rows for the measured configurations that have none yet, note, {hardware: label of
    the profile that predicted it}). Rows of a hardware name `profile` covers (one profile, or a
    mapping hardware -> profile: a calibrated one from `scalestudy report --profile` or found under
    the results root) are predicted with it, others with the catalogue's; `labels` may name a
    hardware's profile (with its path). The note says what was done or why nothing was (no model,
    no rebuildable configuration)."""
    profiles, labels = _by_name(profile), dict(labels or {})
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
            cfg = config_from_row(row, profiles.get(row["hardware"]))
        except (SpecError, ValueError):  # outside the catalogue, or a row of an older schema
            skipped += 1
            continue
        # Priced as the measured trial ran: AutoTP, as parallelism.py prices the measure backend.
        autotp = params_for(cfg.hardware_profile, tp_all_reduce_per_linear=True)
        out.append(predict(cfg.model_copy(update={"backend": Backend.simulate}), params=autotp))
        used[cfg.hardware] = labels.get(cfg.hardware) or profile_label(cfg.hardware_profile)
        have.add(key)
    if not out:
        return df.iloc[0:0], None, used
    note = (f"{len(out)} predicted rows were computed now by the performance model for the "
            "measured configurations (they are not in the ledger)")
    note += " with " + "; ".join(used.values())
    if skipped:
        note += f"; {skipped} measured rows have a model or hardware outside the catalogue"
    from scalestudy.perfmodel.coverage import summary

    leans = summary([r.uncalibrated for r in out])
    if leans:  # what the comparison's predicted side took from outside the calibration
        note += f". {leans}"
    return results_frame(out), note, used


def with_predictions(df: pd.DataFrame, profile: Profiles = None,
                     labels: Mapping[str, str] | None = None) -> tuple[pd.DataFrame, str | None]:
    """df and the predicted twins of its measured rows; df.attrs[PROFILES_ATTR] names the profile
    each hardware's predictions came from (the parity figure's title shows it)."""
    twins, note, used = predicted_twins(df, profile, labels)
    if twins.empty:
        return df, note
    out = tidy(pd.concat([df, twins], ignore_index=True))
    out.attrs[PROFILES_ATTR] = used
    return out, note


__all__ = ["is_calibrated", "predicted_twins", "profile_label", "with_predictions"]
