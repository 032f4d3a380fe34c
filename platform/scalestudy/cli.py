"""The `scalestudy` command: thin sub-commands that parse, call and print."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from scalestudy import metrics as M
from scalestudy.spec.errors import SpecError
from scalestudy.track.storage import DEFAULT_RESULTS_ROOT, RESULTS_ROOT_ENV

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)
# Wide when piped (CI logs, `| less`): trial tables have many columns.
out = Console(width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True)

SpecArg = Annotated[Path, typer.Argument(help="study spec YAML", show_default=False)]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="override a spec key, KEY=VALUE (VALUE is YAML); repeatable"),
]
# One results root for every command that reads or writes results: a folder or a filesystem URI.
RootOpt = Annotated[str, typer.Option(
    "--results-root", envvar=RESULTS_ROOT_ENV,
    help="ledger and checkpoint root: a folder, or a URI (s3://bucket/prefix, gs://..., any "
         "pyarrow/fsspec filesystem); on a cluster, storage every node sees if trials checkpoint")]


def _fail(err: SpecError) -> None:
    err_console.print(f"error: {err}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _trial_table(rows: list[dict], columns: list[str], title: str | None = None) -> Table:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*(_fmt(r.get(c)) for c in columns))
    return table


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if v != v else f"{v:.4g}"
    return "" if v is None else str(v)


@app.command()
def validate(spec: SpecArg, set_: SetOpt = None) -> None:
    """Check a spec and list its trials with their derived values."""
    from scalestudy.spec.load import load_spec, plan

    try:
        planned = plan(load_spec(spec, set_))
    except SpecError as e:
        _fail(e)
    rows = []
    for p in planned:
        row = {**p.axes, "precision": p.config.precision.value}  # auto, as it resolved here
        if p.feasible:
            c = p.config
            row.update(trial=c.run_name, dp=c.dp, grad_accum=c.grad_accum,
                       global_batch=c.global_batch, tokens_per_step=c.tokens_per_step,
                       nodes=c.nodes, status="ok")
        else:
            row.update(trial="-", status=f"infeasible: {p.reason}")
        rows.append(row)
    n_ok = sum(1 for p in planned if p.feasible)
    out.print(f"{spec}: {len(planned)} trials ({n_ok} runnable, {len(planned) - n_ok} infeasible)")
    cols = ["trial", "model", "hardware", "world_size", "dp", "tp", "pp", "zero_stage",
            "micro_batch", "grad_accum", "global_batch", "seq_len", "precision",
            "tokens_per_step", "nodes", "status"]
    out.print(_trial_table(rows, cols))


RESULT_COLUMNS = ["trial", "status", "world_size", "dp", "tp", "zero_stage", "micro_batch",
                  M.STEP_TIME_S, M.TOKENS_PER_S, M.TOKENS_PER_S_PER_DEVICE, M.MFU,
                  M.PEAK_MEMORY_GIB, M.LOSS_FIRST, M.LOSS_LAST, "reason"]


def result_rows(results, name_axes: tuple[str, ...] = ()) -> list[dict]:
    from scalestudy.spec.trial import trial_name

    rows = []
    for r in results:
        row = r.model_dump()
        row["trial"] = trial_name(r, name_axes)
        row["status"] = r.status.value
        rows.append(row)
    return rows


@app.command()
def run(
    spec: SpecArg,
    set_: SetOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="print the TrialResult as JSON")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="show Ray's and the workers' output")] = False,
    results_root: RootOpt = DEFAULT_RESULTS_ROOT,
) -> None:
    """Run exactly one trial for real (Ray Train x DeepSpeed) and print its result."""
    t0 = time.time()
    from scalestudy.spec.load import load_spec, plan

    try:
        planned = plan(load_spec(spec, set_))
        if len(planned) != 1:
            raise SpecError(
                "spec", f"{len(planned)} trials",
                "`run` takes exactly one trial; pick one with --set, e.g. "
                "--set world_size=2 --set zero_stage=3 (or use `scalestudy sweep`)",
            )
    except SpecError as e:
        _fail(e)
    cfg = planned[0].config
    from scalestudy.sweep.shared_storage import check_checkpoint_storage
    from scalestudy.track.storage import join, ray_storage
    from scalestudy.train.launch import ensure_ray, fixed_local_resources, run_trial, unplaceable
    from scalestudy.train.resume import wants_checkpoints

    ensure_ray(verbose=verbose)
    try:
        check_checkpoint_storage(results_root, wants_checkpoints(cfg))
    except SpecError as e:
        _fail(e)
    result = unplaceable(cfg, fixed_local_resources(), t0)  # never placeable on this Ray
    if result is None:
        result = run_trial(cfg, t0=t0, **ray_storage(join(results_root, cfg.study, "ray")))
    if json_:
        sys.stdout.write(result.model_dump_json() + "\n")
    else:
        out.print(_trial_table(result_rows([result]), RESULT_COLUMNS, title=cfg.study))
    if result.status.value != "completed":
        raise typer.Exit(1)


@app.command()
def sweep(
    spec: SpecArg,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="skip trials already in the ledger")] = False,
    max_concurrent: Annotated[Optional[int], typer.Option("--max-concurrent", min=1,
                              help="trials at once (default: what the cluster's devices hold)")] = None,
    json_: Annotated[bool, typer.Option("--json", help="print one TrialResult JSON per line")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="show Ray's and Tune's output")] = False,
    results_root: RootOpt = DEFAULT_RESULTS_ROOT,
) -> None:
    """Run every trial of a study (Ray Tune x Ray Train x DeepSpeed, or the performance model)
    into the Parquet ledger and MLflow."""
    from scalestudy.spec.load import load_spec, plan
    from scalestudy.sweep.driver import run_sweep, sorted_for_table

    try:
        study = load_spec(spec, set_)
        planned = plan(study)
    except SpecError as e:
        _fail(e)
    try:
        outcome = run_sweep(study, planned, spec.read_text(), resume=resume,
                            max_concurrent=max_concurrent, results_root=results_root,
                            show_progress=not json_, verbose=verbose)
    except SpecError as e:  # a results root the cluster's nodes cannot share, before any trial
        _fail(e)
    if json_:
        for r in outcome.results:
            sys.stdout.write(r.model_dump_json() + "\n")
        return
    rows = result_rows(sorted_for_table(outcome.results), study.name_axes)
    out.print(_trial_table(rows, RESULT_COLUMNS, title=f"{study.name}: {len(rows)} trials run, "
                           f"{outcome.skipped} skipped (already in the ledger)"))
    out.print(f"ledger: {outcome.ledger}")
    if outcome.mlflow_error:
        out.print(f"MLflow: {outcome.mlflow_error}; upload later with "
                  f"`scalestudy sync-mlflow {study.name}`")
    else:
        out.print(f"review: mlflow ui --backend-store-uri {outcome.mlflow_uri} --host 127.0.0.1")
    out.print(f"sweep wall time: {outcome.wall_time_s:.1f} s")


@app.command("sync-mlflow")
def sync_mlflow_cmd(
    study: Annotated[str, typer.Argument(help="study name (results/<study>/trials.parquet)")],
    tracking_uri: Annotated[Optional[str], typer.Option("--tracking-uri",
                            help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")] = None,
    results_root: RootOpt = DEFAULT_RESULTS_ROOT,
) -> None:
    """Log ledger rows that are missing from MLflow."""
    from scalestudy.track.ledger import Ledger, ledger_path
    from scalestudy.track.mlflow_writer import tracking_uri as resolve_uri
    from scalestudy.track.sync import sync_mlflow

    path = ledger_path(study, results_root)
    if not Ledger(path).exists():
        _fail(SpecError("study", study, f"no ledger at {path}; run `scalestudy sweep` first"))
    logged, error = sync_mlflow(study, resolve_uri(tracking_uri), results_root=results_root)
    out.print(f"logged {logged} runs" + (f"; stopped: {error}" if error else ""))
    if error:
        raise typer.Exit(1)


@app.command()
def report(
    study: Annotated[str, typer.Argument(help="study name (its ledger, else its MLflow experiment)")],
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="default: reports/<study>/")] = None,
    tracking_uri: Annotated[Optional[str], typer.Option("--tracking-uri",
                            help="default: the spec's, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")] = None,
    results_root: RootOpt = DEFAULT_RESULTS_ROOT,
    profile: Annotated[Optional[Path], typer.Option(
        "--profile", help="hardware profile YAML (from `scalestudy calibrate`) that predicts the "
        "measured trials of its hardware name (default: the catalogue's)")] = None,
) -> None:
    """Figures + a self-contained HTML report of a study; prints the path of report.html."""
    from scalestudy.spec.catalog import load_hardware_file
    from scalestudy_analysis.load import StudyNotFound
    from scalestudy_analysis.report import report_study

    if profile and not profile.is_file():
        _fail(SpecError("--profile", str(profile), "no such file; write one with `scalestudy calibrate`"))
    try:
        hw = load_hardware_file(profile) if profile else None
        rep = report_study(study, out_dir, tracking_uri=tracking_uri, results_root=results_root,
                           profile=hw)
    except StudyNotFound as e:
        _fail(SpecError("study", study, f"{e}; run `scalestudy sweep` on its spec first"))
    for note in rep.notes:
        err_console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    sys.stdout.write(f"{rep.path}\n")


PREDICT_COLUMNS = ["trial", "status", "model", "hardware", "world_size", "dp", "tp", "pp",
                   "zero_stage", "micro_batch", "grad_accum", M.STEP_TIME_S,
                   M.TOKENS_PER_S_PER_DEVICE, M.MFU, M.COMM_EXPOSED_FRACTION, M.PEAK_MEMORY_GIB,
                   M.POWER_W_ESTIMATED, M.ENERGY_PER_TOKEN_J_ESTIMATED, "reason"]


@app.command()
def predict(
    spec: SpecArg,
    set_: SetOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="one TrialResult per line (JSON)")] = False,
) -> None:
    """Predict every trial of a spec with the performance model (any backend, any scale)."""
    from scalestudy.perfmodel.predict import predict_many
    from scalestudy.spec.load import load_spec, plan
    from scalestudy.spec.trial import trial_name

    try:
        planned = plan(load_spec(spec, set_))
    except SpecError as e:
        _fail(e)
    results = predict_many(planned)
    if json_:
        sys.stdout.write("".join(r.model_dump_json() + "\n" for r in results))
        return
    axes = planned[0].config.name_axes
    rows = [{**r.model_dump(), "trial": trial_name(r, axes), "status": r.status.value}
            for r in results]
    out.print(_trial_table(rows, PREDICT_COLUMNS, title=f"{spec} (predicted)"))


@app.command()
def calibrate(
    out_path: Annotated[Path, typer.Option("--out", help="profile YAML to write")] = Path(
        "calibrated-cpu-local.yaml"),
    hardware: Annotated[str, typer.Option(help="catalogue entry the profile starts from (with "
                                          "--network-only also a profile YAML)")] = "cpu-local",
    quick: Annotated[bool, typer.Option("--quick", help="fewer shapes and sizes (tests)")] = False,
    local: Annotated[bool, typer.Option("--local", help="no Ray: this process and one process per "
                                        "core (calibrate/local.py)")] = False,
    precision: Annotated[Optional[list[str]], typer.Option(
        "--precision", help="precision to benchmark, repeatable (default: what `auto` resolves to "
        "here, the one studies run at)")] = None,
    across_nodes: Annotated[int, typer.Option(
        "--across-nodes", help="then measure the network: collectives over N nodes of the Ray "
        "cluster, one device each (calibrate/across_nodes.py); 0: keep the profile's figure")] = 0,
    network_only: Annotated[bool, typer.Option(
        "--network-only", help="with --across-nodes: no device benchmarks, only the network, into "
        "the --hardware profile (e.g. results/gpu-check/profile.yaml)")] = False,
) -> None:
    """Microbenchmark this Ray cluster, or this machine with --local (GEMM, memory, per-op and
    per-step costs, collectives; with --across-nodes, the network between nodes) and write a
    hardware profile that a spec's `hardware:` accepts."""
    from scalestudy.perfmodel.fit_data import resolve_profile
    from scalestudy.spec import catalog

    if hardware not in catalog.hardware_names() and not (network_only and Path(hardware).is_file()):
        _fail(SpecError("--hardware", hardware, f"choose one of {', '.join(catalog.hardware_names())}"
                        " (a profile file only with --network-only)"))
    if network_only and not across_nodes:
        _fail(SpecError("--network-only", True, "add --across-nodes N, or leave it out"))
    if precision and not set(precision) <= {"fp32", "bf16", "fp16"}:
        _fail(SpecError("--precision", precision, "choose from fp32, bf16, fp16"))
    if across_nodes and (across_nodes < 2 or local):
        _fail(SpecError("--across-nodes", across_nodes, "give 2 or more nodes of a Ray cluster "
                        "(without --local), or leave it out"))
    if local:
        from scalestudy.calibrate.local import calibrate_local as run_calibration
    else:
        from scalestudy.calibrate.run import calibrate as run_calibration
    from scalestudy.calibrate import across_nodes as nodes
    from scalestudy.calibrate.gpu import NoCudaDevice

    t0 = time.time()
    base = resolve_profile(hardware)
    if across_nodes:  # before minutes of device benchmarks: are the nodes there?
        try:
            nodes.check_cluster(base, across_nodes)
        except nodes.TooFewNodes as e:
            _fail(SpecError("--across-nodes", across_nodes, str(e)))
    try:
        profile = base if network_only else run_calibration(base, quick=quick, precisions=precision)
    except (NotImplementedError, NoCudaDevice) as e:
        _fail(SpecError("--hardware", hardware, str(e)))
    if across_nodes:
        profile = nodes.calibrate_across_nodes(profile, across_nodes, quick=quick)
        out.print(nodes.summary(profile))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    catalog.write_profile(profile, out_path)
    cal = profile.calibration
    rows = [{"figure": k, "value": v} for k, v in (
        *((f"peak_tflops.{p.value}", t) for p, t in profile.peak_tflops.items()),
        ("hbm_gbps", profile.hbm_gbps), ("nvlink_gbps_per_gpu", profile.nvlink_gbps_per_gpu),
        *((k, v) for k, v in cal.items() if not isinstance(v, list)))]
    out.print(_trial_table(rows, ["figure", "value"], title=f"calibrated {hardware}"))
    out.print(f"wrote {out_path} in {time.time() - t0:.0f} s; use it with --set hardware={out_path}")


