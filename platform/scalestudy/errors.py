"""The two error types of bad input, below every package so that any of them may raise them.

SpecError: an invalid study spec or command-line value; ``str(err)`` is the whole one-line message
users see (field, value, fix). InfeasibleTrial: a trial of a valid spec that cannot run (degrees do
not divide, the model does not split, memory too small); sweeps record it, never crash on it.
"""


class SpecError(ValueError):
    """Invalid study spec or trial. ``str(err)`` is the whole user-facing message (one line)."""

    def __init__(self, field: str, value: object, fix: str, source: str | None = None):
        self.field = field
        self.value = value
        self.fix = fix
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field}: invalid value {value!r}: {fix}")


class InfeasibleTrial(ValueError):
    """A trial of a valid spec that cannot run (degrees do not divide, memory too small)."""
