"""The plan of an ensemble study (spec `ensemble:`): one comparison per world size N, each the
study's own trial on all N devices (the single model) and, per member count k and member model, k
members on N / k devices each.

Every trial is a PlanEntry of the one planner: a member is planned as a grid point of the study
(plan_point: the layout's degrees, the trial checks, the memory rule) with the members' model and
layout axes, so its verdict is the one `validate` would give it. Member i of a group of k trains
from the study's seed + k(k-1)/2 + i: a seed of its own for every member of the study (independent
models), so a distinct trial id even where two comparisons hold members of one size (64 devices
each as 16 of 1,024 and 32 of 2,048): the ledger keeps one row per trial id.
A member the planner refuses makes the spec invalid (exit 2, the member and the reason in one line):
a comparison missing one of its members compares nothing. The single model is a grid point of the
study like any other; refused, it is recorded as such and its members still run.
Pure Python: no torch, no ray.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel, ConfigDict

from scalestudy import metrics as M
from scalestudy.metrics import EnsembleRole, TrialResult
from scalestudy.perfmodel.ensemble import predict_group
from scalestudy.plan.build import plan_point
from scalestudy.plan.entry import PlanEntry
from scalestudy.spec.errors import SpecError
from scalestudy.spec.sections import NamedModel
from scalestudy.spec.study import StudySpec, resolve_point


class Slot(BaseModel):
    """One trial of a comparison and its place in it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    entry: PlanEntry
    role: EnsembleRole
    k: int
    member_index: int

    def tags(self, comparison: Comparison) -> dict[str, Any]:
        """The trial's place in the comparison: the ledger's ensemble columns."""
        return {M.ENSEMBLE_ID: comparison.ensemble_id, M.ENSEMBLE_ROLE: self.role,
                M.ENSEMBLE_K: self.k, M.MEMBER_INDEX: self.member_index,
                M.TOKEN_BUDGET: comparison.token_budget}

    def tag(self, result: TrialResult, comparison: Comparison) -> TrialResult:
        return result.model_copy(update=self.tags(comparison))


class Comparison(BaseModel):
    """One large model against groups of smaller ones on the same N devices."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ensemble_id: str
    devices: int
    token_budget: float
    single: Slot
    # Each group runs at once: k members of one model, in member order; by model, then k.
    groups: list[list[Slot]]

    @property
    def runs(self) -> list[list[Slot]]:
        """What runs together, in order: the single model alone, then each group."""
        return [[self.single], *self.groups]

    @property
    def slots(self) -> list[Slot]:
        return [s for group in self.runs for s in group]

    def predict_group(self, group: list[Slot]) -> list[TrialResult]:
        """One group's trials predicted and compared (the simulate backend's rows)."""
        return predict_group([s.entry for s in group], [s.tags(self) for s in group])

    def predict(self) -> list[TrialResult]:
        return [r for group in self.runs for r in self.predict_group(group)]


def ensemble_id(spec: StudySpec, single: PlanEntry) -> str:
    """The comparison's id: its study and single trial (so a rerun of the spec keeps it)."""
    return hashlib.sha1(f"{spec.name}/{single.config.trial_id}".encode()).hexdigest()[:12]


def _member(spec: StudySpec, point: dict[str, Any], model: NamedModel, k: int, i: int,
            devices: int) -> PlanEntry:
    mpoint = {**point, "model": model, "world_size": devices // k, **spec.ensemble.overrides()}
    offset = k * (k - 1) // 2 + i  # disjoint ranges per k: [T(k), T(k) + k)
    mspec = spec.model_copy(update={"seed": spec.seed + offset}) if offset else spec
    entry = plan_point(mspec, mpoint)
    if not entry.feasible:
        c = entry.config
        raise SpecError(
            "ensemble.members", k,
            f"a member ({model.name} on {c.world_size} devices: tp {c.tp}, pp {c.pp}, ZeRO-"
            f"{c.zero_stage}, micro_batch {c.micro_batch}, global_batch {c.global_batch}) cannot "
            f"run ({entry.reason_class.value}: {entry.reason}); set the members' layout under "
            "ensemble: (tp, pp, zero_stage, micro_batch, global_batch) or drop this count")
    return entry


def plan_comparison(spec: StudySpec, single: PlanEntry) -> Comparison:
    """The comparison at the single model's world size (one grid point per N:
    spec.ensemble.check_ensemble)."""
    ens = spec.ensemble
    n = single.config.world_size
    point = resolve_point(spec, single.axes)
    head = Slot(entry=single, role=EnsembleRole.single, k=1, member_index=0)
    groups: list[list[Slot]] = []
    for model in ens.member_models(spec.model):
        for k in ens.members:
            entries = [_member(spec, point, model, k, i, n) for i in range(k)]
            if k == 1 and entries[0].config.trial_id == single.config.trial_id:
                continue  # one member of the study's model on all N devices: the single model
            groups.append([Slot(entry=e, role=EnsembleRole.member, k=k, member_index=i)
                           for i, e in enumerate(entries)])
    return Comparison(ensemble_id=ensemble_id(spec, single), devices=n,
                      token_budget=ens.token_budget, single=head, groups=groups)


def plan_ensemble(spec: StudySpec, planned: list[PlanEntry]) -> list[Comparison]:
    """Every comparison of an ensemble study, from its plan (plan_study's entries: the single
    models). SpecError when a member cannot run."""
    if spec.ensemble is None:
        raise SpecError("ensemble", None, "the study has no ensemble: section")
    return [plan_comparison(spec, single) for single in planned]
