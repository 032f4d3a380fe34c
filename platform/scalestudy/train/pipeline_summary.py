"""What a pipeline trial measured, per stage and per step: the readings its summary carries.

No torch and no Ray here (the driver unpickles a summary without torch): train/schedules.py gathers
each rank's RankReading of the timed steps, ``pipeline_reading`` derives the figures.

Definitions (per optimizer step, seconds; a "stage" is a pipeline rank with all its chunks):
  * span: from the pipeline's aligned start (a barrier of its pp group) to its latest rank's end of
    the schedule (gradient reduction and optimizer excluded: they are not the pipeline's);
  * busy: a rank's forward (loss included on the last stage) and backward time of its micro-batches;
  * bubble fraction of a rank = 1 - busy / span over the timed steps; of the trial, the mean over
    stages (each stage the mean over its dp and tp replicas). Narayanan et al. 2021 give
    (pp - 1) / (m + pp - 1) for balanced stages with free transfers;
  * bubble time = span - busy, the mean over ranks;
  * stage imbalance = the busiest stage's busy time / the mean stage's (1: balanced);
  * p2p: operations (sends and receives) and their bytes a rank posted, and the time it blocked
    waiting on them (this includes waiting for the neighbour's compute), means over ranks;
  * peak memory of a stage: its ranks' largest process peak (CPU: RSS, GPU: the allocator's peak);
    activation peak: the most bytes of saved activations it held for backwards at once (the
    schedule's share of the memory, train/schedules.ActivationTracker), from the warm-up steps.
"""

from __future__ import annotations

import math
import statistics

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from scalestudy import metrics as M

NAN = float("nan")


class RankReading(BaseModel):
    """One rank's sums over the timed steps."""

    model_config = ConfigDict(extra="forbid")
    rank: int
    pp_rank: int
    steps: int
    blocks: int  # transformer blocks this rank's chunks hold
    forward_s: float
    backward_s: float
    span_s: float  # sum over the timed steps of its pipeline's span
    p2p_wait_s: float
    p2p_ops: int
    p2p_bytes: int
    dp_comm_s: float
    optimizer_s: float
    peak_memory_gib: float = NAN
    activation_peak_gib: float = NAN  # most activation bytes held for backwards at once


class StageReading(BaseModel):
    """One pipeline stage (rank), per step; means over its dp x tp replicas, memory the max."""

    model_config = ConfigDict(extra="forbid")
    stage: int
    blocks: int
    forward_s: float
    backward_s: float
    busy_s: float
    bubble_fraction: float
    p2p_wait_s: float
    peak_memory_gib: float = NAN
    activation_peak_gib: float = NAN


class PipelineReading(BaseModel):
    """A pipeline trial's figures (module docstring), per step."""

    model_config = ConfigDict(extra="forbid")
    schedule: str
    virtual_stages: int
    micro_batches: int
    stages: list[StageReading] = Field(default_factory=list)
    span_s: float = NAN
    bubble_fraction: float = NAN
    bubble_time_s: float = NAN
    stage_imbalance: float = NAN
    p2p_ops: float = NAN
    p2p_bytes: float = NAN
    p2p_time_s: float = NAN
    dp_comm_s: float = NAN
    optimizer_s: float = NAN

    @property
    def expected_bubble_fraction(self) -> float:
        """(pp - 1) / (m + pp - 1), and / virtual_stages for the interleaved schedule's bubble."""
        p, m, v = len(self.stages), self.micro_batches, self.virtual_stages
        bubble = (p - 1) / v
        return bubble / (m + bubble) if p else NAN


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else NAN


