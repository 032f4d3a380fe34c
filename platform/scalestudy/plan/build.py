"""Expansion of a spec into plan entries: the spec's grid (spec/study.py: degrees, model split,
precision, backend, placement, elastic) and then the one memory rule (perfmodel/memory.py).

Order of the rules: a point refused by an earlier rule keeps that reason; the memory rule applies
only to points whose layout and model split are valid (the estimate of a layout that does not
divide means nothing), but it is judged for every other point, so a memory refusal is recorded
whatever the backend.
"""

from __future__ import annotations

from typing import Any

from scalestudy import metrics as M
from scalestudy.errors import ReasonClass
from scalestudy.perfmodel.memory import memory_breakdown, memory_refusal
from scalestudy.perfmodel.params import params_for
from scalestudy.plan.entry import MemoryEstimate, PlanEntry
from scalestudy.spec.errors import SpecError
from scalestudy.spec.study import StudySpec, build_trial, expand
from scalestudy.spec.trial import PlannedTrial, TrialConfig

# Refusals after which no memory estimate is made: the layout or model split is not valid.
_NO_ESTIMATE = (ReasonClass.layout, ReasonClass.model)


def _entry(planned: PlannedTrial) -> PlanEntry:
    cfg = planned.config
    fields = {"axes": planned.axes, "config": cfg, "reason": planned.reason,
              "reason_class": planned.reason_class}
    if planned.reason_class in _NO_ESTIMATE:
        return PlanEntry(**fields)
    hw = cfg.hardware_profile
    breakdown = memory_breakdown(cfg, fused_attention=params_for(hw).fused_attention)
    memory = MemoryEstimate.of(breakdown, hw.hbm_gib)
    if planned.feasible:
        reason = memory_refusal(breakdown.total_gib, hw.hbm_gib)
        if reason:
            fields.update(reason=reason, reason_class=ReasonClass.memory)
    return PlanEntry(**fields, memory=memory)


def plan_spec(spec: StudySpec) -> list[PlanEntry]:
    """Every grid point of the spec, in expansion order, with its verdict and memory estimate."""
    return [_entry(p) for p in expand(spec)]


def plan_study(spec: StudySpec) -> list[PlanEntry]:
    """plan_spec, and a spec none of whose trials can run is an error of the spec (exit 2)."""
    metric = spec.search.metric
    if metric is not None and metric not in M.SCALAR_METRICS:
        raise SpecError("search.metric", metric, "a search optimises a scalar metric; choose one "
                        f"of {', '.join(M.SCALAR_METRICS)}")
    entries = plan_spec(spec)
    if spec.ensemble is not None:  # every member of every comparison must run: a spec error if not
        from scalestudy.plan.ensemble import plan_ensemble

        plan_ensemble(spec, [e for e in entries if e.feasible])
    if not any(e.feasible for e in entries):
        reasons = sorted({e.reason for e in entries if e.reason})
        shown = "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")
        raise SpecError("spec", spec.name, f"no trial can run: {shown}")
    return entries


def plan_point(spec: StudySpec, point: dict[str, Any]) -> PlanEntry:
    """The plan entry of one grid point (typed, spec.study.resolve_point): what a Tune trial, which
    receives its axes by name, runs or refuses; the same verdict as the study's plan gives it."""
    return _entry(build_trial(spec, point))


def plan_config(cfg: TrialConfig) -> PlanEntry:
    """The plan entry of one config given directly (fit, report's predictions): the memory rule
    only, its grid checks having been made when it was planned from its spec."""
    return _entry(PlannedTrial(axes={}, config=cfg))
