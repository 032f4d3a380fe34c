"""Plain-text tables of trials for the terminal: validate, predict, run, sweep and fit print them.

Why not a rich Table: at 80 columns rich squeezes 15+ columns until headers are one letter wide and
numbers wrap onto a second line (`1.035e+0` / `4`, read as 1.0, not 10,350). Here a number is never
split or truncated: every cell is one line, numbers are written with thousands separators or 4
significant digits, columns whose value never changes are printed once above the table, and when
the rest still does not fit the width, text columns are shortened (with "…") and then the least
important columns are left out, with a line naming them and the option that shows them.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from scalestudy import metrics as M

# Short headers for long column names (the full name is what --columns and --sort take).
HEADERS = {
    "world_size": "world", "zero_stage": "zero", "micro_batch": "mb", "grad_accum": "ga",
    "global_batch": "gbatch", "seq_len": "seq", "tokens_per_step": "tok/step",
    M.STEP_TIME_S: "step_s", M.TOKENS_PER_S: "tok/s", M.TOKENS_PER_S_PER_DEVICE: "tok/s/dev",
    M.COMM_EXPOSED_FRACTION: "exposed", M.PEAK_MEMORY_GIB: "mem_GiB", "memory_gib": "mem_GiB",
    "usable_gib": "usable_GiB", M.POWER_W_ESTIMATED: "W_est",
    M.ENERGY_PER_TOKEN_J_ESTIMATED: "J/tok_est", M.LOSS_FIRST: "loss0", M.LOSS_LAST: "loss",
    "activation_checkpointing": "ckpt", "precision": "prec",
}
# Columns that may be shortened with "…" when the table is too wide (never numbers).
SHORTENABLE = ("reason", "verdict", "status", "trial", "model", "hardware")
MIN_SHORT = 12
MIN_COLUMNS = 4  # columns kept whole before the trial name is shortened
GAP = "  "


def fmt(v: Any) -> str:
    """One cell: never wraps, never drops a digit that matters."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, Enum):
        return str(v.value)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if v == 0:
            return "0"
        a = abs(v)
        if a >= 1e15 or a < 1e-4:
            return f"{v:.3e}"
        if a >= 1000:
            return f"{v:,.0f}"
        return f"{v:.4g}"
    return str(v).replace("\n", " ")


def _numeric(values: Iterable[Any]) -> bool:
    vals = [v for v in values if v is not None]
    return bool(vals) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)


@dataclass
class Rendered:
    lines: list[str]
    constants: dict[str, str] = field(default_factory=dict)
    hidden: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def sort_rows(rows: list[Mapping[str, Any]], key: str | None) -> list[Mapping[str, Any]]:
    """`key` is a column name, `name:desc` for descending; NaN and missing cells sort last."""
    if not key:
        return list(rows)
    name, _, order = key.partition(":")
    desc = order == "desc"

    def k(r: Mapping[str, Any]) -> tuple:
        v = r.get(name)
        missing = v is None or (isinstance(v, float) and math.isnan(v))
        if missing:
            return (1, 0)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return (0, -v if desc else v)
        return (0, str(v))

    out = sorted(rows, key=k)
    if desc and out and not _numeric(r.get(name) for r in out):
        present = [r for r in out if k(r)[0] == 0][::-1]
        out = present + [r for r in out if k(r)[0] == 1]
    return out


def render(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], width: int = 200,
           title: str | None = None, fold_constants: bool = True) -> Rendered:
    """The table as lines of at most `width` characters (prose lines fold at spaces; a single
    word longer than the width stays whole)."""
    cols = [c for c in columns if any(r.get(c) not in (None, "") for r in rows)]
    constants: dict[str, str] = {}
    if fold_constants and len(rows) > 1:
        for c in list(cols):
            shown = {fmt(r.get(c)) for r in rows}
            if len(shown) == 1 and c not in ("trial",):
                constants[c] = shown.pop()
                cols.remove(c)
    cells = {c: [fmt(r.get(c)) for r in rows] for c in cols}
    heads = {c: HEADERS.get(c, c) for c in cols}
    widths = {c: max([len(heads[c]), *(len(x) for x in cells[c])]) for c in cols}
    hidden: list[str] = []

    def total() -> int:
        return sum(widths[c] for c in cols) + len(GAP) * max(len(cols) - 1, 0)

    def shorten(names: Sequence[str]) -> None:
        for c in [c for c in names if c in cols]:
            if total() <= width:
                return
            widths[c] = max(MIN_SHORT, len(heads[c]), widths[c] - (total() - width))

    # Prose first, then the least important columns (the last asked for), the trial name last:
    # it is how a row is found again (`run --set`, the ledger, MLflow).
    shorten([c for c in SHORTENABLE if c != "trial"])
    while total() > width and len(cols) > MIN_COLUMNS:
        hidden.insert(0, cols.pop())
    shorten(["trial"])
    while total() > width and len(cols) > 1:
        hidden.insert(0, cols.pop())
    numeric = {c: _numeric(r.get(c) for r in rows) for c in cols}

    def cell(c: str, text: str) -> str:
        if len(text) > widths[c]:
            text = text[: widths[c] - 1] + "…"
        return text.rjust(widths[c]) if numeric[c] else text.ljust(widths[c])

    lines = _prose(title, width) if title else []
    if constants:
        lines += _prose("all rows: " + ", ".join(f"{HEADERS.get(k, k)}={v}"
                                                 for k, v in constants.items()), width)
    lines.append(GAP.join(cell(c, heads[c]) for c in cols).rstrip())
    lines.append(GAP.join("-" * widths[c] for c in cols))
    for i in range(len(rows)):
        lines.append(GAP.join(cell(c, cells[c][i]) for c in cols).rstrip())
    if hidden:
        lines += _prose(f"not shown at width {width}: {', '.join(hidden)} (--columns to choose, "
                        "--json for everything)", width)
    return Rendered(lines, constants, hidden)


def fold(text: str, width: int) -> list[str]:
    """Prose for the terminal outside a table (notes): folded as a table's notes are."""
    return _prose(text, width)


def _prose(text: str, width: int) -> list[str]:
    """A line of prose folded at spaces only, so a number or a name is never split."""
    return textwrap.wrap(text, width=width, break_long_words=False, break_on_hyphens=False) or [""]
