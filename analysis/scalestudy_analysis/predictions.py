"""Predicted twins of measured trials, from the performance model (pure Python, seconds).

A measured study becomes comparable with the model without a second sweep: each measured trial's
configuration is rebuilt from its row (catalogue model and hardware) and predicted, so the parity
figure scores the model on exactly the configurations that were measured.
"""

from __future__ import annotations

import pandas as pd

from scalestudy.metrics import TrialResult
from scalestudy_analysis.load import MEASURED, PREDICTED, results_frame, tidy


def config_of(row: dict):
    """The TrialConfig of a ledger/MLflow row; None when its model or hardware is not in the
    catalogue (a custom profile cannot be rebuilt from its name)."""
    from scalestudy.spec import catalog
    from scalestudy.spec.study import Steps, TrialConfig

    if row["model"] not in catalog.model_names() or row["hardware"] not in catalog.hardware_names():
        return None
    fields = {k: row[k] for k in TrialConfig.model_fields
              if k in row and k not in ("steps", "model_dims", "hardware_profile")}
    fields["steps"] = Steps(warmup=int(row["steps_warmup"]), measure=int(row["steps_measure"]),
                            profile=int(row["steps_profile"]))
    fields["model_dims"] = catalog.get_model(row["model"])
    fields["hardware_profile"] = catalog.get_hardware(row["hardware"])
    return TrialConfig(**fields)


def predicted_twins(df: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """(predicted rows for the measured configurations that have none yet, note). The note says
    what was done or why nothing was (no model, no rebuildable configuration)."""
    from scalestudy.spec.study import Backend

    try:
        from scalestudy.perfmodel.predict import predict
    except ImportError as err:
        return df.iloc[0:0], f"no performance model to compare with ({err})"
    have = set()
    if (df["source"] == PREDICTED).any():
        keys = ["model", "hardware", "world_size", "tp", "pp", "zero_stage", "micro_batch",
                "seq_len", "precision"]
        have = {tuple(r) for r in df[df["source"] == PREDICTED][keys].itertuples(index=False)}
    out: list[TrialResult] = []
    skipped = 0
    for row in df[df["source"] == MEASURED].to_dict("records"):
        key = tuple(row[k] for k in ("model", "hardware", "world_size", "tp", "pp", "zero_stage",
                                     "micro_batch", "seq_len", "precision"))
        if key in have:
            continue
        try:
            cfg = config_of(row)
        except Exception:  # noqa: BLE001 - a row from an older schema: compare what we can
            cfg = None
        if cfg is None:
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
