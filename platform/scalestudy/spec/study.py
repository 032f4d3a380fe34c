"""The study spec (YAML contract of every command) and its expansion into trials.

A trial is a TrialConfig (spec/trial.py); its layout (degrees, nodes, batch split) comes from the
layout object (parallel/layout.py), which also says why a point cannot run; spec/checks.py says
what else refuses it. The spec's sections and axis validators are in spec/sections.py, model and
hardware resolution in spec/resolve.py, the ensemble section in spec/ensemble.py.
"""

from __future__ import annotations

import itertools
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator

from scalestudy.errors import InfeasibleTrial
from scalestudy.parallel.layout import Layout
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.checks import check_trial
from scalestudy.spec.ensemble import Ensemble, check_ensemble
from scalestudy.spec.precision import PrecisionChoice, resolve_precision
from scalestudy.spec.resolve import one_per_name, resolve_hardware, resolve_model
from scalestudy.spec.sections import (NamedModel, PosInt, Search, Tracking, Workers, WorldSize,
                                      ZeroStage, as_list)
from scalestudy.spec.trial import (
    AXES,
    LAYOUT_AXES,
    LAYOUT_DEFAULTS,
    LAYOUT_NAME_AXES,
    Backend,
    Elastic,
    FaultTolerance,
    GatherGranularity,
    PipelineSchedule,
    PlannedTrial,
    RecomputeGranularity,
    Steps,
    TrialConfig,
)


class StudySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # First, so the hardware validator can resolve profile paths relative to the spec file.
    spec_dir: Path | None = Field(default=None, exclude=True)
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    model: list[NamedModel]
    hardware: list[HardwareProfile]
    backend: Backend = Backend.measure
    seq_len: list[PosInt] = [128]
    precision: list[PrecisionChoice] = [PrecisionChoice.auto]
    world_size: list[WorldSize] = [1]
    zero_stage: list[ZeroStage] = [0]
    tp: list[PosInt] = [1]
    pp: list[PosInt] = [1]
    micro_batch: list[PosInt] = [1]
    global_batch: list[PosInt | None] = [None]
    # false / none, true / full, or selective (the attention core only): see _checkpointing_words.
    activation_checkpointing: list[bool | Literal["selective"]] = Field([False], description=(
        "Recompute activations in backward: `none` (false), `full` (true: every block's forward "
        "again; less memory, more compute, which HFU counts and MFU does not) or `selective` (the "
        "attention core only, Korthikanti et al. 2022; measured trials run their SDPA core under "
        "torch's checkpoint)."))
    # Issue 35's layout options (spec/trial.py LAYOUT_DEFAULTS; check_layout_options says what may
    # combine; perfmodel/layouts.py prices them).
    sequence_parallel: list[bool] = Field([False], description=(
        "Megatron sequence parallelism with tp > 1: norm and dropout activations sharded over the "
        "TP group, each all-reduce replaced by an all-gather and a reduce-scatter."))
    cp: list[PosInt] = Field([1], description=(
        "Context-parallel degree: a micro-batch's sequence split over cp ranks (ring attention, "
        "load-balanced causal chunks); dp counts them, as they share weights and gradients."))
    gather_granularity: list[GatherGranularity] = Field([GatherGranularity.module], description=(
        "ZeRO-3 parameter gathers: `module`, DeepSpeed's per-module fetch with its prefetch bucket; "
        "`block`, FSDP's one gather per transformer block, the next one prefetched."))
    tp_comm_overlap: list[bool] = Field([False], description=(
        "TP collectives overlapped with the GEMMs they feed (Megatron/Transformer Engine comm "
        "overlap); false: they block."))
    fp8: list[bool] = Field([False], description=(
        "GEMMs in FP8 (Transformer Engine recipe: casts and scaling around each GEMM, everything "
        "else bf16) on hardware with an FP8 peak; precision stays bf16."))
    # The pipeline of every pp > 1 trial (check_pipeline says what may combine): its schedule,
    # chunks per pipeline rank (interleaved_1f1b only, >= 2) and how many blocks fewer than the
    # others the first stage (it also embeds) and the last (norm, LM head, loss) take.
    schedule: PipelineSchedule = Field(PipelineSchedule.one_f_one_b, description=(
        "Pipeline schedule of pp > 1 trials: gpipe (all forwards, then all backwards), 1f1b (one "
        "forward, one backward in the steady state) or interleaved_1f1b (virtual_stages chunks per "
        "pipeline rank)."))
    virtual_stages: PositiveInt = Field(1, validate_default=True, description=(
        "Model chunks per pipeline rank: 1, or 2 and more with schedule interleaved_1f1b (the "
        "bubble shrinks by that factor, p2p traffic grows by it)."))
    first_stage_fewer_layers: int = Field(0, ge=0, description=(
        "Transformer blocks fewer than the other pipeline stages for the first one, which also "
        "runs the embedding."))
    last_stage_fewer_layers: int = Field(0, ge=0, description=(
        "Transformer blocks fewer than the other pipeline stages for the last one, which also runs "
        "the final norm, the LM head and the loss."))
    steps: Steps = Steps()
    search: Search = Search()
    tracking: Tracking = Tracking()
    seed: int = 0
    learning_rate: PositiveFloat = 1e-3
    trial_timeout_s: PositiveFloat = 3600.0  # counted from the start of a trial's worker group
    # The wait for a trial's nodes (an autoscaler's take minutes); past it the trial is recorded as
    # a timeout with a placement reason.
    placement_timeout_s: PositiveFloat = 1800.0
    fault_tolerance: FaultTolerance = FaultTolerance()
    elastic: Elastic | None = None
    # Excluded from dumps, so from the spec hash: how trials start does not change what they measure.
    workers: Workers = Field(default_factory=Workers, exclude=True)
    ensemble: Ensemble | None = Field(None, description=(
        "null: an ordinary study; a mapping: one large model (this study's trial) against k "
        "smaller ones trained at once on the same devices (issue 36)."))

    @field_validator("ensemble", mode="after")
    @classmethod
    def _ensemble_fits(cls, v: Ensemble | None, info) -> Ensemble | None:
        return check_ensemble(v, info.data) if v is not None else v  # every other key is validated

    @field_validator(
        "seq_len", "precision", "world_size", "zero_stage", "tp", "pp", "micro_batch",
        "global_batch", "activation_checkpointing", *LAYOUT_AXES, mode="before",
    )
    @classmethod
    def _listify(cls, v: Any) -> list:
        return as_list(v)

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_words(cls, v: Any) -> list:
        """`none`, `full`, `selective`, or a bool as older specs write it (false = none, true =
        full, so their trials keep their ids)."""
        words = {"none": False, "full": True}
        return [words.get(x, x) if isinstance(x, str) else x for x in as_list(v)]

    @field_validator(*AXES, mode="after")
    @classmethod
    def _distinct(cls, v: list) -> list:
        """A value listed twice is one grid point: two would be two trials of one trial id."""
        seen: set = set()
        return [x for x in v if not (shown(x) in seen or seen.add(shown(x)))]

    @field_validator("elastic", mode="after")
    @classmethod
    def _elastic_can_shrink(cls, v: Elastic | None, info) -> Elastic | None:
        """Ray Train shrinks an elastic trial only by restarting it after a worker is lost, and
        that restart counts against max_failures: with 0 a lost node fails the trial instead."""
        ft = info.data.get("fault_tolerance")  # declared before `elastic`: validated already
        if v is not None and ft is not None and ft.max_failures == 0:
            raise ValueError("an elastic trial shrinks only by a restart after a lost worker, which "
                             "counts against fault_tolerance.max_failures (0 here); set it to 1 or "
                             "more (e.g. fault_tolerance: {max_failures: 3}), or leave elastic out")
        return v

    @field_validator("virtual_stages", mode="after")
    @classmethod
    def _virtual_stages_interleave(cls, v: int, info) -> int:
        """Only the interleaved schedule runs several chunks per rank, and it needs two or more
        (validate_default: an interleaved schedule with virtual_stages left out is refused too)."""
        schedule = info.data.get("schedule")
        if schedule is PipelineSchedule.interleaved_1f1b and v < 2:
            raise ValueError("interleaved_1f1b runs 2 or more chunks per pipeline rank; set "
                             "virtual_stages: 2 (or more), or schedule: 1f1b")
        if schedule is not None and schedule is not PipelineSchedule.interleaved_1f1b and v != 1:
            raise ValueError(f"only schedule: interleaved_1f1b runs virtual stages ({schedule.value} "
                             "runs one chunk per rank); set virtual_stages: 1 or that schedule")
        return v

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_models(cls, v: list) -> list[NamedModel]:
        models = [resolve_model(x) for x in as_list(v)]
        one_per_name([(m.name, m.dims) for m in models], "models with different dims",
                      "name each one: {name: my-model, dims: {architecture: ..., hidden_size: ...}}")
        return models

    @field_validator("hardware", mode="before")
    @classmethod
    def _resolve_hardware(cls, v: list, info) -> list[HardwareProfile]:
        spec_dir = info.data.get("spec_dir")
        profiles = [resolve_hardware(x, spec_dir) for x in as_list(v)]
        one_per_name([(h.name, h) for h in profiles], "different hardware profiles",
                      "edit the `name:` of one profile YAML (a calibrated profile keeps the "
                      "name of the catalogue entry it started from)")
        return profiles

    @property
    def experiment(self) -> str:
        return self.tracking.experiment or self.name

    def axis_values(self) -> dict[str, list]:
        """Each axis' values as trials show them (names, plain values): what a search draws from."""
        return {a: [shown(v) for v in getattr(self, a)] for a in AXES}

    @property
    def name_axes(self) -> tuple[str, ...]:
        """Axes beyond the layout that this study sweeps: its trials' names show them."""
        return tuple(a for a in AXES if a not in LAYOUT_NAME_AXES and len(getattr(self, a)) > 1)


