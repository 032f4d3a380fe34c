"""`scalestudy plan MODEL --hardware H --devices N`: the best layouts for a model on N devices.

Registered on the app in cli.py. Every layout of the space is judged by the one planner and
predicted by the model; `--dry-run` prints the ranking (predicted, not measured)."""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer

from scalestudy import metrics as M
from scalestudy import tables
from scalestudy.cli_common import (DEFAULT_ROOT, JsonOpt, RootOpt, TrackingOpt, emit_json, fail,
                                   print_table, say, width)
from scalestudy.errors import SpecError



def plan(
    model: Annotated[str, typer.Argument(help="catalogue model name (e.g. llama2-70b)")],
    hardware: Annotated[str, typer.Option("--hardware", help="catalogue hardware name")],
    devices: Annotated[int, typer.Option("--devices", min=1, help="devices to lay the model on")],
    global_batch: Annotated[Optional[int], typer.Option(
        "--global-batch", min=1, help="sequences per optimizer step (default: 1,024, or the "
        "device count when larger)")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", min=1, help="default: min(4,096, "
                                                   "the model's max)")] = None,
    precision: Annotated[str, typer.Option("--precision", help="auto | bf16 | fp16 | fp32")] = "auto",
    mem_cap: Annotated[Optional[float], typer.Option(
        "--mem-cap", help="GiB per device a layout may use (default: the device's)")] = None,
    objective: Annotated[str, typer.Option(
        "--objective", help="tokens_per_s | tokens_per_joule | usd_per_token")] = M.TOKENS_PER_S,
    usd_per_device_hour: Annotated[Optional[float], typer.Option(
        "--usd-per-device-hour", help="price of one device-hour (default: the catalogue's)")] = None,
    space: Annotated[str, typer.Option(
        "--space", help="free axes, comma-separated: zero, tp, pp, micro_batch, recompute; and "
        "the layout options cp, sp (sequence parallelism), gather_granularity (ZeRO-3 per module "
        "or per block), selective (selective recomputation)")
    ] = "zero,tp,pp,micro_batch,recompute",  # plan/space.py's DEFAULT_SPACE (not imported: startup)
    top_k: Annotated[Optional[int], typer.Option(
        "--top-k", min=1, help="layouts measured per round (default 3); with --dry-run, layouts "
        "shown (default 10)")] = None,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="measure-refit-re-rank rounds "
                                        "at most")] = 3,
    budget: Annotated[Optional[str], typer.Option(
        "--budget", help="what measuring may spend: trials (12) or device-hours (0.5h)")] = None,
    measure_steps: Annotated[int, typer.Option(
        "--measure-steps", min=1, help="timed steps of each measured layout (after 2 warm-up "
        "steps)")] = 10,
    halving_steps: Annotated[Optional[int], typer.Option(
        "--halving-steps", min=1, help="successive halving: a round of 4 or more layouts runs them "
        "all for this many timed steps first, and only the better half for --measure-steps")] = None,
    scale_to: Annotated[Optional[int], typer.Option(
        "--scale-to", min=1, help="also rank the space at this many devices with the refitted "
        "model (predicted, not measured)")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="rank by prediction only: measure nothing")] = False,
    results_root: RootOpt = DEFAULT_ROOT,
    tracking_uri: TrackingOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Rank every layout of a model on N devices by the model; without --dry-run, measure the
    best (Ray Tune trials), refit the model on them and re-rank, round by round."""
    from scalestudy.perfmodel.fit_data import resolve_profile
    from scalestudy.plan.rounds import PlanBudget
    from scalestudy.plan.space import PlanRequest

    try:
        profile = resolve_profile(hardware)
        req = PlanRequest(model=model, hardware=profile.name, devices=devices,
                          global_batch=global_batch, seq_len=seq_len, precision=precision,
                          mem_cap_gib=mem_cap, objective=_objective(objective),
                          space=tuple(a.strip() for a in space.split(",") if a.strip()),
                          usd_per_device_hour=usd_per_device_hour)
        plan_budget = PlanBudget.parse(budget)
    except SpecError as e:
        fail(e)
    if dry_run:
        _dry_run(req, profile, top_k or 10, json_)
        return
    from scalestudy.cli_plan_rounds import measure_plan

    measure_plan(req, profile, hardware, top_k=top_k or 3, rounds=rounds, budget=plan_budget,
                 measure_steps=measure_steps, halving_steps=halving_steps, scale_to=scale_to,
                 results_root=results_root, tracking_uri=tracking_uri, json_=json_)


def _dry_run(req, profile, top_k: int, json_: bool) -> None:
    from scalestudy.perfmodel import coverage
    from scalestudy.plan.space import PLAN_COLUMNS, families_line, rank, refusals, table_rows

    t0 = time.time()
    try:
        ranked = rank(req, profile)
    except SpecError as e:
        fail(e)
    rows = table_rows(ranked)
    if json_:
        emit_json(rows)
        return
    if not rows:
        fail(SpecError("--devices", req.devices, "no layout of the space fits: "
                       + "; ".join(f"{c} ({k})" for c, k, _ in refusals(ranked))))
    feasible = len(rows)
    print_table(rows[:top_k], PLAN_COLUMNS, title=(
        f"{req.model} on {req.devices:,} x {req.hardware}: {len(ranked):,} layouts, {feasible:,} fit; "
        f"best {min(top_k, feasible)} by {req.objective.value} (predicted, not measured; low/high: "
        f"the model's validation error for the layout's family)"))
    say(families_line(rows))
    leans = coverage.summary([r["uncalibrated"] for r in rows])
    if leans:
        for line in tables.fold(f"note: {leans}", width()):
            say(line)
    for cls, count, example in refusals(ranked):
        say(f"refused ({cls}): {count:,} layouts, e.g. {example}")
    say(f"ranked in {time.time() - t0:.1f} s")


def _objective(value: str):
    from scalestudy.plan.space import Objective

    try:
        return Objective(value)
    except ValueError:
        fail(SpecError("--objective", value, f"choose one of {', '.join(o.value for o in Objective)}"))
