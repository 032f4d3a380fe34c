"""The spec's `ensemble:` section: one large model against k smaller ones trained at once on the
same devices (plan/ensemble.py plans the members, sweep/ensemble.py runs them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, field_validator

from scalestudy.spec.resolve import resolve_model
from scalestudy.spec.sections import NamedModel, PosInt, SearchAlgorithm, ZeroStage, as_list
from scalestudy.spec.trial import AXES


class Ensemble(BaseModel):
    """One large model or several smaller ones on the same devices (plan/ensemble.py,
    sweep/ensemble.py): for each member count k, k independent members train at the same time, each
    on world_size / k devices with its own layout, beside the study's own trial on all world_size
    devices (the single model). The layout keys below are the members'; omitted, the single
    model's."""

    model_config = ConfigDict(extra="forbid")
    members: list[PosInt] = Field(description=(
        "Member counts k: each runs k members at once, each on world_size / k devices (every world "
        "size must divide by every k); k = 1 with the study's own model is the single model."))
    # Stored as written (a catalogue name or dims, as `model:`), resolved by member_models().
    member_model: list[str | dict[str, Any]] | None = Field(None, description=(
        "The members' model, or a list of models compared in turn: a catalogue name or a dims "
        "mapping, as `model:`; null: the study's model."))
    token_budget: PositiveFloat = Field(1e12, description=(
        "Tokens each model trains on, for time_to_budget_s and energy_to_budget_j (the single "
        "model and every member alike)."))
    zero_stage: ZeroStage | None = Field(None, description="Members' ZeRO stage; null: the single's.")
    tp: PosInt | None = Field(None, description="Members' TP degree; null: the single model's.")
    pp: PosInt | None = Field(None, description="Members' PP degree; null: the single model's.")
    micro_batch: PosInt | None = Field(None, description="Members' micro-batch; null: the single's.")
    global_batch: PosInt | None = Field(None, description=(
        "Members' global batch in sequences; omitted: the single model's; written as null: weak "
        "scaling (micro_batch x dp of each member)."))

    @field_validator("members", mode="after")
    @classmethod
    def _distinct_members(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"member counts {v} repeat a value; list each k once")
        return sorted(v)

    @field_validator("member_model", mode="before")
    @classmethod
    def _member_models_resolve(cls, v: Any) -> list | None:
        if v is None:
            return None
        for x in as_list(v):
            resolve_model(x)  # the same errors as `model:`
        return [x.model_dump() if isinstance(x, NamedModel) else x for x in as_list(v)]

    def member_models(self, study_models: list[NamedModel]) -> list[NamedModel]:
        return [resolve_model(x) for x in self.member_model] if self.member_model else study_models

    def overrides(self) -> dict[str, Any]:
        """The members' layout axes given in the spec (global_batch: null given means weak)."""
        keys = ("zero_stage", "tp", "pp", "micro_batch")
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if "global_batch" in self.model_fields_set:
            out["global_batch"] = self.global_batch
        return out


def check_ensemble(ens: Ensemble, data: dict[str, Any]) -> Ensemble:
    """An ensemble study compares, per world size N, one single-model trial with k members on N / k
    devices each, started together on warm worker groups: one grid point per N, every k dividing
    every N, and no feature those groups lack (checkpoints, elastic sizes, a search's sampling)."""
    swept = [a for a in AXES if a != "world_size" and len(data.get(a) or [None]) > 1]
    if swept:
        raise ValueError(f"the single model is one trial per world size, but {swept[0]} lists "
                         f"{len(data[swept[0]])} values; give one (the members' own layout goes "
                         "under ensemble: zero_stage, tp, pp, micro_batch, global_batch)")
    for n in data.get("world_size") or []:
        bad = [k for k in ens.members if n % k]
        if bad:
            raise ValueError(f"world_size {n} does not divide into {bad[0]} members of equal "
                             f"shares; list member counts that divide every world size")
    ft, search = data.get("fault_tolerance"), data.get("search")
    if data.get("elastic") is not None or (ft is not None and ft.max_failures > 0):
        raise ValueError("ensemble members run on warm worker groups, which keep no checkpoints "
                         "and do not resize; leave elastic out and fault_tolerance.max_failures 0")
    if search is not None and search.algorithm is not SearchAlgorithm.grid:
        raise ValueError("an ensemble study runs every comparison; use search: {algorithm: grid}")
    return ens