def shown(value: Any) -> Any:
    """An axis value as trials, names and searches show it: a model's or hardware's name, an
    enum's value, anything else itself."""
    if isinstance(value, (NamedModel, HardwareProfile)):
        return value.name
    return value.value if isinstance(value, Enum) else value


def resolve_point(spec: StudySpec, axes: dict[str, Any]) -> dict[str, Any]:
    """Axis values as shown/sampled (names, plain values) -> the spec's typed objects."""
    point = dict(axes)
    point["model"] = next(m for m in spec.model if m.name == axes["model"])
    point["hardware"] = next(h for h in spec.hardware if h.name == axes["hardware"])
    point["precision"] = PrecisionChoice(axes["precision"])
    return point


def build_trial(spec: StudySpec, point: dict[str, Any]) -> PlannedTrial:
    """One grid point (typed, see resolve_point) -> PlannedTrial with its infeasibility reason."""
    axes = {k: shown(v) for k, v in point.items()}
    hw: HardwareProfile = point["hardware"]
    degrees = (point["world_size"], point["tp"], point["pp"], point["micro_batch"],
               _layout_batch(point), hw.gpus_per_node)
    refusal: InfeasibleTrial | None = None
    try:
        layout = Layout.of(*degrees)
    except InfeasibleTrial as err:
        layout, refusal = Layout.lenient(*degrees), err
    cfg = _trial_config(spec, point, layout)
    if refusal is None:
        try:
            check_trial(spec, cfg)
        except InfeasibleTrial as err:
            refusal = err
    if refusal is None:
        return PlannedTrial(axes=axes, config=cfg)
    return PlannedTrial(axes=axes, config=cfg, reason=str(refusal),
                        reason_class=refusal.reason_class)


def _trial_config(spec: StudySpec, point: dict[str, Any], layout: Layout) -> TrialConfig:
    model: NamedModel = point["model"]
    hw: HardwareProfile = point["hardware"]
    return TrialConfig(
        study=spec.name,
        backend=spec.backend,
        model=model.name,
        hardware=hw.name,
        world_size=layout.world_size,
        nodes=layout.nodes,
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        **_pipeline_options(spec, layout.pp),
        zero_stage=point["zero_stage"],
        micro_batch=layout.micro_batch,
        grad_accum=layout.grad_accum,
        global_batch=layout.global_batch // point.get("cp", 1),
        seq_len=point["seq_len"],
        precision=resolve_precision(point["precision"], hw),
        precision_requested=point["precision"],
        **_layout_options(point),
        steps=spec.steps,
        seed=spec.seed,
        learning_rate=spec.learning_rate,
        trial_timeout_s=spec.trial_timeout_s,
        placement_timeout_s=spec.placement_timeout_s,
        fault_tolerance=spec.fault_tolerance,
        elastic=spec.elastic,
        model_dims=model.dims,
        hardware_profile=hw,
        name_axes=spec.name_axes,
    )


def _pipeline_options(spec: StudySpec, pp: int) -> dict[str, Any]:
    """The spec's pipeline options for a pp > 1 trial; a pp = 1 trial has no pipeline, so it keeps
    the defaults (and the trial id a spec without them gives it)."""
    if pp == 1:
        return {}
    return {"schedule": spec.schedule, "virtual_stages": spec.virtual_stages,
            "first_stage_fewer_layers": spec.first_stage_fewer_layers,
            "last_stage_fewer_layers": spec.last_stage_fewer_layers}


def expand(spec: StudySpec) -> list[PlannedTrial]:
    """The full grid in a fixed order (axes in AXES order, values in spec order)."""
    return [
        build_trial(spec, dict(zip(AXES, values)))
        for values in itertools.product(*(getattr(spec, a) for a in AXES))
    ]


# Issue 35's layout options ------------------------------------------------------------------------

def _layout_batch(point: dict[str, Any]) -> int | None:
    """The global batch as the layout divides it. The layout's dp counts context-parallel ranks,
    which share a micro-batch (each holds a 1/cp slice of its sequence), so a step's sequences are
    global_batch * cp in the layout's terms; _trial_config divides them back."""
    gb, cp = point["global_batch"], point.get("cp", 1)
    return gb * cp if gb else gb


def _layout_options(point: dict[str, Any]) -> dict[str, Any]:
    """A point's checkpointing and layout options as TrialConfig fields (a point built before an
    option existed keeps its default)."""
    ac = point["activation_checkpointing"]
    selective = isinstance(ac, str) and ac == "selective"
    return {"activation_checkpointing": bool(ac),
            "recompute_granularity": (RecomputeGranularity.selective if selective
                                      else RecomputeGranularity.full),
            **{a: point.get(a, LAYOUT_DEFAULTS[a]) for a in LAYOUT_AXES}}
