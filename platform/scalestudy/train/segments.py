"""Segments of an elastic trial: the stretches of its step loop run at one world size.

A trial that is resized (a node lost, a node gained) runs its steps in segments. Each segment
after a resize starts with its own warm-up (a new worker group: new processes, cold caches, a new
communicator), and the timed window is extended by that warm-up so the timed steps still total
`steps.measure`. Step times stay in one list, in step order; a segment knows how many of them are
its own. The trial's throughput is its final segment's: pooling step times of two world sizes
would report a blend of two trials. A restart at the same size (fault tolerance) continues its
segment.

Pure Python on the loop state's plain fields (train/resume.py's LoopState), no torch, no Ray.
"""

from __future__ import annotations

import statistics

from pydantic import BaseModel, ConfigDict


class Segment(BaseModel):
    """One stretch of the loop at one world size, as the loop state keeps it (a plain dict there,
    for the checkpoint's JSON): where it starts, its warm-up, and the index of its first step time."""

    model_config = ConfigDict(extra="forbid")
    world_size: int
    grad_accum: int
    start_step: int
    warmup_steps: int
    first_timed: int


class Resize(BaseModel):
    """A segment of a resized trial as its result records it (TrialResult.resizes)."""

    model_config = ConfigDict(extra="forbid")
    world_size: int
    grad_accum: int
    start_step: int
    warmup_steps: int
    steps: int  # timed steps of the segment
    step_time_median_s: float | None  # None: the segment ended before timing a step
    tokens_per_s: float | None


def begin(state, world_size: int, grad_accum: int, warmup_steps: int, measure_steps: int) -> None:
    """Open this attempt's segment in `state` unless it continues the last one: where its timed
    steps start (`timed_from`) and where the loop ends (`end_step`)."""
    if state.segments and state.segments[-1]["world_size"] == world_size:
        return
    start = state.next_step
    state.timed_from = start + warmup_steps
    state.end_step = state.timed_from + measure_steps - len(state.step_times_s)
    state.segments.append(Segment(world_size=world_size, grad_accum=grad_accum, start_step=start,
                                  warmup_steps=warmup_steps,
                                  first_timed=len(state.step_times_s)).model_dump())


def summaries(segments: list[Segment] | list[dict[str, int]], step_times_s: list[float],
              tokens_per_step: int) -> list[Resize]:
    """Per segment: world size, accumulation, first step, warm-up, timed steps, their median and
    tokens/s (None when a segment ended before timing a step)."""
    segs = [Segment.model_validate(s) for s in segments]
    out = []
    for i, seg in enumerate(segs):
        end = segs[i + 1].first_timed if i + 1 < len(segs) else len(step_times_s)
        times = step_times_s[seg.first_timed:end]
        median = statistics.median(times) if times else None
        out.append(Resize(world_size=seg.world_size, grad_accum=seg.grad_accum,
                          start_step=seg.start_step, warmup_steps=seg.warmup_steps,
                          steps=len(times), step_time_median_s=median,
                          tokens_per_s=tokens_per_step / median if median else None))
    return out


def final_step_times(step_times_s: list[float], resizes: list[Resize]) -> list[float]:
    """The step times the trial's throughput comes from: its final segment's (all of them when it
    was never resized)."""
    if not resizes:
        return step_times_s
    return step_times_s[len(step_times_s) - resizes[-1].steps:]
