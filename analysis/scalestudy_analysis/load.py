"""Load a study into one tidy DataFrame: one row per trial, columns in the TrialResult schema.

Sources: the Parquet ledger (the study's source of truth) or MLflow (`mlflow.search_runs`, one child
run per trial). Measured (backend=measure) and predicted (backend=simulate) trials sit in the same
frame, told apart by the `source` column, so every figure can overlay them.
"""

from __future__ import annotations

import json
import math
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from scalestudy import metrics as M
from scalestudy.metrics import TrialResult
from scalestudy.spec.trial import TRIAL_KEY, trial_key
from scalestudy.track.ledger import COMM_PREFIX, Ledger, ledger_path
from scalestudy.track.mlflow_writer import ROLE_TAG
from scalestudy.track.mlflow_writer import tracking_uri as _writer_uri

MEASURED = "measured"
PREDICTED = "predicted"
SOURCE_OF_BACKEND = {"measure": MEASURED, "simulate": PREDICTED}
LIST_COLUMNS = ("step_times_s", "losses")
DICT_COLUMNS = ("missing", "extra")
# The design point of a row, however it was obtained (measured or predicted): pairs a prediction
# with its measurement. One key for the ledger, the fit and the analysis (spec/trial.py).
CONFIG_KEYS = TRIAL_KEY
# Breakdown metrics the performance model may report, as TrialResult fields or inside `extra`;
# promoted to columns when present so the breakdown figure can use them.
OPTIONAL_METRICS = (M.COMPUTE_TIME_S, M.BUBBLE_TIME_S, M.NODE_OVERHEAD_POWER_W_ESTIMATED)


class StudyNotFound(LookupError):
    """Neither a ledger nor an MLflow experiment holds trials of this study."""

PROFILES_ATTR = "prediction_profiles"  # df.attrs: {hardware name: the profile its predictions came from}


def _field_kinds() -> dict[str, type]:
    """TrialResult field -> the Python type its values take (MLflow hands every param back as str)."""
    kinds: dict[str, type] = {}
    for name, info in TrialResult.model_fields.items():
        ann = info.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        base = args[0] if args and typing.get_origin(ann) is not list else ann
        kinds[name] = base if base in (int, float, bool, str) else object
    return kinds


FIELD_KINDS = _field_kinds()
FLOAT_FIELDS = tuple(n for n, k in FIELD_KINDS.items() if k is float)


def _cast(value: Any, kind: type) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if kind is bool:
        return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1")
    if kind is int:
        return int(float(value))
    if kind is float:
        return float(value)
    return str(value) if kind is str else value


def tidy(df: pd.DataFrame) -> pd.DataFrame:
    """Normalise dtypes and add the derived columns every figure relies on.

    Float metrics stay NaN when missing (never 0); `source` says measured or predicted; total power
    is per-device GPU power times devices, kept apart for measured (NVML) and modelled power; the
    node's non-GPU power is the separate modelled column node_overhead_power_w_estimated.
    """
    df = df.copy().reset_index(drop=True)
    for name in FLOAT_FIELDS:
        df[name] = pd.to_numeric(df[name], errors="coerce") if name in df else math.nan
    for col in [c for c in df.columns if c.startswith(COMM_PREFIX)]:
        df[col] = pd.to_numeric(df[col], errors="coerce")
    for name, kind in FIELD_KINDS.items():
        if kind is int and name in df and df[name].notna().all():
            df[name] = df[name].astype(int)
    for name in LIST_COLUMNS:
        df[name] = [list(v) if isinstance(v, (list, tuple)) or hasattr(v, "tolist") else []
                    for v in (df[name] if name in df else [None] * len(df))]
    for name in DICT_COLUMNS:
        vals = df[name] if name in df else [None] * len(df)
        df[name] = [json.loads(v) if isinstance(v, str) else (v if isinstance(v, dict) else {})
                    for v in vals]
    for name in OPTIONAL_METRICS:
        from_extra = [e.get(name) if isinstance(e.get(name), (int, float)) else None
                      for e in df["extra"]]
        if name not in df and any(v is not None for v in from_extra):
            df[name] = from_extra
        if name in df:
            df[name] = pd.to_numeric(df[name], errors="coerce")
    df["status"] = df["status"].map(lambda s: getattr(s, "value", s)).astype(str)
    df["source"] = df["backend"].map(lambda b: SOURCE_OF_BACKEND.get(str(b), str(b)))
    df["total_power_w"] = df[M.POWER_W] * df["world_size"]
    df[M.TOTAL_POWER_W_ESTIMATED] = df[M.POWER_W_ESTIMATED] * df["world_size"]
    # The model's own total (GPU-only, as power_w_estimated) where the result carries it.
    model_total = pd.to_numeric(pd.Series([e.get(M.TOTAL_POWER_W_ESTIMATED) for e in df["extra"]],
                                          index=df.index, dtype=object), errors="coerce")
    df[M.TOTAL_POWER_W_ESTIMATED] = model_total.fillna(df[M.TOTAL_POWER_W_ESTIMATED])
    return df


