"""A plan entry: one trial of a study as every command sees it, with its verdict."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from scalestudy.errors import ReasonClass
from scalestudy.parallel.layout import Layout
from scalestudy.perfmodel.memory import MEMORY_MARGIN_FRACTION, MemoryBreakdown, usable_memory_gib
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.trial import PlannedTrial


class MemoryEstimate(BaseModel):
    """Per-device memory of a trial by the one memory rule (perfmodel/memory.py), in GiB."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    terms_gib: dict[str, float]
    total_gib: float
    device_gib: float
    usable_gib: float
    margin_fraction: float = MEMORY_MARGIN_FRACTION

    @classmethod
    def of(cls, breakdown: MemoryBreakdown, device_gib: float) -> MemoryEstimate:
        return cls(terms_gib=breakdown.terms_gib, total_gib=breakdown.total_gib,
                   device_gib=device_gib, usable_gib=usable_memory_gib(device_gib))

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.usable_gib


class Verdict(BaseModel):
    """Runnable, or infeasible with the rule that refused it and one line of particulars."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    runnable: bool
    reason_class: ReasonClass | None = None
    reason: str | None = None

    def __str__(self) -> str:
        return "runnable" if self.runnable else f"infeasible ({self.reason_class.value}): {self.reason}"


class PlanEntry(PlannedTrial):
    """A PlannedTrial (axes, config, reason, reason_class) with the plan's memory estimate; None
    when the layout does not divide or the model does not split (no estimate is meaningful)."""

    memory: MemoryEstimate | None = None

    @property
    def verdict(self) -> Verdict:
        return Verdict(runnable=self.feasible, reason_class=self.reason_class, reason=self.reason)

    @property
    def hardware(self) -> HardwareProfile:
        return self.config.hardware_profile

    @property
    def layout(self) -> Layout:
        return self.config.layout

    @property
    def resources_per_worker(self) -> dict[str, float]:
        return self.hardware.ray_resources_per_worker()

    def as_row(self) -> dict[str, Any]:
        """What `validate --json` prints for this entry: config columns, resources, memory, verdict."""
        c = self.config
        row: dict[str, Any] = {**c.config_fields(), "trial": c.run_name,
                               "tokens_per_step": c.tokens_per_step,
                               "resources_per_worker": self.resources_per_worker}
        row["memory"] = self.memory.model_dump() if self.memory else None
        row["verdict"] = self.verdict.model_dump(mode="json")
        return row
