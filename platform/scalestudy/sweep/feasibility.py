"""Feasibility before launch: degree checks (spec expansion) plus the memory model."""

from __future__ import annotations

from scalestudy.perfmodel.memory import check_memory
from scalestudy.spec.errors import InfeasibleTrial
from scalestudy.spec.study import PlannedTrial


def with_memory_check(trial: PlannedTrial) -> PlannedTrial:
    """The trial, marked infeasible when its predicted memory exceeds the device's."""
    if not trial.feasible:
        return trial
    try:
        check_memory(trial.config)
    except InfeasibleTrial as err:
        return trial.model_copy(update={"reason": str(err)})
    return trial


def check_all(planned: list[PlannedTrial]) -> list[PlannedTrial]:
    return [with_memory_check(p) for p in planned]
