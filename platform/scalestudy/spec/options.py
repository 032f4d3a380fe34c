"""The options of a trial beyond its degrees: backend, steps, fault tolerance and elastic sizes,
the pipeline's schedule, and the layout options published runs use (spec/trial.py's TrialConfig
carries them; a field at its default is left out of the trial id)."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator


class Backend(str, Enum):
    measure = "measure"
    simulate = "simulate"


class Steps(BaseModel):
    model_config = ConfigDict(extra="forbid")
    warmup: int = Field(3, ge=0)
    measure: PositiveInt = 10
    profile: int = Field(3, ge=0)  # profiled window after the timed one (communication, overlap)


class FaultTolerance(BaseModel):
    """Ray Train restarts of a trial's worker group, resuming from its last DeepSpeed checkpoint."""

    model_config = ConfigDict(extra="forbid")
    max_failures: int = Field(0, ge=0)  # FailureConfig(max_failures): worker-group restarts per trial
    # Steps between checkpoints once max_failures > 0 or the trial is elastic (each costs a
    # checkpoint write and a ray.train.report, outside the timed steps).
    checkpoint_every: PositiveInt = 5


class Elastic(BaseModel):
    """Ray Train elastic scaling: the trial runs with any world size in [min_workers, max_workers]
    that the cluster holds, keeping the global batch by recomputing gradient accumulation."""

    model_config = ConfigDict(extra="forbid")
    min_workers: PositiveInt
    max_workers: PositiveInt
    # How often a running trial checks whether the cluster could hold more workers (Ray Train's
    # elastic_resize_monitor_interval_s); growing restarts the group from the last checkpoint.
    resize_check_s: PositiveFloat = 60.0

    @model_validator(mode="after")
    def _ordered(self) -> Elastic:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers {self.min_workers} exceeds max_workers {self.max_workers}")
        return self


class PipelineSchedule(str, Enum):
    """How a pipeline orders its micro-batches' forwards and backwards (torch.distributed.pipelining):
    GPipe (all forwards, then all backwards: every micro-batch's activations alive at once), 1F1B
    (one forward, one backward in the steady state: at most pp micro-batches alive on the first
    stage) and interleaved 1F1B (virtual_stages chunks per rank: the bubble shrinks by that factor,
    p2p traffic grows by it; Narayanan et al. 2021)."""

    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    interleaved_1f1b = "interleaved_1f1b"


# The pipeline's options, at their defaults the schedule every pp > 1 trial ran before they existed
# (the performance model priced 1F1B). A field at its default is left out of dumps (exclude_if), so
# the trial ids of every config that does not set them are the ids they always had; as columns they
# show their defaults (config_fields).
PIPELINE_DEFAULTS: dict[str, Any] = {"schedule": PipelineSchedule.one_f_one_b, "virtual_stages": 1,
                                     "first_stage_fewer_layers": 0, "last_stage_fewer_layers": 0}


def pipeline_option_field(name: str) -> Any:
    default = PIPELINE_DEFAULTS[name]
    return Field(default, exclude_if=lambda v: v == default)


class GatherGranularity(str, Enum):
    """What one ZeRO-3 / FSDP parameter all-gather fetches: `module`, DeepSpeed ZeRO-3 as this
    platform configures it (each module's parameters when it runs, coalesced up to the prefetch
    bucket); `block`, FSDP's wrapping of every transformer block as one flat parameter (one gather
    per block, the next block's prefetched while this one computes)."""

    module = "module"
    block = "block"


class RecomputeGranularity(str, Enum):
    """What activation checkpointing recomputes (Megatron's --recompute-granularity): `full`, every
    block's forward; `selective`, the attention core only (Korthikanti et al. 2022, Sec. 4.2)."""

    full = "full"
    selective = "selective"


# The layouts published runs use (issue 35): sequence and context parallelism, recompute and gather
# granularity, overlapped TP communication, FP8 GEMMs (perfmodel/layouts.py prices them). A field at
# its default is left out of dumps (exclude_if), so every config that does not set one keeps its
# trial id; as a column it shows its default (config_fields).
LAYOUT_DEFAULTS: dict[str, Any] = {
    "recompute_granularity": RecomputeGranularity.full, "sequence_parallel": False, "cp": 1,
    "gather_granularity": GatherGranularity.module, "tp_comm_overlap": False, "fp8": False}
# The spec axes among them (recompute_granularity is the activation_checkpointing axis' `selective`).
LAYOUT_AXES = ("sequence_parallel", "cp", "gather_granularity", "tp_comm_overlap", "fp8")


def layout_option_field(name: str) -> Any:
    default = LAYOUT_DEFAULTS[name]
    return Field(default, exclude_if=lambda v: v == default)
