"""A trial's summary: what rank 0 of the trial body hands its adapter, and what the driver gets back.

    body (every rank) --reduce--> TrialSummary (rank 0) --Ray channel / warm actor / torchrun-->
        train/result.py summarize() --> TrialResult --> ledger, MLflow

It holds readings, never metrics: the step times and losses after the one reduction across ranks,
the memory reading, the meters' reading, the profiled window, and what the loop went through
(restarts, resized segments). Every metric (throughput, MFU, energy per token, which utilization
column, what is missing and why) is derived from it once, in train/result.py. Typed and closed
(extra="forbid"): a field the body misspells fails the trial where it is built, not as a NaN
column three modules later. It travels pickled (Ray's object store, an actor's return value) or
stays in the process (torchrun), never as JSON, so it may hold the measure/ dataclasses as they are.
No Ray, no torch here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from scalestudy.measure.meters import MeterResult
from scalestudy.measure.profiled_window import ProfiledWindow
from scalestudy.train.pipeline_summary import PipelineReading
from scalestudy.train.segments import Segment


class MemoryPeaks(BaseModel):
    """A memory reading's figures (measure/memory.py's MemoryReading), max over ranks. A model of
    its own rather than that dataclass: measure/memory.py imports torch, and the driver that
    unpickles a summary (and imports train/result.py) has no need of torch."""

    model_config = ConfigDict(extra="forbid")
    allocated_gib: float  # GPU: the caching allocator's peak allocated; CPU: the peak RSS
    reserved_gib: float
    device_used_gib: float
    source: str
    missing: dict[str, str] = Field(default_factory=dict)  # metric name -> why it is NaN

    @classmethod
    def of(cls, reading: Any) -> MemoryPeaks:
        return cls(**dataclasses.asdict(reading))


class TrialSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The timed steps: per step the slowest rank's time; losses of every step (warm-up too), the
    # mean over ranks. An elastic trial's step times span its segments, in step order.
    step_times_s: list[float]
    losses: list[float]
    # The layout this attempt ran at (an elastic trial's last size: train/result.py's ran_config).
    world_size: int
    grad_accum: int
    # World sizes the loop ran at, in order (train/segments.py); more than one: the trial resized.
    segments: list[Segment] = Field(default_factory=list)
    restarts: int = 0
    time_lost_s: float = 0.0
    # Each restore from a checkpoint (train/resume.py): world sizes, per rank bytes read and shard.
    restores: list[dict[str, Any]] = Field(default_factory=list)
    first_measured_step_wall: float | None = None  # epoch s of the first timed step
    memory: MemoryPeaks
    meters: MeterResult  # energy summed over the nodes' meters, utilization over the devices
    profiled: ProfiledWindow | None = None  # None: steps.profile = 0 or instrumentation off
    # Per rank, the local shape of a column- and a row-split weight (tensor-parallel checks).
    shard_shapes: list[dict[str, list[int]]] = Field(default_factory=list)
    deepspeed_config: dict[str, Any] = Field(default_factory=dict)
    timing: dict[str, float] = Field(default_factory=dict)  # rank 0's wall-clock marks (timing.py)
    # What only an adapter knows (the Ray adapters: each rank's node, in rank order).
    worker_node_ids: list[str] | None = None
    # A pipeline trial's (pp > 1) bubble, stages and p2p (train/pipeline_summary.py); None else.
    pipeline: PipelineReading | None = None
