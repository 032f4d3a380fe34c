"""Wall-clock marks of one trial on this rank: where a trial's time goes besides its steps.

    timing.start(); timing.mark("model_built"); ...; summary["timing"] = timing.marks()

Epoch seconds (time.time()), not a process's monotonic clock: a trial's marks come from several
processes (the Tune trainable, Ray Train's workers, torchrun's ranks) and are compared with each
other and with the trial's start in the trainable. tests/bench/trial_overhead.py turns them into a
per-trial breakdown. No Ray, no torch here (train/body.py and train/local.py import it).
"""

from __future__ import annotations

import time

_marks: dict[str, float] = {}


def start() -> None:
    """A new trial on this rank: forget the previous trial's marks (a warm worker runs many)."""
    _marks.clear()


def mark(name: str, at: float | None = None) -> None:
    _marks[name] = time.time() if at is None else at


def marks() -> dict[str, float]:
    return dict(_marks)

