"""The `scalestudy` command: thin sub-commands that parse, call and print.

Exit codes: 0 success; 1 the work ran but did not succeed (`run`: the trial did not complete;
`sweep`: no trial completed; `sync-mlflow`: MLflow stopped); 2 bad input (one line: field, value,
fix), before any worker starts.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from scalestudy import __version__
from scalestudy import metrics as M
from scalestudy.cli_common import (DEFAULT_ROOT, ColumnsOpt, JsonOpt, RootOpt, SetOpt, SortOpt,
                                   SpecArg, TopOpt, TrackingOpt, emit_json, fail, note,
                                   print_table, say)
from scalestudy.cli_plan import plan
from scalestudy.cli_tools import calibrate, fit
from scalestudy.errors import SpecError

app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Measure, then model, how large-model training scales (Ray Train x "
                       "DeepSpeed x MLflow, and a performance model).")


def _version(value: bool) -> None:
    if value:
        say(f"scalestudy {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="print the version and exit")] = False
          ) -> None:
    """Measure, then model, how large-model training scales."""


def _load_plan(spec: Path, set_: list[str] | None):
    from scalestudy.plan import plan_study
    from scalestudy.spec.load import load_spec

    try:
        study = load_spec(spec, set_)
        return study, plan_study(study)
    except SpecError as e:
        fail(e)


VALIDATE_COLUMNS = ["trial", "model", "hardware", "world_size", "dp", "tp", "pp", "zero_stage",
                    "micro_batch", "grad_accum", "global_batch", "seq_len", "precision",
                    "tokens_per_step", "nodes", "memory_gib", "usable_gib", "verdict"]


@app.command()
def validate(spec: SpecArg, set_: SetOpt = None, json_: JsonOpt = False, sort: SortOpt = None,
             top: TopOpt = None, columns: ColumnsOpt = None) -> None:
    """Check a spec: every trial with its layout, memory estimate per device and verdict."""
    study, entries = _load_plan(spec, set_)
    if json_:
        emit_json(e.as_row() for e in entries)
        return
    rows = []
    for e in entries:
        row = {**e.axes, **e.config.config_fields(), "trial": e.config.run_name,
               "tokens_per_step": e.config.tokens_per_step,
               "verdict": "ok" if e.feasible else f"{e.reason_class.value}: {e.reason}"}
        if e.memory is not None:
            row.update(memory_gib=e.memory.total_gib, usable_gib=e.memory.usable_gib)
        rows.append(row)
    n_ok = sum(e.feasible for e in entries)
    print_table(rows, VALIDATE_COLUMNS, sort=sort, top=top, chosen=columns,
                title=f"{spec}: {len(entries)} trials ({n_ok} runnable, {len(entries) - n_ok} "
                      "infeasible); memory per device by the plan's rule")


RESULT_COLUMNS = ["trial", "status", "world_size", "dp", "tp", "pp", "zero_stage", "micro_batch",
                  M.STEP_TIME_S, M.TOKENS_PER_S, M.TOKENS_PER_S_PER_DEVICE, M.MFU,
                  M.PEAK_MEMORY_GIB, M.LOSS_FIRST, M.LOSS_LAST, "reason"]


def result_rows(results, name_axes: tuple[str, ...] = ()) -> list[dict]:
    from scalestudy.spec.trial import trial_name

    return [{**r.model_dump(), "trial": trial_name(r, name_axes), "status": r.status.value}
            for r in results]


@app.command()
def run(
    spec: SpecArg,
    set_: SetOpt = None,
    json_: JsonOpt = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="show Ray's and the workers' output")] = False,
    results_root: RootOpt = DEFAULT_ROOT,
) -> None:
    """Run exactly one trial for real (Ray Train x DeepSpeed) and print its result."""
    t0 = time.time()
    study, entries = _load_plan(spec, set_)
    if len(entries) != 1:
        fail(SpecError("spec", f"{len(entries)} trials",
                       "`run` takes exactly one trial; pick one with --set, e.g. "
                       "--set world_size=2 --set zero_stage=3 (or use `scalestudy sweep`)"))
    (entry,) = entries
    cfg = entry.config
    from scalestudy.launch.ray_train import ensure_ray, fixed_local_resources, run_trial, unplaceable
    from scalestudy.sweep.shared_storage import check_checkpoint_storage
    from scalestudy.track.storage import join, ray_storage
    from scalestudy.train.resume import wants_checkpoints

    ensure_ray(verbose=verbose)
    try:
        check_checkpoint_storage(results_root, wants_checkpoints(cfg))
    except SpecError as e:
        fail(e)
    result = unplaceable(cfg, fixed_local_resources(), t0)  # never placeable on this Ray
    if result is None:
        result = run_trial(cfg, t0=t0, **ray_storage(join(results_root, cfg.study, "ray")))
    if json_:
        emit_json([result])
    else:
        print_table(result_rows([result]), RESULT_COLUMNS, title=cfg.study)
    if result.status.value != "completed":
        raise typer.Exit(1)


@app.command()
def sweep(
    spec: SpecArg,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="skip trials already in the ledger")] = False,
    max_concurrent: Annotated[Optional[int], typer.Option("--max-concurrent", min=1,
                              help="trials at once (default: what the cluster's devices hold)")] = None,
    json_: JsonOpt = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="show Ray's and Tune's output")] = False,
    results_root: RootOpt = DEFAULT_ROOT,
    tracking_uri: TrackingOpt = None,
    sort: SortOpt = None, top: TopOpt = None, columns: ColumnsOpt = None,
) -> None:
    """Run every trial of a study into the ledger and MLflow (exit 1 if none completed).

    The measure backend runs Ray Tune x Ray Train x DeepSpeed trials; the simulate backend the
    performance model."""
    from scalestudy.sweep.driver import run_sweep, sorted_for_table

    from scalestudy.sweep.tracking import resolve_tracking_uri

    study, entries = _load_plan(spec, set_)
    try:  # fixed once, absolute, and written into the spec the sweep records
        uri = resolve_tracking_uri(tracking_uri or study.tracking.mlflow_uri)
    except SpecError as e:
        fail(e)
    study = study.model_copy(update={"tracking": study.tracking.model_copy(
        update={"mlflow_uri": uri})})
    try:
        outcome = run_sweep(study, entries, spec.read_text(), resume=resume,
                            max_concurrent=max_concurrent, results_root=results_root,
                            show_progress=not json_, verbose=verbose)
    except SpecError as e:  # a results root the cluster's nodes cannot share, before any trial
        fail(e)
    if json_:
        emit_json(outcome.results)
    else:
        _sweep_summary(study, outcome, sorted_for_table(outcome.results), sort, top, columns)
    ran = [r for r in outcome.results if r.status is not M.Status.infeasible]
    if ran and not any(r.status is M.Status.completed for r in ran):
        raise typer.Exit(1)


def _sweep_summary(study, outcome, results, sort, top, columns) -> None:
    print_table(result_rows(results, study.name_axes), RESULT_COLUMNS, sort=sort, top=top,
                chosen=columns, title=f"{study.name}: {len(results)} trials recorded, "
                                      f"{outcome.skipped} skipped (already in the ledger)")
    say(f"ledger: {outcome.ledger}")
    if outcome.mlflow_error:
        say(f"MLflow: {outcome.mlflow_error}; upload later with "
            f"`scalestudy sync-mlflow {study.name}`")
    else:
        say(f"review: mlflow ui --backend-store-uri {outcome.mlflow_uri} --host 127.0.0.1")
    say(f"sweep wall time: {outcome.wall_time_s:.1f} s")


@app.command("sync-mlflow")
def sync_mlflow_cmd(
    study: Annotated[str, typer.Argument(help="study name (its ledger under the results root)")],
    tracking_uri: TrackingOpt = None,
    results_root: RootOpt = DEFAULT_ROOT,
    json_: JsonOpt = False,
) -> None:
    """Log ledger rows that are missing from MLflow (exit 1 if MLflow stopped)."""
    from scalestudy.track.ledger import Ledger, ledger_path
    from scalestudy.track.mlflow_writer import tracking_uri as resolve_uri
    from scalestudy.track.sync import sync_mlflow

    path = ledger_path(study, results_root)
    if not Ledger(path).exists():
        fail(SpecError("study", study, f"no ledger at {path}; run `scalestudy sweep` first"))
    logged, error = sync_mlflow(study, resolve_uri(tracking_uri), results_root=results_root)
    if json_:
        emit_json([{"study": study, "logged": logged, "error": error}])
    else:
        say(f"logged {logged} rows to MLflow" + (f"; stopped: {error}" if error else ""))
    if error:
        raise typer.Exit(1)


@app.command()
def report(
    study: Annotated[str, typer.Argument(help="study name (its ledger, else its MLflow experiment)")],
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="default: reports/<study>/")] = None,
    tracking_uri: TrackingOpt = None,
    results_root: RootOpt = DEFAULT_ROOT,
    profile: Annotated[Optional[Path], typer.Option(
        "--profile", help="hardware profile YAML that predicts the measured trials of its hardware "
        "(default: the newest calibrated profile of that hardware under the results root)")] = None,
    json_: JsonOpt = False,
) -> None:
    """Write figures and a self-contained HTML report of a study; print the report's path."""
    from scalestudy.spec.catalog import profile_from_file
    from scalestudy_analysis.load import StudyNotFound
    from scalestudy_analysis.report import report_study

    if profile and not profile.is_file():
        fail(SpecError("--profile", str(profile), "no such file; write one with `scalestudy calibrate`"))
    try:
        hw = profile_from_file(profile, "--profile") if profile else None
        rep = report_study(study, out_dir, tracking_uri=tracking_uri, results_root=results_root,
                           profile=hw)
    except StudyNotFound as e:
        fail(SpecError("study", study, f"{e}; run `scalestudy sweep` on its spec first"))
    except SpecError as e:
        fail(e)
    if json_:
        emit_json([{"study": study, "report": str(rep.path), "notes": list(rep.notes)}])
        return
    for text in rep.notes:
        note(text)
    say(str(rep.path))


