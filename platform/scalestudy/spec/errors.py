"""The spec's error types. They are defined in scalestudy.errors, below every package, so that
parallel/ (the layout object) can raise InfeasibleTrial without importing spec/."""

from scalestudy.errors import InfeasibleTrial, SpecError

__all__ = ["InfeasibleTrial", "SpecError"]
