"""`scalestudy plan` without `--dry-run`: the rounds of plan/rounds.py, measured in one Ray Tune
experiment whose searcher suggests each round's layouts (sweep/plan_search.py: warm worker groups,
the ledger and MLflow as any sweep records them), and the
answer: the recommended layout with its measured figures, the runner-up families, predicted against
measured for every measured layout, what the plan spent, and a plan.yaml that `scalestudy sweep`
runs as a study."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

import yaml

from scalestudy import metrics as M
from scalestudy.cli_common import emit_json, fail, print_table, say
from scalestudy.errors import SpecError
from scalestudy.plan.rounds import PLAN_RECORD, Batch, Measured, PlanBudget, PlanLoop, PlanOutcome
from scalestudy.plan.space import (PLAN_COLUMNS, PlanRequest, families_line, rank, space_spec,
                                   table_rows)
from scalestudy.plan.build import plan_spec
from scalestudy.spec.catalog import HardwareProfile, profile_yaml
from scalestudy.track import storage

# The config columns plan.yaml fixes: the space's axes and what its layouts share.
SPEC_AXES = ("seq_len", "precision", "world_size", "global_batch", "zero_stage", "tp", "pp",
             "micro_batch", "activation_checkpointing", "sequence_parallel", "cp",
             "gather_granularity")
MEASURED_COLUMNS = ["round", "window", "trial", "family", "zero_stage", "tp", "pp", "micro_batch",
                    "activation_checkpointing", "predicted", "predicted_now", "measured",
                    "error_now", M.PEAK_MEMORY_GIB, "status"]


def _settings(req: PlanRequest, measure_steps: int, uri: str) -> dict[str, Any]:
    return {"backend": "measure", "steps": {"warmup": 2, "measure": measure_steps, "profile": 0},
            "tracking": {"experiment": f"plan-{req.model}", "mlflow_uri": uri}}


def _announce(batch: Batch, reused: int) -> None:
    steps = f" for {batch.steps} timed steps" if batch.steps is not None else ""
    again = f" ({reused} already in the ledger)" if reused else ""
    say(f"round {batch.index}: measuring {len(batch.layouts)} layouts{steps}{again}: "
        + ", ".join(e.config.run_name for e in batch.entries))


def _measure(loop: PlanLoop, req: PlanRequest, profile: HardwareProfile,
             settings: dict[str, Any], results_root: str, show: bool) -> int:
    """Every round of `loop` in one Ray Tune experiment (sweep/plan_search.py's searcher) over the
    space's study: its warm groups, one ledger and one MLflow parent run for the whole plan. Returns
    how many results were taken from the ledger instead of run."""
    from scalestudy.sweep.driver import finished_rows, run_sweep
    from scalestudy.sweep.plan_search import PlanSearcher
    from scalestudy.track.ledger import Ledger, ledger_path, row_to_result

    spec = space_spec(req, profile, **settings)
    known = {r["trial_id"]: row_to_result(r)
             for r in finished_rows(Ledger(ledger_path(spec.name, results_root)))}
    # --json keeps stdout for the rows: the rounds are announced only to a reader
    searcher = PlanSearcher(loop, spec, known, announce=_announce if show else None)
    text = yaml.safe_dump({"plan": req.model_dump(mode="json"), "top_k": loop.top_k,
                           "rounds": loop.rounds, "budget": loop.budget.model_dump(),
                           "halving_steps": loop.halving_steps}, sort_keys=False)
    outcome = run_sweep(spec, plan_spec(spec), text, resume=True, results_root=results_root,
                        show_progress=show, search=searcher)
    if outcome.mlflow_error:
        print(f"MLflow: {outcome.mlflow_error}", file=sys.stdout if show else sys.stderr)
    return len(searcher.reused)


def measure_plan(req: PlanRequest, profile: HardwareProfile, hardware: str, *, top_k: int,
                 rounds: int, budget: PlanBudget, measure_steps: int, halving_steps: int | None,
                 scale_to: int | None, results_root: str, tracking_uri: str | None,
                 json_: bool) -> None:
    from scalestudy.sweep.tracking import resolve_tracking_uri

    t0 = time.time()
    try:
        uri = resolve_tracking_uri(tracking_uri)
        settings = _settings(req, measure_steps, uri)
        first = rank(req, profile, **settings)  # a bad request fails here, before any worker
    except SpecError as e:
        fail(e)
    if not any(r.feasible for r in first):
        fail(SpecError("--devices", req.devices, "no layout of the space can run here"))
    loop = PlanLoop(req, profile, top_k=top_k, rounds=rounds, budget=budget,
                    halving_steps=halving_steps, **settings)
    reused = _measure(loop, req, profile, settings, results_root, not json_)
    outcome = loop.outcome
    if reused and not json_:
        say(f"{reused} of the layouts measured were in the study's ledger already: their "
            "recorded results were used, not run again")
    rows = measured_rows(outcome)
    study = space_spec(req, profile, **settings).name
    plan_file = write_plan_yaml(outcome, req, hardware, settings, results_root, study)
    write_plan_record(outcome, rows, req, results_root, study)
    fitted = write_refit(outcome, results_root, study)
    if json_:
        emit_json(rows)
        return
    _print_answer(outcome, rows, req, plan_file, time.time() - t0)
    if fitted:
        say(f"refitted profile: {fitted} (`scalestudy report {study}` predicts with it; its "
            "predictions of the measured layouts are in sample)")
    if scale_to:
        _print_scaled(req, outcome.profile, scale_to)


def measured_rows(outcome: PlanOutcome) -> list[dict[str, Any]]:
    """Every measured layout: predicted when chosen, predicted by the last refit (in sample: that
    refit saw this measurement), measured."""
    rows = []
    for key, m in sorted(outcome.measured.items(), key=lambda kv: -_finite(kv[1].score)):
        now = outcome.predicted_now(key)
        res, chosen = m.result, m.chosen_as
        pred_now = now.result.tokens_per_s * now.factor if now is not None else math.nan
        rows.append({"round": m.round, "window": m.window, "trial": m.name,
                     "trial_id": res.trial_id,
                     "family": chosen.family, "zero_stage": res.zero_stage, "tp": res.tp,
                     "pp": res.pp, "micro_batch": res.micro_batch,
                     "activation_checkpointing": res.activation_checkpointing,
                     "predicted": chosen.result.tokens_per_s, "predicted_now": pred_now,
                     "measured": res.tokens_per_s,
                     "error_now": pred_now / res.tokens_per_s - 1 if m.completed else math.nan,
                     "score": m.score, M.PEAK_MEMORY_GIB: res.peak_memory_gib,
                     "status": res.status.value, "reason": res.reason})
    return rows


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -math.inf


def _print_answer(outcome: PlanOutcome, rows: list[dict], req: PlanRequest, plan_file: str,
                  wall_s: float) -> None:
    print_table(rows, MEASURED_COLUMNS, title=(
        f"{req.model} on {req.devices} x {req.hardware}: {len(rows)} layouts measured in "
        f"{len(outcome.rounds)} rounds (tokens/s; predicted: when chosen; predicted_now: by the "
        f"last refit with its family factor, in sample)"))
    for rnd in outcome.rounds:
        fitted = ", ".join(f"{k} {v:.4g}" for k, v in rnd.refit.items()) or "nothing to refit"
        factors = ", ".join(f"{k} {v:.3g}" for k, v in rnd.factors.items()) or "none"
        say(f"round {rnd.index}: refit {fitted}; measured/predicted per family: {factors}; error "
            f"on its own measurements {_pct(rnd.in_sample_error)} (in sample), leave-one-out "
            f"{_pct(rnd.heldout_error)}")
    best = outcome.recommended
    if best is None:
        say("no measured layout completed: nothing to recommend (see the reasons above)")
    else:
        r = best.result
        say(f"recommended: {best.name} ({best.chosen_as.family}): "
            f"measured {r.tokens_per_s:,.0f} tokens/s, MFU {r.mfu:.3f}, peak memory "
            f"{r.peak_memory_gib:.2f} GiB per device ({req.objective.value} {best.score:.4g})")
        say(_runners_up(outcome, best))
    say(families_line(table_rows(outcome.ranked)) + " (predicted by the last refit)")
    short = sum(m.window == "short" for m in outcome.measured.values())
    if short:
        say(f"{short} layouts ran only their halving window (the worse half of their round)")
    say(f"spent: {outcome.spent_trials} trials, {outcome.spent_device_hours:.3f} device-hours; "
        f"stopped: {outcome.stop_reason}")
    say(f"plan: {plan_file} (`scalestudy sweep {plan_file}` runs the recommended layout)")
    say(f"planned in {wall_s:.0f} s")


def _runners_up(outcome: PlanOutcome, best: Measured) -> str:
    per_family: dict[str, Measured] = {}
    for m in sorted(outcome.measured.values(), key=lambda m: -_finite(m.score)):
        if m.completed and m.chosen_as.family != best.chosen_as.family:
            per_family.setdefault(m.chosen_as.family, m)
    if not per_family:
        return "runner-up families: none measured"
    return "runner-up families (measured): " + "; ".join(
        f"{f} {m.name} {m.score / best.score:.2f}x"
        for f, m in per_family.items())


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else "n/a"


def write_plan_yaml(outcome: PlanOutcome, req: PlanRequest, hardware: str,
                    settings: dict[str, Any], results_root: str, study: str) -> str:
    """The recommended layout as a study spec (its axes scalar), beside the study's ledger;
    `hardware` as the user named it (a catalogue name or a profile file's path)."""
    best = outcome.recommended
    location = storage.join(results_root, study, "plan.yaml")
    if best is None:
        return "(none: no measured layout completed)"
    c = best.chosen_as.entry.config.config_fields()  # flat, scalar, enums as their values
    if c["recompute_granularity"] == "selective":  # the spec's word for it
        c["activation_checkpointing"] = "selective"
    spec = {"name": f"{study}-best", "model": req.model, "hardware": hardware,
            "backend": "measure", **{k: c[k] for k in SPEC_AXES},
            "steps": settings["steps"], "tracking": {"experiment": settings["tracking"]["experiment"]}}
    head = (f"# scalestudy plan: {best.name} measured best of {outcome.spent_trials} layouts "
            f"({req.objective.value} {best.score:.4g}); stopped: {outcome.stop_reason}\n")
    storage.write_bytes(location, (head + yaml.safe_dump(spec, sort_keys=False)).encode())
    return str(location)


def write_plan_record(outcome: PlanOutcome, rows: list[dict[str, Any]], req: PlanRequest,
                      results_root: str, study: str) -> str:
    """What the plan did, beside the study's ledger, for `scalestudy report`'s plan figure: every
    measured layout (predicted when chosen, by the last refit, measured), the rounds, the answer."""
    best = outcome.recommended
    record = {
        "model": req.model, "hardware": req.hardware, "devices": req.devices,
        "objective": req.objective.value, "recommended": best.name if best else None,
        "stop_reason": outcome.stop_reason, "spent_trials": outcome.spent_trials,
        "spent_device_hours": outcome.spent_device_hours,
        "rounds": [{"index": r.index, "in_sample_error": r.in_sample_error,
                    "heldout_error": r.heldout_error} for r in outcome.rounds],
        "layouts": rows,
    }
    location = storage.join(results_root, study, PLAN_RECORD)
    # NaN (a layout that failed) as null: strict JSON that any reader parses.
    storage.write_bytes(location, json.dumps(_nan_to_none(record), default=str).encode())
    return str(location)


def _nan_to_none(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return x


def write_refit(outcome: PlanOutcome, results_root: str, study: str) -> str | None:
    """The last refit's profile where `scalestudy fit` puts one (fitted-<hardware>.yaml beside the
    study's ledger), so the study's report predicts with it; None when nothing was refitted."""
    if not outcome.rounds or not outcome.rounds[-1].refit:
        return None
    location = storage.join(results_root, study, f"fitted-{outcome.profile.name}.yaml")
    storage.write_bytes(location, profile_yaml(outcome.profile).encode())  # a URI root too
    return str(location)


def _print_scaled(req: PlanRequest, profile: HardwareProfile, devices: int) -> None:
    scaled = req.model_copy(update={"devices": devices, "global_batch": None})
    try:
        rows = table_rows(rank(scaled, profile))
    except SpecError as e:
        fail(e)
    print_table(rows[:5], PLAN_COLUMNS, title=(
        f"at {devices} x {req.hardware}, by the refitted model (predicted, not measured)"))