@app.command()
def fit(
    study: Annotated[str, typer.Argument(help="study name (reads results/<study>/trials.parquet)")],
    hardware: Annotated[Optional[str], typer.Option(
        help="profile to start from: catalogue name or YAML path (default: the trials' hardware)")] = None,
    out_path: Annotated[Optional[Path], typer.Option("--out", help="fitted profile YAML")] = None,
    results_root: RootOpt = DEFAULT_RESULTS_ROOT,
) -> None:
    """Fit the performance model's efficiency parameters to a study's measured trials."""
    from scalestudy.perfmodel.fit import FitResult
    from scalestudy.perfmodel.fit import fit as run_fit
    from scalestudy.perfmodel.fit import held_out_predictions
    from scalestudy.perfmodel.fit_data import measured_trials
    from scalestudy.spec.catalog import write_profile
    from scalestudy.spec.trial import name_axes_of, trial_name
    from scalestudy.track.ledger import Ledger, ledger_path
    from scalestudy.track.storage import require_local

    path = ledger_path(study, results_root)
    default_dir = None
    try:
        if out_path is None:  # the profile is a local YAML a spec's `hardware:` points at
            default_dir = require_local(results_root, "--results-root", "fit writes the fitted "
                                        "profile under a local results root", "pass --out PATH"
                                        ) / study
        results = Ledger(path).results()
        if not results:
            raise SpecError("STUDY", study, f"no ledger at {path}; run `scalestudy sweep` first")
        cfgs, measured, results, hw = measured_trials(results, hardware)
    except SpecError as e:
        _fail(e)
    res = run_fit(cfgs, measured, hw)
    held, split = (held_out_predictions(cfgs, measured, hw) if len(cfgs) > 1
                   else ([math.nan] * len(cfgs), "none: one trial"))
    axes = name_axes_of(results)
    rows = [{"trial": trial_name(r, axes), "measured_tokens_per_s": m, "before": b,
             "err_before": b / m - 1, "fitted_in_sample": a, "err_in_sample": a / m - 1,
             "held_out": h, "err_out_of_sample": h / m - 1}
            for r, m, b, a, h in zip(results, measured, res.predicted_before,
                                     res.predicted_after, held)]
    out.print(_trial_table(rows, list(rows[0]), title=f"{study}: tokens/s, measured vs model"))
    out.print(f"MAPE before fitting {FitResult.mape(res.predicted_before, measured):.1%}; "
              f"in sample (fitted on all {len(cfgs)} trials) "
              f"{FitResult.mape(res.predicted_after, measured):.1%}; out of sample ({split}: each "
              f"trial predicted by a fit without it) {FitResult.mape(held, measured):.1%}; fitted "
              + ", ".join(f"{n}={getattr(res.after, n):.4g}" for n in res.names))
    target = out_path or default_dir / f"fitted-{hw.name}.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    write_profile(res.profile, target)
    out.print(f"wrote {target}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