def results_frame(results: Iterable[TrialResult | dict[str, Any]]) -> pd.DataFrame:
    """TrialResult objects (or their ledger rows) -> the tidy frame."""
    from scalestudy.track.ledger import result_to_row

    rows = [result_to_row(r) if isinstance(r, TrialResult) else dict(r) for r in results]
    if not rows:
        return tidy(pd.DataFrame(columns=list(TrialResult.model_fields)))
    return tidy(pd.DataFrame(rows))


def load_ledger(path: str | Path) -> pd.DataFrame:
    rows = Ledger(path).rows()
    if not rows:
        raise StudyNotFound(f"no trials in {path}")
    return results_frame(rows)


def resolve_tracking_uri(uri: str | None = None) -> str:
    """The URI the sweep wrote to: the given one, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db."""
    return _writer_uri(uri)


def store_exists(uri: str) -> bool:
    """A local store that does not exist yet has no runs; checking first keeps a read-only command
    from creating an empty mlflow.db as a side effect."""
    for prefix in ("sqlite:///", "file://"):
        if uri.startswith(prefix):
            return Path(uri[len(prefix):]).exists()
    if "://" not in uri:  # a bare path is a file store
        return Path(uri).exists()
    return True


def trial_runs(experiment: str, tracking_uri: str | None = None) -> pd.DataFrame:
    """Raw `mlflow.search_runs` frame of the experiment's trial runs (empty when there are none)."""
    uri = resolve_tracking_uri(tracking_uri)
    if not store_exists(uri):
        return pd.DataFrame()
    import mlflow

    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        return pd.DataFrame()
    return mlflow.search_runs(
        experiment_names=[experiment],
        filter_string=f"tags.`{ROLE_TAG}` = 'trial'",
        order_by=["attributes.start_time DESC"],
        output_format="pandas",
    )


def _full_result(run_id: str, tracking_uri: str) -> dict[str, Any] | None:
    """The trial's own TrialResult (per-step lists included) from its trial_result.json artifact."""
    import mlflow

    try:
        text = mlflow.artifacts.load_text(f"runs:/{run_id}/trial_result.json")
        return TrialResult.model_validate_json(text)
    except Exception:  # noqa: BLE001 - an older run without the artifact keeps its params/metrics
        return None


def runs_to_rows(runs: pd.DataFrame) -> list[dict[str, Any]]:
    """One row per trial from MLflow's columns (params.*, metrics.*, tags.*), cast back to the
    TrialResult types. The newest run of a trial wins (runs arrive newest first)."""
    rows, seen = [], set()
    for rec in runs.to_dict("records"):
        row: dict[str, Any] = {}
        for col, value in rec.items():
            kind, _, name = col.partition(".")
            if kind == "params" and name in FIELD_KINDS:
                row[name] = _cast(value, FIELD_KINDS[name])
            elif kind == "metrics" and (name in FIELD_KINDS or name.startswith(COMM_PREFIX)):
                row[name] = _cast(value, float)
        for tag in ("status", "reason", "backend", "trial_id"):
            value = rec.get(f"tags.{tag}")
            if isinstance(value, str) and value:
                row[tag] = value
        row["mlflow_run_id"] = rec.get("run_id")
        if not row.get("trial_id") or row["trial_id"] in seen:
            continue
        seen.add(row["trial_id"])
        rows.append(row)
    return rows


