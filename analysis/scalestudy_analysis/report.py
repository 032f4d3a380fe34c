"""`report_study`: a study -> report.html + one PNG per figure, logged to the study's MLflow run.

`write_report` does the same for any tidy frame (a notebook's own selection of trials).
"""

from __future__ import annotations

import json
import platform as _stdlib_platform  # the stdlib module; our `platform/` dir is no package
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pandas as pd

from scalestudy.spec.catalog import HardwareProfile
from scalestudy.track.mlflow_writer import ROLE_TAG
from scalestudy_analysis.base import CHOSEN_ATTR
from scalestudy_analysis.figures_plan import PLAN_ATTR, PLAN_FILE
from scalestudy_analysis.figures import Panel, draw_all, save_pngs
from scalestudy_analysis.host import host_hardware
from scalestudy_analysis.html import render
from scalestudy_analysis.load import (
    MEASURED,
    StudyNotFound,
    find_spec,
    load_study,
    resolve_tracking_uri,
    store_exists,
)
from scalestudy_analysis.peaks import one_peak, peak_notes
from scalestudy_analysis.profiles import ChosenProfile, catalogue_choice, choose_profiles

REPORT_FILE = "report.html"
ARTIFACT_DIR = "report"
PACKAGES = ("scalestudy", "pandas", "numpy", "pyarrow", "matplotlib", "mlflow", "pydantic",
            "torch", "ray", "deepspeed", "transformers")


@dataclass
class Report:
    path: Path  # report.html
    pngs: list[Path]
    panels: list[Panel]
    mlflow_run_id: str | None = None  # the parent run the report was logged to
    notes: list[str] = field(default_factory=list)
    frame: pd.DataFrame | None = field(default=None, repr=False)  # what the figures drew
    profiles: dict[str, ChosenProfile] = field(default_factory=dict)  # per hardware name

    @property
    def figures_drawn(self) -> int:
        return sum(p.drawn for p in self.panels)


