"""The `scalestudy` command: thin sub-commands that parse, call and print."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from scalestudy.spec.errors import SpecError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)
# Wide when piped (CI logs, `| less`): trial tables have many columns.
out = Console(width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True)

SpecArg = Annotated[Path, typer.Argument(help="study spec YAML", show_default=False)]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="override a spec key, KEY=VALUE (VALUE is YAML); repeatable"),
]


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
        row = dict(p.axes)
        if p.config:
            c = p.config
            row.update(trial=c.run_name, dp=c.dp, grad_accum=c.grad_accum,
                       global_batch=c.global_batch, tokens_per_step=c.tokens_per_step,
                       nodes=c.nodes, status="ok")
        else:
            row.update(trial="-", status=f"infeasible: {p.reason}")
        rows.append(row)
    n_ok = sum(1 for p in planned if p.config)
    out.print(f"{spec}: {len(planned)} trials ({n_ok} runnable, {len(planned) - n_ok} infeasible)")
    cols = ["trial", "model", "hardware", "world_size", "dp", "tp", "pp", "zero_stage",
            "micro_batch", "grad_accum", "global_batch", "seq_len", "precision",
            "tokens_per_step", "nodes", "status"]
    out.print(_trial_table(rows, cols))


RESULT_COLUMNS = ["trial", "status", "world_size", "dp", "tp", "zero_stage", "micro_batch",
                  "step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu",
                  "peak_memory_gib", "loss_first", "loss_last", "reason"]


def result_rows(results) -> list[dict]:
    from scalestudy.spec.study import TrialConfig  # noqa: F401 - keeps import cost out of --help

    rows = []
    for r in results:
        row = r.model_dump()
        row["trial"] = f"ws{r.world_size}-tp{r.tp}-z{r.zero_stage}-mb{r.micro_batch}"
        row["status"] = r.status.value
        rows.append(row)
    return rows


@app.command()
def run(
    spec: SpecArg,
    set_: SetOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="print the TrialResult as JSON")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="show Ray's and the workers' output")] = False,
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
    from scalestudy.train.launch import ensure_ray, run_trial

    ensure_ray(verbose=verbose)
    result = run_trial(cfg, Path("results") / cfg.study / "ray", t0=t0)
    if json_:
        sys.stdout.write(result.model_dump_json() + "\n")
    else:
        out.print(_trial_table(result_rows([result]), RESULT_COLUMNS, title=cfg.study))
    if result.status.value != "completed":
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
