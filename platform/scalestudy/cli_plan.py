"""`scalestudy plan MODEL --hardware H --devices N`: the best layouts for a model on N devices.

Registered on the app in cli.py. Every layout of the space is judged by the one planner and
predicted by the model; `--dry-run` prints the ranking (predicted, not measured)."""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer

from scalestudy import metrics as M
from scalestudy import tables
from scalestudy.cli_common import JsonOpt, emit_json, fail, print_table, say, width
from scalestudy.tables import fmt
from scalestudy.errors import SpecError

PLAN_COLUMNS = ["rank", "trial", "family", "dp", "tp", "pp", "zero_stage", "micro_batch",
                "grad_accum", "activation_checkpointing", "score", "low", "high", M.MFU,
                M.PEAK_MEMORY_GIB]


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
        "--space", help="free axes, comma-separated: zero, tp, pp, micro_batch, recompute")
    ] = "zero,tp,pp,micro_batch,recompute",
    top_k: Annotated[int, typer.Option("--top-k", min=1, help="layouts shown")] = 10,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="rank by prediction only: measure nothing")] = False,
    json_: JsonOpt = False,
) -> None:
    """Rank every layout of a model on N devices by the model (measure the best with a sweep)."""
    from scalestudy.perfmodel import coverage
    from scalestudy.plan.space import PlanRequest, rank, refusals, table_rows

    t0 = time.time()
    try:
        req = PlanRequest(model=model, hardware=hardware, devices=devices,
                          global_batch=global_batch, seq_len=seq_len, precision=precision,
                          mem_cap_gib=mem_cap, objective=_objective(objective),
                          space=tuple(a.strip() for a in space.split(",") if a.strip()),
                          usd_per_device_hour=usd_per_device_hour)
        ranked = rank(req)
    except SpecError as e:
        fail(e)
    rows = table_rows(ranked)
    if json_:
        emit_json(rows)
        return
    if not rows:
        fail(SpecError("--devices", devices, "no layout of the space fits: "
                       + "; ".join(f"{c} ({k})" for c, k, _ in refusals(ranked))))
    feasible = len(rows)
    print_table(rows[:top_k], PLAN_COLUMNS, title=(
        f"{model} on {devices:,} x {hardware}: {len(ranked):,} layouts, {feasible:,} fit; "
        f"best {min(top_k, feasible)} by {req.objective.value} (predicted, not measured; low/high: "
        f"the model's validation error for the layout's family)"))
    _families(rows)
    leans = coverage.summary([r["uncalibrated"] for r in rows])
    if leans:
        for line in tables.fold(f"note: {leans}", width()):
            say(line)
    for cls, count, example in refusals(ranked):
        say(f"refused ({cls}): {count:,} layouts, e.g. {example}")
    if not dry_run:
        say("measuring the best layouts is not available yet: run `scalestudy sweep` on a spec of "
            "them; this ranking is the model's alone")
    say(f"ranked in {time.time() - t0:.1f} s")


def _families(rows: list[dict]) -> None:
    best: dict[str, dict] = {}
    for r in rows:
        best.setdefault(r["family"], r)
    say("best of each family: " + "; ".join(
        f"{f} #{r['rank']} {r['trial']} ({fmt(r['score'])})" for f, r in best.items()))


def _objective(value: str):
    from scalestudy.plan.space import Objective

    try:
        return Objective(value)
    except ValueError:
        fail(SpecError("--objective", value, f"choose one of {', '.join(o.value for o in Objective)}"))
