"""`scalestudy calibrate` and `scalestudy fit`: the sub-commands that write hardware profiles.

Registered on the app in cli.py. A profile is a local YAML that a spec's `hardware:` names, so both
write under a local results root (default `<root>/calibrated-<hardware>.yaml` and
`<root>/<study>/fitted-<hardware>.yaml`), where `scalestudy report` finds the newest one.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from scalestudy.cli_common import DEFAULT_ROOT, JsonOpt, RootOpt, emit_json, fail, print_table, say
from scalestudy.errors import SpecError


def _profile_rows(profile) -> list[dict]:
    cal = profile.calibration
    return [{"figure": k, "value": v} for k, v in (
        *((f"peak_tflops.{p.value}", t) for p, t in profile.peak_tflops.items()),
        ("hbm_gbps", profile.hbm_gbps), ("nvlink_gbps_per_gpu", profile.nvlink_gbps_per_gpu),
        *((k, v) for k, v in cal.items() if not isinstance(v, list)))]


def _check_calibrate_args(hardware: str, network_only: bool, precision, across_nodes: int,
                          local: bool) -> None:
    from scalestudy.spec import catalog

    if hardware not in catalog.hardware_names() and not (network_only and Path(hardware).is_file()):
        fail(SpecError("--hardware", hardware, f"choose one of {', '.join(catalog.hardware_names())}"
                       " (a profile file only with --network-only)"))
    if network_only and not across_nodes:
        fail(SpecError("--network-only", True, "add --across-nodes N, or leave it out"))
    if precision and not set(precision) <= {"fp32", "bf16", "fp16"}:
        fail(SpecError("--precision", precision, "choose from fp32, bf16, fp16"))
    if across_nodes and (across_nodes < 2 or local):
        fail(SpecError("--across-nodes", across_nodes, "give 2 or more nodes of a Ray cluster "
                       "(without --local), or leave it out"))


def _default_out(results_root: str, name: str, option: str, sub: str = "") -> Path:
    from scalestudy.track.storage import require_local

    try:
        root = require_local(results_root, "--results-root", "profiles are local YAML files a "
                             "spec's `hardware:` names", f"pass {option} PATH")
    except SpecError as e:
        fail(e)
    return (root / sub if sub else root) / name


def calibrate(
    out_path: Annotated[Optional[Path], typer.Option(
        "--out", help="profile YAML to write (default: <results-root>/calibrated-<hardware>.yaml)")
    ] = None,
    hardware: Annotated[str, typer.Option(help="catalogue entry the profile starts from (with "
                                          "--network-only also a profile YAML)")] = "cpu-local",
    quick: Annotated[bool, typer.Option("--quick", help="fewer shapes and sizes (tests)")] = False,
    local: Annotated[bool, typer.Option("--local", help="no Ray: this process and one process per "
                                        "core (calibrate/local.py)")] = False,
    precision: Annotated[Optional[list[str]], typer.Option(
        "--precision", help="precision to benchmark, repeatable (default: what `auto` resolves to "
        "here, and fp32 too where that is bf16)")] = None,
    across_nodes: Annotated[int, typer.Option(
        "--across-nodes", help="then measure the network: collectives over N nodes of the Ray "
        "cluster, one device each (calibrate/across_nodes.py); 0: keep the profile's figure")] = 0,
    network_only: Annotated[bool, typer.Option(
        "--network-only", help="with --across-nodes: no device benchmarks, only the network, into "
        "the --hardware profile (e.g. results/gpu-check/profile.yaml)")] = False,
    results_root: RootOpt = DEFAULT_ROOT,
    json_: JsonOpt = False,
) -> None:
    """Microbenchmark this Ray cluster (or this machine, --local) into a hardware profile.

    GEMM, memory, per-op and per-step costs, collectives; with --across-nodes, the network between
    nodes. A spec's `hardware:` accepts the profile it writes."""
    _check_calibrate_args(hardware, network_only, precision, across_nodes, local)
    from scalestudy.calibrate import across_nodes as nodes
    from scalestudy.calibrate.gpu import NoCudaDevice
    from scalestudy.calibrate.reference_step import in_sample
    from scalestudy.perfmodel.fit_data import resolve_profile
    from scalestudy.spec import catalog

    if local:
        from scalestudy.calibrate.local import calibrate_local as run_calibration
    else:
        from scalestudy.calibrate.run import calibrate as run_calibration
    t0 = time.time()
    try:
        base = resolve_profile(hardware)
    except SpecError as e:
        fail(e)
    out_path = out_path or _default_out(results_root, f"calibrated-{base.name}.yaml", "--out")
    if across_nodes:  # before minutes of device benchmarks: are the nodes there?
        try:
            nodes.check_cluster(base, across_nodes)
        except nodes.TooFewNodes as e:
            fail(SpecError("--across-nodes", across_nodes, str(e)))
    try:
        profile = base if network_only else _run(run_calibration, local, base, quick, precision,
                                                 results_root)
    except (NotImplementedError, NoCudaDevice) as e:
        fail(SpecError("--hardware", hardware, str(e)))
    if across_nodes:
        profile = nodes.calibrate_across_nodes(profile, across_nodes, quick=quick,
                                               results_root=results_root)
        say(nodes.summary(profile))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    catalog.write_profile(profile, out_path)
    replay = [] if network_only else in_sample(profile)
    if json_:
        emit_json([{"profile": str(out_path), "hardware": profile.name,
                    "figures": {r["figure"]: r["value"] for r in _profile_rows(profile)},
                    "in_sample": [{"reference": r.name, "measured_s": r.measured_s,
                                   "predicted_s": r.predicted_s} for r in replay]}])
        return
    print_table(_profile_rows(profile), ["figure", "value"], title=f"calibrated {hardware}")
    _say_in_sample(replay)
    say(f"wrote {out_path} in {time.time() - t0:.0f} s; use it with --set hardware={out_path}")


