"""The pause / resume protocol every meter of a trial's window shares (energy, utilization, and
TrialMeters over both): ``with m.excluded():`` cuts the enclosed work, a checkpoint save, out of the
metered window."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class Pausable:
    def pause(self) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    @contextmanager
    def excluded(self) -> Iterator[None]:
        """Cut the enclosed work out of the metered window (resumed even if the work raises)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()