def load_mlflow(study: str, tracking_uri: str | None = None, experiment: str | None = None,
                artifacts: bool = False) -> pd.DataFrame:
    """Trials of the study's MLflow experiment. Params and metrics come from one search_runs
    call; artifacts=True also reads each run's trial_result.json (per-step times and losses),
    one request per run."""
    uri = resolve_tracking_uri(tracking_uri)
    runs = trial_runs(experiment or study, uri)
    rows = runs_to_rows(runs) if len(runs) else []
    if not rows:
        raise StudyNotFound(f"no trial runs in MLflow experiment {experiment or study!r} ({uri})")
    if artifacts:
        from scalestudy.track.ledger import result_to_row

        for i, row in enumerate(rows):
            full = _full_result(row["mlflow_run_id"], uri)
            if full is not None:
                rows[i] = {**result_to_row(full), "mlflow_run_id": row["mlflow_run_id"]}
    return results_frame(rows)


def load_study(study: str | Iterable[str], *, source: str = "auto",
               results_root: str | Path = "results", tracking_uri: str | None = None,
               experiment: str | None = None, artifacts: bool = False) -> pd.DataFrame:
    """The tidy frame of one study (or several, concatenated: e.g. a measured study and the
    predicted study of the same grid). source: auto (ledger, else MLflow) | ledger | mlflow."""
    if not isinstance(study, str):
        frames = [load_study(s, source=source, results_root=results_root,
                             tracking_uri=tracking_uri) for s in study]
        return tidy(pd.concat(frames, ignore_index=True))
    path = ledger_path(study, results_root)
    if source in ("auto", "ledger") and Ledger(path).exists():
        return load_ledger(path)
    if source in ("auto", "mlflow"):
        try:
            return load_mlflow(study, tracking_uri, experiment, artifacts=artifacts)
        except StudyNotFound as err:
            where = f"no ledger at {path} and " if source == "auto" else ""
            raise StudyNotFound(f"{where}{err}") from None
    raise StudyNotFound(f"no ledger at {path}")


def completed(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == M.Status.completed.value]


def pair_predictions(df: pd.DataFrame, metric: str = M.TOKENS_PER_S_PER_DEVICE) -> pd.DataFrame:
    """Measured and predicted values of one metric for the same configuration, one row per pair,
    with the signed relative error of the prediction (predicted / measured - 1). Rows pair by
    trial_key, which reads a layout option missing from an older ledger (NaN) as its default."""
    done = completed(df)
    keys = [k for k in CONFIG_KEYS if k in done]
    done = done.assign(_key=[trial_key(r) for r in done[keys].to_dict("records")])
    # A configuration measured twice keeps its median, so one pair per point of the design space.
    meas = done[done["source"] == MEASURED]
    pred = done[done["source"] == PREDICTED]
    first = meas.groupby("_key", sort=False)[keys].first()
    pairs = pd.concat([first, meas.groupby("_key")[metric].median().rename("measured"),
                       pred.groupby("_key")[metric].median().rename("predicted")],
                      axis=1, join="inner").dropna(subset=["measured", "predicted"])
    pairs["rel_error"] = pairs["predicted"] / pairs["measured"] - 1.0
    return pairs.reset_index(drop=True)


def find_spec(study: str, roots: Iterable[str | Path] = ("experiments",)) -> Path | None:
    """The spec YAML whose `name` is the study (reports show it), or None."""
    import yaml

    for root in roots:
        for path in sorted(Path(root).rglob("*.y*ml")):
            try:
                data = yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(data, dict) and data.get("name") == study:
                return path
    return None