def _say_in_sample(replay) -> None:
    """The reference steps as the new profile predicts them (in sample), and a warning for any it
    cannot reproduce: a factor stopped at the end of its range (a busy machine causes it), or one
    kept as a single value differs between the precisions."""
    if not replay:
        return
    say("in sample (the reference steps the factors were solved from): " + ", ".join(
        f"{r.name} {r.error:+.1%}" for r in replay))
    for r in replay:
        if not r.reproduced:
            say(f"warning: the profile predicts {r.name} at {r.predicted_s:.4g} s, measured "
                f"{r.measured_s:.4g} s ({r.error:+.0%}): a factor stopped at the end of its range "
                "(or differs between precisions), so predictions of such steps are off by as much; "
                "a benchmark may have run while the machine was busy: calibrate again on a quiet "
                "machine")


def _run(run_calibration, local: bool, base, quick: bool, precision, results_root: str):
    """The device calibration; through Ray, its Ray Train storage under the results root."""
    if local:  # no Ray, so no storage path
        return run_calibration(base, quick=quick, precisions=precision)
    return run_calibration(base, quick=quick, precisions=precision, results_root=results_root)


def fit(
    study: Annotated[str, typer.Argument(help="study name (its ledger under the results root)")],
    hardware: Annotated[Optional[str], typer.Option(
        help="profile to start from: catalogue name or YAML path (default: the trials' hardware)")] = None,
    out_path: Annotated[Optional[Path], typer.Option(
        "--out", help="fitted profile YAML (default: <results-root>/<study>/fitted-<hardware>.yaml)")
    ] = None,
    results_root: RootOpt = DEFAULT_ROOT,
    json_: JsonOpt = False,
) -> None:
    """Fit the performance model's efficiency parameters to a study's measured trials."""
    from scalestudy.perfmodel.fit import FitResult, held_out_predictions
    from scalestudy.perfmodel.fit import fit as run_fit
    from scalestudy.perfmodel.fit_data import measured_trials
    from scalestudy.spec.catalog import write_profile
    from scalestudy.track.ledger import Ledger, ledger_path

    path = ledger_path(study, results_root)
    # before the ledger is read: a URI root cannot take the profile (and needs no round trip)
    target = out_path or _default_out(results_root, "fitted.yaml", "--out",
                                      study)
    try:
        results = Ledger(path).results()
        if not results:
            raise SpecError("STUDY", study, f"no ledger at {path}; run `scalestudy sweep` first")
        cfgs, measured, results, hw = measured_trials(results, hardware)
    except SpecError as e:
        fail(e)
    if out_path is None:
        target = target.with_name(f"fitted-{hw.name}.yaml")
    res = run_fit(cfgs, measured, hw)
    held, split = (held_out_predictions(cfgs, measured, hw) if len(cfgs) > 1
                   else ([math.nan] * len(cfgs), "none: one trial"))
    rows = _fit_rows(results, measured, res, held)
    mape = {"before": FitResult.mape(res.predicted_before, measured),
            "in_sample": FitResult.mape(res.predicted_after, measured),
            "out_of_sample": FitResult.mape(held, measured)}
    target.parent.mkdir(parents=True, exist_ok=True)
    write_profile(res.profile, target)
    if json_:
        emit_json([*rows, {"mape": mape, "split": split, "profile": str(target),
                           "fitted": {n: getattr(res.after, n) for n in res.names}}])
        return
    print_table(rows, list(rows[0]), title=f"{study}: tokens/s, measured vs model")
    say(f"MAPE before fitting {mape['before']:.1%}; in sample (fitted on all {len(cfgs)} trials) "
        f"{mape['in_sample']:.1%}; out of sample ({split}: each trial predicted by a fit without "
        f"it) {mape['out_of_sample']:.1%}; fitted "
        + ", ".join(f"{n}={getattr(res.after, n):.4g}" for n in res.names))
    say(f"wrote {target}")


def _fit_rows(results, measured, res, held) -> list[dict]:
    from scalestudy.spec.trial import name_axes_of, trial_name

    axes = name_axes_of(results)
    return [{"trial": trial_name(r, axes), "measured_tokens_per_s": m, "before": b,
             "err_before": b / m - 1, "fitted_in_sample": a, "err_in_sample": a / m - 1,
             "held_out": h, "err_out_of_sample": h / m - 1}
            for r, m, b, a, h in zip(results, measured, res.predicted_before,
                                     res.predicted_after, held)]
