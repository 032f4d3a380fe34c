"""What every `scalestudy` sub-command shares: its options, how errors and tables are printed.

One definition per option, so `--results-root`, `--tracking-uri`, `--json`, `--sort`, `--top` and
`--columns` read and behave the same in every command that takes them (a unit test walks every
command's help for them).
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer

from scalestudy import tables
from scalestudy.errors import SpecError
from scalestudy.track.storage import DEFAULT_RESULTS_ROOT, RESULTS_ROOT_ENV

SpecArg = Annotated[Path, typer.Argument(help="study spec YAML", show_default=False)]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="override a spec key, KEY=VALUE (VALUE is YAML); repeatable"),
]
# One results root for every command that reads or writes results: a folder or a filesystem URI.
RootOpt = Annotated[str, typer.Option(
    "--results-root", envvar=RESULTS_ROOT_ENV,
    help="ledger, profile and checkpoint root: a folder, or a URI (s3://bucket/prefix, gs://..., "
         "any pyarrow/fsspec filesystem); on a cluster, storage every node sees if trials checkpoint")]
TrackingOpt = Annotated[Optional[str], typer.Option(
    "--tracking-uri", help="MLflow tracking URI (default: the spec's, else $MLFLOW_TRACKING_URI, "
                           "else sqlite:///mlflow.db)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output: one JSON object "
                                                       "per line")]
SortOpt = Annotated[Optional[str], typer.Option(
    "--sort", help="sort the table by a column: NAME (ascending) or NAME:desc")]
TopOpt = Annotated[Optional[int], typer.Option("--top", min=1, help="show the first N rows only")]
ColumnsOpt = Annotated[Optional[str], typer.Option(
    "--columns", help="comma-separated columns to show, in order (names as --json prints them)")]
DEFAULT_ROOT = DEFAULT_RESULTS_ROOT


def fail(err: SpecError) -> NoReturn:
    """Bad input: one line on stderr (field, value, fix), exit 2, no traceback."""
    sys.stderr.write(f"error: {err}\n")
    raise typer.Exit(2)


def note(text: str) -> None:
    """A note on stderr, folded at spaces to the terminal's width (a number is never split)."""
    sys.stderr.write("\n".join(tables.fold(f"note: {text}", width())) + "\n")


def say(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def width() -> int:
    """$COLUMNS, else the terminal's width, else 200 (piped output)."""
    return shutil.get_terminal_size((200, 24)).columns


def emit_json(objects: Iterable[Any]) -> None:
    """One JSON object per line: pydantic models as their JSON, anything else through json."""
    for obj in objects:
        if hasattr(obj, "model_dump_json"):
            sys.stdout.write(obj.model_dump_json() + "\n")
        else:
            sys.stdout.write(json.dumps(obj, default=str, allow_nan=True) + "\n")


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], title: str | None = None,
                sort: str | None = None, top: int | None = None,
                chosen: str | None = None) -> None:
    """A table of rows (tables.render) after --sort, --top and --columns."""
    if chosen:
        columns = [c.strip() for c in chosen.split(",") if c.strip()]
        known = {k for r in rows for k in r}
        unknown = [c for c in columns if rows and c not in known]
        if unknown:
            fail(SpecError("--columns", ",".join(unknown),
                           f"no such column; choose from {', '.join(sorted(known))}"))
    if sort:
        name = sort.partition(":")[0]
        if rows and not any(name in r for r in rows):
            fail(SpecError("--sort", sort, f"no such column; choose from {', '.join(columns)}"))
        rows = tables.sort_rows(list(rows), sort)
    shown = list(rows)[:top] if top else list(rows)
    more = f" (first {len(shown)} of {len(rows)})" if top and len(rows) > len(shown) else ""
    say(tables.render(shown, columns, width=width(),
                      title=(title + more) if title else None).text)