PREDICT_COLUMNS = ["trial", "status", "model", "hardware", "world_size", "dp", "tp", "pp",
                   "zero_stage", "micro_batch", "grad_accum", M.STEP_TIME_S,
                   M.TOKENS_PER_S_PER_DEVICE, M.MFU, M.COMM_EXPOSED_FRACTION, M.PEAK_MEMORY_GIB,
                   M.POWER_W_ESTIMATED, M.ENERGY_PER_TOKEN_J_ESTIMATED, "reason"]


@app.command()
def predict(spec: SpecArg, set_: SetOpt = None, json_: JsonOpt = False, sort: SortOpt = None,
            top: TopOpt = None, columns: ColumnsOpt = None) -> None:
    """Predict every trial of a spec with the performance model (any backend, any scale)."""
    from scalestudy.perfmodel import coverage
    from scalestudy.perfmodel.predict import predict_many
    from scalestudy.spec.trial import trial_name

    study, entries = _load_plan(spec, set_)
    results = predict_many(entries)
    if json_:
        emit_json(results)
        return
    rows = [{**r.model_dump(), "trial": trial_name(r, study.name_axes), "status": r.status.value}
            for r in results]
    print_table(rows, PREDICT_COLUMNS, title=f"{spec} (predicted)", sort=sort, top=top,
                chosen=columns)
    leans = coverage.summary([r.uncalibrated for r in results])
    if leans:  # each row's own list: --json, the ledger's `uncalibrated` column
        note(leans)


# The commands that write hardware profiles live in cli_tools.py (this module's length).
app.command()(calibrate)
app.command()(fit)
app.command()(plan)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
