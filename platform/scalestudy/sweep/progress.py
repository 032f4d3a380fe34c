"""Rich progress display of a sweep: trials done/total, current trial, elapsed, ETA, last tokens/s."""

from __future__ import annotations

import math

from rich.console import Console
from rich.progress import (
    BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
)

from scalestudy.metrics import TrialResult


class SweepProgress:
    def __init__(self, total: int | None, console: Console | None = None, enabled: bool = True):
        self._progress = Progress(
            TextColumn("[bold]{task.fields[study]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=console or Console(stderr=True),
            disable=not enabled,
            transient=False,
        )
        self._total = total
        self._task = None

    def __enter__(self) -> SweepProgress:
        self._progress.__enter__()
        self._task = self._progress.add_task("sweep", total=self._total, study="", status="")
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def set_study(self, study: str) -> None:
        self._progress.update(self._task, study=study)

    def running(self, run_name: str) -> None:
        self._progress.update(self._task, status=f"running {run_name}")

    def done(self, result: TrialResult, run_name: str) -> None:
        tps = result.tokens_per_s
        last = f"{tps:,.0f} tok/s" if math.isfinite(tps) else result.status.value
        self._progress.update(self._task, advance=1, status=f"last {run_name}: {last}")