def software_versions() -> dict[str, str]:
    """Installed versions, read from package metadata so torch and ray are never imported here."""
    out = {"python": sys.version.split()[0], "os": _stdlib_platform.platform()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def write_report(df: pd.DataFrame, out_dir: str | Path, study: str, *,
                 spec_text: str | None = None, spec_source: str | None = None,
                 data_source: str = "a DataFrame", notes: list[str] | None = None,
                 profiles: Mapping[str, ChosenProfile] | None = None,
                 plan: dict | None = None) -> Report:
    """report.html and the PNGs of df. Every MFU and HFU is recomputed against one peak per
    hardware and precision: that of `profiles` (what report_study chose), else the catalogue's.
    `plan`: the record of the `scalestudy plan` that measured the study, for its figure."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chosen = dict(profiles or {})
    for name in sorted(set(df["hardware"].dropna().astype(str)) - set(chosen)):
        chosen[name] = catalogue_choice(name)
    df = one_peak(df, chosen)
    df.attrs[CHOSEN_ATTR] = chosen
    if plan:
        df.attrs[PLAN_ATTR] = plan
    panels = draw_all(df)
    pngs = save_pngs(panels, out)
    text = render(study, df, panels, spec_text=spec_text, spec_source=spec_source,
                  versions=software_versions(), data_source=data_source, notes=notes or [],
                  hardware=host_hardware(), peaks=peak_notes(df))
    path = out / REPORT_FILE
    path.write_text(text, encoding="utf-8")
    return Report(path=path, pngs=pngs, panels=panels, notes=list(notes or []), frame=df,
                  profiles=chosen)


def plan_record(study: str, results_root: str | Path) -> dict | None:
    """The record `scalestudy plan` left beside the study's ledger, None when no plan measured it."""
    from scalestudy.track import storage

    location = storage.join(results_root, study, PLAN_FILE)
    if not storage.exists(location):
        return None
    return json.loads(storage.read_bytes(location))


def _spec_of(study: str, spec_path: str | Path | None):
    """(spec text, where it came from, experiment name, tracking URI) for the study, as far as a
    spec YAML on disk tells; the spec may name its own MLflow experiment and store."""
    path = Path(spec_path) if spec_path else find_spec(study)
    if path is None or not path.is_file():
        return None, None, None, None
    text = path.read_text()
    experiment = uri = None
    try:
        from scalestudy.spec.load import load_spec

        spec = load_spec(path)
        experiment, uri = spec.experiment, spec.tracking.mlflow_uri
    except Exception:  # noqa: BLE001 - an outdated spec still belongs in the report as text
        pass
    return text, str(path), experiment, uri


def recorded_experiment(df: pd.DataFrame) -> str | None:
    """The MLflow experiment the study's trials were logged under, as the ledger recorded it (the
    newest, if the study moved): what finds the parent run when no spec on disk names the
    experiment, e.g. a report written away from the repo of a study whose experiment is not its
    name (experiments/paper/*.yaml log to paper-<study>)."""
    if "experiment" not in df:
        return None
    rows = df[df["experiment"].notna() & (df["experiment"].astype(str) != "")]
    if rows.empty:
        return None
    if "recorded_at" in rows:
        rows = rows.sort_values("recorded_at", kind="stable")
    return str(rows["experiment"].iloc[-1])


def latest_sweep_run(experiment: str, tracking_uri: str) -> str | None:
    """Run id of the experiment's newest parent run (tag scalestudy.role=sweep), or None."""
    if not store_exists(tracking_uri):
        return None
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        return None
    runs = mlflow.search_runs(
        experiment_names=[experiment], filter_string=f"tags.`{ROLE_TAG}` = 'sweep'",
        order_by=["attributes.start_time DESC"], max_results=1, output_format="pandas")
    return None if runs.empty else str(runs["run_id"].iloc[0])


def logged_spec(run_id: str) -> str | None:
    """The spec.yaml the sweep logged on its parent run (the spec as it was run)."""
    import mlflow

    try:
        return mlflow.artifacts.load_text(f"runs:/{run_id}/spec.yaml")
    except Exception:  # noqa: BLE001 - older parent runs have no spec artifact
        return None


def log_report(report: Report, run_id: str, tracking_uri: str) -> None:
    """Attach report.html and the PNGs to the parent run under `report/`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    for path in [report.path, *report.pngs]:
        client.log_artifact(run_id, str(path), artifact_path=ARTIFACT_DIR)


def report_study(study: str, out_dir: str | Path | None = None, *,
                 results_root: str | Path = "results", tracking_uri: str | None = None,
                 spec_path: str | Path | None = None, source: str = "auto",
                 predictions: bool = True, log_to_mlflow: bool = True,
                 profile: HardwareProfile | None = None) -> Report:
    """Load the study (ledger, else MLflow), write report.html and one PNG per figure to out_dir
    (default reports/<study>/) and log them to the study's latest parent MLflow run, if any.

    predictions: add the performance model's prediction of every measured configuration the
    study has no prediction for (computed now, marked as such), so the parity figure has data.
    The profile of each hardware (it predicts, and its peak is every MFU's): `profile` for the
    trials of its name (`--profile`), else the newest calibrated or fitted profile of that name
    under results_root (profiles.py), else the catalogue's; the report says which.
    Raises StudyNotFound when neither store has the study. MLflow trouble never loses the report:
    it becomes a note on the returned Report.
    """
    spec_text, spec_source, experiment, spec_uri = _spec_of(study, spec_path)
    uri = resolve_tracking_uri(tracking_uri or spec_uri)
    df = load_study(study, source=source, results_root=results_root, tracking_uri=uri,
                    experiment=experiment, artifacts=True)
    from scalestudy.track.ledger import Ledger, ledger_path

    ledger = ledger_path(study, results_root)
    from_ledger = source != "mlflow" and Ledger(ledger).exists()
    data_source = f"the ledger {ledger}" if from_ledger else f"MLflow ({uri})"
    notes: list[str] = []
    run_id = None
    experiment = experiment or recorded_experiment(df)
    try:
        run_id = latest_sweep_run(experiment or study, uri)
    except Exception as err:  # noqa: BLE001 - an unreachable store: report from the ledger alone
        notes.append(f"MLflow unavailable: {str(err).splitlines()[0]}")
    if spec_text is None and run_id is not None:
        spec_text = logged_spec(run_id)
        spec_source = f"spec.yaml of MLflow run {run_id}" if spec_text else None
    # Which profile predicts each hardware and sets its MFU peak: the one given, else the newest
    # calibrated one under the results root (what `make demo` writes), else the catalogue's.
    chosen = choose_profiles(set(df["hardware"].dropna().astype(str)), results_root, study,
                             given=profile)
    measured = set(df.loc[df["source"] == MEASURED, "hardware"].astype(str))
    notes.extend(c.sentence(results_root, predicts=predictions and h in measured)
                 for h, c in chosen.items())
    if predictions:
        from scalestudy_analysis.predictions import with_predictions

        df, note = with_predictions(
            df, {h: c.profile for h, c in chosen.items() if c.profile is not None},
            {h: c.label for h, c in chosen.items()})
        if note:
            notes.append(note)
    out = Path(out_dir) if out_dir else Path("reports") / study
    report = write_report(df, out, study, spec_text=spec_text, spec_source=spec_source,
                          data_source=data_source, notes=notes, profiles=chosen,
                          plan=plan_record(study, results_root))
    if log_to_mlflow and run_id is not None:
        try:
            log_report(report, run_id, uri)
            report.mlflow_run_id = run_id
        except Exception as err:  # noqa: BLE001 - the report on disk is what matters
            report.notes.append(f"MLflow logging failed: {str(err).splitlines()[0]}")
    elif log_to_mlflow:
        report.notes.append("no parent MLflow run of this study: report not logged")
    return report


__all__ = ["Report", "StudyNotFound", "report_study", "write_report", "software_versions",
           "latest_sweep_run", "log_report", "recorded_experiment"]
