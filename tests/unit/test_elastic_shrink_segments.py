"""Segment arithmetic of a resized trial (train/segments.py): each new size warms up again, the
timed steps still total steps.measure, throughput is the final segment's."""

from __future__ import annotations

import statistics

from scalestudy.measure.energy import EnergyReading
from scalestudy.measure.meters import MeterResult
from scalestudy.metrics import CPU_UTILIZATION_CORES, Status
from scalestudy.spec.study import StudySpec, expand
from scalestudy.train import segments
from scalestudy.train.resume import LoopState
from scalestudy.train.result import summarize
from scalestudy.train.summary import MemoryPeaks, TrialSummary


def _run(state: LoopState, n: int, time_s: float) -> None:
    """n steps of the current segment: untimed before timed_from, timed after."""
    for _ in range(n):
        if state.next_step >= state.end_step:
            return
        if state.next_step >= state.timed_from:
            state.step_times_s.append(time_s)
        state.next_step += 1


def test_elastic_shrink_segments_warm_up_again_and_keep_the_window():
    state = LoopState(world_size=2)
    segments.begin(state, 2, 1, warmup_steps=2, measure_steps=10)
    assert (state.timed_from, state.end_step) == (2, 12)
    _run(state, 6, 0.5)  # 2 warm-up + 4 timed at world 2, then a node is lost
    state.world_size = 1
    segments.begin(state, 1, 2, warmup_steps=2, measure_steps=10)
    assert (state.timed_from, state.end_step) == (8, 14)  # 2 more warm-up steps, 6 timed left
    _run(state, 100, 0.9)
    assert len(state.step_times_s) == 10 and state.next_step == 14
    segs = segments.summaries(state.segments, state.step_times_s, tokens_per_step=256)
    assert [(s.world_size, s.grad_accum, s.start_step, s.steps) for s in segs] == [
        (2, 1, 0, 4), (1, 2, 6, 6)]
    assert segs[1].step_time_median_s == 0.9 and segs[1].tokens_per_s == 256 / 0.9
    assert segments.final_step_times(state.step_times_s, segs) == [0.9] * 6


def test_elastic_shrink_restart_at_the_same_size_continues_its_segment():
    state = LoopState(world_size=2)
    segments.begin(state, 2, 1, warmup_steps=2, measure_steps=10)
    _run(state, 5, 0.5)
    segments.begin(state, 2, 1, warmup_steps=2, measure_steps=10)  # a restarted worker group
    assert len(state.segments) == 1 and (state.timed_from, state.end_step) == (2, 12)


def test_elastic_shrink_segment_resized_during_warm_up_has_no_timed_steps():
    state = LoopState(world_size=2)
    segments.begin(state, 2, 1, warmup_steps=3, measure_steps=4)
    _run(state, 1, 0.5)
    segments.begin(state, 1, 2, warmup_steps=3, measure_steps=4)
    _run(state, 100, 0.7)
    segs = segments.summaries(state.segments, state.step_times_s, 64)
    assert [s.steps for s in segs] == [0, 4] and segs[0].step_time_median_s is None


def test_elastic_shrink_tokens_per_s_is_the_final_segments():
    (planned,) = expand(StudySpec(name="e", model="llama2-tiny", hardware="cpu-local",
                                  world_size=2, global_batch=2,
                                  elastic={"min_workers": 1, "max_workers": 2},
                                  fault_tolerance={"max_failures": 1}))
    cfg = planned.config
    times = [0.2] * 6 + [0.5] * 4  # pooled, the median would be world 2's
    segs = [{"world_size": 2, "grad_accum": 1, "start_step": 0, "warmup_steps": 2,
             "first_timed": 0},
            {"world_size": 1, "grad_accum": 2, "start_step": 8, "warmup_steps": 2,
             "first_timed": 6}]
    summary = TrialSummary(
        step_times_s=times, losses=[1.0] * 10, world_size=1, grad_accum=2, segments=segs,
        restarts=1, time_lost_s=1.0,
        memory=MemoryPeaks(allocated_gib=0.1, reserved_gib=float("nan"),
                           device_used_gib=float("nan"), source="process_peak_rss"),
        meters=MeterResult(EnergyReading(float("nan"), 0.0, source="none", reason="restarted"),
                           1.0, CPU_UTILIZATION_CORES))
    r = summarize(cfg, summary, t0=0.0)
    assert r.status is Status.completed
    assert r.step_time_s == 0.5 != statistics.median(times)
    assert r.tokens_per_s == r.resizes[-1]["tokens_per_s"] == cfg.tokens_per_step / 0.5
    assert (r.world_size, r.grad_accum, r.global_batch) == (2, 1, 2)  # the config as planned
    assert r.extra["final_world_size"] == 1 and r.extra["final_grad_accum"] == 2
    assert [s["world_size"] for s in r.resizes] == [2, 1]
