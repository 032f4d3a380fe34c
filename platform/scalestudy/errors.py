"""The two error types of bad input, below every package so that any of them may raise them.

SpecError: an invalid study spec or command-line value; ``str(err)`` is the whole one-line message
users see (field, value, fix). InfeasibleTrial: a trial of a valid spec that cannot run (degrees do
not divide, the model does not split, memory too small); sweeps record it, never crash on it.
"""

from enum import Enum


class SpecError(ValueError):
    """Invalid study spec or trial. ``str(err)`` is the whole user-facing message (one line)."""

    def __init__(self, field: str, value: object, fix: str, source: str | None = None):
        self.field = field
        self.value = value
        self.fix = fix
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field}: invalid value {value!r}: {fix}")


class ReasonClass(str, Enum):
    """Why a trial of a valid spec cannot run: the class of its verdict, the same in every command
    (validate, predict, run, sweep of either backend). The one-line reason says the particulars."""

    layout = "layout"          # degrees or batch do not divide (parallel/layout.py)
    model = "model"            # the model does not split over tp/pp, or seq_len exceeds it
    precision = "precision"    # no peak figure for the precision, fp16 on a CPU
    backend = "backend"        # the backend cannot run this layout (e.g. pp > 1 measured)
    placement = "placement"    # the nodes cannot hold it (TP group across nodes, partial nodes)
    elastic = "elastic"        # an elastic size that cannot keep the global batch
    memory = "memory"          # the memory estimate exceeds the device's usable memory


class InfeasibleTrial(ValueError):
    """A trial of a valid spec that cannot run (degrees do not divide, memory too small); its
    ``reason_class`` says which rule refused it."""

    def __init__(self, message: str, reason_class: ReasonClass = ReasonClass.layout):
        super().__init__(message)
        self.reason_class = ReasonClass(reason_class)