def pipeline_reading(rows: list[RankReading], schedule: str, virtual_stages: int,
                     micro_batches: int) -> PipelineReading:
    """Every rank's RankReading -> the trial's figures per step."""
    if not rows:
        return PipelineReading(schedule=schedule, virtual_stages=virtual_stages,
                               micro_batches=micro_batches)
    n = max(r.steps for r in rows) or 1
    stages = []
    for p in sorted({r.pp_rank for r in rows}):
        mine = [r for r in rows if r.pp_rank == p]
        memory = [r.peak_memory_gib for r in mine if math.isfinite(r.peak_memory_gib)]
        held = [r.activation_peak_gib for r in mine if math.isfinite(r.activation_peak_gib)]
        stages.append(StageReading(
            stage=p, blocks=mine[0].blocks,
            forward_s=_mean([r.forward_s / n for r in mine]),
            backward_s=_mean([r.backward_s / n for r in mine]),
            busy_s=_mean([(r.forward_s + r.backward_s) / n for r in mine]),
            bubble_fraction=_mean([_bubble(r) for r in mine]),
            p2p_wait_s=_mean([r.p2p_wait_s / n for r in mine]),
            peak_memory_gib=max(memory) if memory else NAN,
            activation_peak_gib=max(held) if held else NAN))
    busy = [s.busy_s for s in stages]
    return PipelineReading(
        schedule=schedule, virtual_stages=virtual_stages, micro_batches=micro_batches,
        stages=stages, span_s=_mean([r.span_s / n for r in rows]),
        bubble_fraction=_mean([s.bubble_fraction for s in stages]),
        bubble_time_s=_mean([(r.span_s - r.forward_s - r.backward_s) / n for r in rows]),
        stage_imbalance=max(busy) / _mean(busy) if _mean(busy) > 0 else NAN,
        p2p_ops=_mean([r.p2p_ops / n for r in rows]),
        p2p_bytes=_mean([r.p2p_bytes / n for r in rows]),
        p2p_time_s=_mean([r.p2p_wait_s / n for r in rows]),
        dp_comm_s=_mean([r.dp_comm_s / n for r in rows]),
        optimizer_s=_mean([r.optimizer_s / n for r in rows]))


def _bubble(r: RankReading) -> float:
    return 1.0 - (r.forward_s + r.backward_s) / r.span_s if r.span_s > 0 else NAN


def result_fields(reading: PipelineReading | None, comm: dict[str, Any] | None = None
                  ) -> tuple[dict[str, Any], dict[str, str]]:
    """A pipeline reading's TrialResult fields (bubble, imbalance, per-stage figures) and what is
    missing; nothing for a trial without a pipeline. ``comm``, the breakdown so far (the profiled
    window's), comes back with the timed window's p2p as its send/recv row: counted in the steps
    that set the throughput, not in the profiler's perturbed ones."""
    if reading is None:
        return {}, {}
    fields: dict[str, Any] = {M.BUBBLE_FRACTION: reading.bubble_fraction,
                              M.BUBBLE_TIME_S: reading.bubble_time_s,
                              M.STAGE_IMBALANCE: reading.stage_imbalance,
                              "pipeline_stages": [s.model_dump() for s in reading.stages],
                              "comm": {**(comm or {}), M.SEND_RECV: p2p_stats(reading)}}
    missing = {name: "no timed step measured the pipeline" for name in
               (M.BUBBLE_FRACTION, M.BUBBLE_TIME_S, M.STAGE_IMBALANCE)
               if not math.isfinite(fields[name])}
    return fields, missing


def p2p_stats(reading: PipelineReading) -> M.CollectiveStats:
    """The timed window's p2p per step (mean over ranks): operations (sends and receives), their
    bytes and the time blocked on them (send/recv: bus bytes = bytes)."""
    gbps = reading.p2p_bytes / reading.p2p_time_s / 1e9 if reading.p2p_time_s > 0 else M.NAN
    return M.CollectiveStats(count=reading.p2p_ops, bytes=reading.p2p_bytes,
                             time_s=reading.p2p_time_s, bus_bytes=reading.p2p_bytes,
                             algbw_gbps=gbps, busbw_gbps=gbps)
