"""The profiled window: work after the timed window, under torch.profiler, bounded in micro-batches.

API
---
``profiled_micro_batches(grad_accum, cap=8) -> int``: how many micro-batches of a step are traced,
min(grad_accum, cap). At global batch 2,048 on 8 GPUs with micro-batch 1 a step has 256 micro-batches;
the window traces 8 of them, whatever the global batch, so a trace stays a few MB per rank.

``run_profiled_micro_batches(micro_batch_fn, grad_accum, *, cap=8, device, first_step=0, n_steps=1,
trace_path=None) -> ProfiledWindow`` (per rank; the body's choice after the timed window)

* ``micro_batch_fn(step, k)`` runs micro-batch ``k`` (0 .. grad_accum-1) of optimizer step ``step``:
  forward, backward and ``engine.step()`` (DeepSpeed steps the optimizer at the last micro-batch).
* For each of ``n_steps`` steps: micro-batches 0 .. grad_accum-n-1 run unprofiled (the step must be
  whole), then the ranks align and the last n = ``profiled_micro_batches(grad_accum, cap)`` run under
  the profiler, each annotated and closed by a device sync so its kernels fall inside it. The last
  one is marked as the step's boundary: it also holds the gradient reduction of ZeRO-0/1 and the
  optimizer step, which the others lack.
* Per-step figures = boundary micro-batch + (grad_accum - 1) x mean of the other profiled ones
  (``comm.extrapolate_per_step``). Scaled so: step time, comm time, exposed comm time, collective
  counts, bytes and bus bytes (all additive over micro-batches). Not scaled: the exposed fraction and
  the bandwidths, which are ratios of extrapolated figures. Exact when n = grad_accum.

``run_profiled_window(step_fn, n_steps, *, world_size, device, first_step=0, comms_logger=False,
trace_path=None) -> ProfiledWindow`` (older: whole steps; ``comms_logger=True`` adds n_steps more steps
with DeepSpeed's comms logger on and the profiler off, as a cross-check of counts and bytes).

Both annotate every collective with its group size while they run (``measure.comm_groups``), so the
bus bandwidth of each call uses its own group. Call them only after the timed window: the profiler
perturbs step times, and ``step_time_s_profiled`` is for reference, never for throughput.

``reduce_across_ranks(pw, device) -> ProfiledWindow`` (collective) combines ranks with one all_reduce:
``step_time_s_profiled`` is the max; comm times, the exposed fraction and every per-kind count, bytes,
bus bytes and time are means over ranks; bandwidths are recomputed from the means.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scalestudy import metrics as M
from scalestudy.metrics import CollectiveStats
from scalestudy.measure.comm import (
    collective_stats, extrapolate_per_step, stats_from_comms_logger, stats_from_trace,
)
from scalestudy.measure.comm_groups import annotate_group_sizes
from scalestudy.measure.overlap import (
    BOUNDARY_ANNOTATION, KINDS, MICRO_ANNOTATION, STEP_ANNOTATION, TraceIntervals, clip, exposed_time,
    intervals_from_chrome_trace, load_chrome_trace, measure,
)

NAN = float("nan")
MICRO_BATCH_CAP = 8


def profiled_micro_batches(grad_accum: int, cap: int = MICRO_BATCH_CAP) -> int:
    """Micro-batches of one step the window traces: min(grad_accum, cap). ``cap`` >= 2, so a window
    of a multi-micro-batch step always holds a plain micro-batch besides the boundary one."""
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    if cap < 2:
        raise ValueError(f"cap must be >= 2 (a boundary micro-batch and a plain one), got {cap}")
    return min(grad_accum, cap)


@dataclass
class ProfiledWindow:
    n_steps: int  # optimizer steps the window touched (wholly or their last micro-batches)
    step_time_s_profiled: float  # per step (perturbed by the profiler; extrapolated)
    comm_time_s: float  # per step: time with >= 1 collective in flight
    comm_exposed_s: float  # per step: collective in flight and no compute running
    comm_exposed_fraction: float  # comm_exposed_s / step time (in the trace), in [0, 1]
    comm: dict[str, CollectiveStats] = field(default_factory=dict)  # per step, from the trace
    comm_logger: dict[str, CollectiveStats] = field(default_factory=dict)  # per step, cross-check
    trace_device: str = "cpu"
    trace_path: str | None = None
    grad_accum: int = 1  # micro-batches per step the figures are extrapolated to (1: whole steps)
    micro_batches_profiled: int = 0  # per step; 0 when whole steps were profiled

    def summary(self) -> dict[str, Any]:
        """JSON-ready fields named as in TrialResult (comm, comm_time_s, ...) plus extras."""
        return {
            M.COMM_TIME_S: self.comm_time_s,
            M.COMM_EXPOSED_S: self.comm_exposed_s,
            M.COMM_EXPOSED_FRACTION: self.comm_exposed_fraction,
            "comm": {k: v.model_dump() for k, v in self.comm.items()},
            "comm_logger": {k: v.model_dump() for k, v in self.comm_logger.items()},
            M.STEP_TIME_S_PROFILED: self.step_time_s_profiled,
            "steps_profiled": self.n_steps,
            "micro_batches_profiled": self.micro_batches_profiled,
            "profiled_grad_accum": self.grad_accum,
            "comm_trace_device": self.trace_device,
        }


def window_figures(ti: TraceIntervals, grad_accum: int = 1) -> tuple[float, float, float]:
    """(comm_time_s, comm_exposed_s, comm_exposed_fraction) per step from parsed intervals.

    Only the annotated units count; each unit's comm and exposed time is taken inside it and the
    fraction uses the units' own spans in the trace, so numerator and denominator share one clock."""
    if not ti.units:
        return NAN, NAN, NAN
    comm_us, exposed_us, span_us = [], [], []
    for unit in ti.units:
        comm = clip(ti.comm, unit)
        comm_us.append(measure(comm))
        exposed_us.append(exposed_time(comm, clip(ti.compute, unit)))
        span_us.append(unit[1] - unit[0])
    comm_s, exposed_s, step_s = (extrapolate_per_step(v, ti.unit_boundary, grad_accum) * 1e-6
                                 for v in (comm_us, exposed_us, span_us))
    return comm_s, exposed_s, exposed_s / step_s if step_s > 0 else NAN


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def _align_ranks(device: Any) -> None:
    """Barrier outside any measured region: otherwise the first collective of a window absorbs the
    ranks' skew from what came before (trace export, the previous window) and reads as slow comm."""
    import torch.distributed as dist

    _sync(device)
    if dist.is_initialized():
        dist.barrier()


def _activities(device: Any) -> list:
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU]
    if getattr(device, "type", str(device)) == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


def _timed_unit(name: str, fn: Callable[[], Any], device: Any) -> float:
    """Run ``fn`` inside annotation ``name``, closed by a device sync; its wall seconds."""
    from torch.profiler import record_function

    t = time.perf_counter()
    with record_function(name):
        fn()
        _sync(device)
    return time.perf_counter() - t


def _parse(prof: Any, trace_path: str | None) -> TraceIntervals:
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return intervals_from_chrome_trace(load_chrome_trace(path))


def _window(ti: TraceIntervals, wall_s: list[float], boundary: list[bool], grad_accum: int,
            n_steps: int, trace_path: str | None, micro: int) -> ProfiledWindow:
    comm_s, exposed_s, frac = window_figures(ti, grad_accum)
    return ProfiledWindow(
        n_steps=n_steps,
        step_time_s_profiled=extrapolate_per_step(wall_s, boundary, grad_accum),
        comm_time_s=comm_s, comm_exposed_s=exposed_s, comm_exposed_fraction=frac,
        comm=stats_from_trace(ti, grad_accum), trace_device=ti.device, trace_path=trace_path,
        grad_accum=grad_accum, micro_batches_profiled=micro,
    )


def run_profiled_micro_batches(
    micro_batch_fn: Callable[[int, int], Any],
    grad_accum: int,
    *,
    cap: int = MICRO_BATCH_CAP,
    device: Any = "cpu",
    first_step: int = 0,
    n_steps: int = 1,
    trace_path: str | None = None,
) -> ProfiledWindow:
    """Profile the last ``profiled_micro_batches(grad_accum, cap)`` micro-batches of ``n_steps``
    steps (see the module docstring). ``trace_path`` keeps the chrome trace (of a one-step window)."""
    from torch.profiler import profile

    if n_steps < 1:
        raise ValueError("n_steps must be >= 1")
    n = profiled_micro_batches(grad_accum, cap)
    wall_s: list[float] = []
    boundary: list[bool] = []
    traces: list[TraceIntervals] = []
    with annotate_group_sizes():
        for step in range(first_step, first_step + n_steps):
            for k in range(grad_accum - n):
                micro_batch_fn(step, k)
            _align_ranks(device)
            # One profiler session per step: the unprofiled micro-batches stay out of the trace.
            with profile(activities=_activities(device), record_shapes=True) as prof:
                for k in range(grad_accum - n, grad_accum):
                    last = k == grad_accum - 1
                    name = BOUNDARY_ANNOTATION if last else MICRO_ANNOTATION
                    wall_s.append(_timed_unit(name, lambda: micro_batch_fn(step, k), device))
                    boundary.append(last)
            traces.append(_parse(prof, trace_path if n_steps == 1 else None))
    return _window(functools.reduce(_concat, traces), wall_s, boundary, grad_accum, n_steps,
                   trace_path if n_steps == 1 else None, n)


def _concat(a: TraceIntervals, b: TraceIntervals) -> TraceIntervals:
    """Two parsed traces of one process (one clock) as one."""
    kinds = set(a.comm_by_kind) | set(b.comm_by_kind)
    return TraceIntervals(
        device="gpu" if "gpu" in (a.device, b.device) else "cpu",
        comm=a.comm + b.comm, compute=a.compute + b.compute,
        comm_by_kind={k: a.comm_by_kind.get(k, []) + b.comm_by_kind.get(k, []) for k in kinds},
        calls=a.calls + b.calls, units=a.units + b.units, unit_boundary=a.unit_boundary + b.unit_boundary,
    )


def run_profiled_window(
    step_fn: Callable[[int], Any],
    n_steps: int,
    *,
    world_size: int,
    device: Any = "cpu",
    first_step: int = 0,
    comms_logger: bool = False,
    trace_path: str | None = None,
) -> ProfiledWindow:
    """Profile ``n_steps`` whole steps (see the module docstring). ``world_size`` only converts the
    comms logger's all_gather sizes; bus bandwidths use each call's own group."""
    from torch.profiler import profile

    if n_steps < 1:
        raise ValueError("n_steps must be >= 1")
    wall_s = []
    _align_ranks(device)
    # record_shapes: collective sizes are read from the c10d ops' argument shapes.
    with annotate_group_sizes(), profile(activities=_activities(device), record_shapes=True) as prof:
        for k in range(n_steps):
            wall_s.append(_timed_unit(STEP_ANNOTATION, lambda: step_fn(first_step + k), device))
    pw = _window(_parse(prof, trace_path), wall_s, [True] * n_steps, 1, n_steps, trace_path, 0)
    if comms_logger:
        pw.comm_logger = _run_with_comms_logger(step_fn, n_steps, first_step + n_steps, world_size, device)
    return pw


def _run_with_comms_logger(step_fn, n_steps, first_step, world_size, device) -> dict[str, CollectiveStats]:
    """n_steps with deepspeed.comm's logger on, then off again; its data is cleared before and after."""
    import deepspeed.comm as ds_comm

    logger = ds_comm.comms_logger
    was = (logger.enabled, logger.prof_all)
    _align_ranks(device)
    ds_comm.reset_log()
    ds_comm.configure(enabled=True, prof_all=True)
    try:
        for k in range(n_steps):
            step_fn(first_step + k)
        _sync(device)
        data = {op: {size: [v[0], list(v[1])] for size, v in by.items()}
                for op, by in logger.comms_dict.items()}
    finally:
        ds_comm.configure(enabled=was[0], prof_all=was[1])
        ds_comm.reset_log()
    return stats_from_comms_logger(data, world_size, n_steps)


# --- reduction across ranks -----------------------------------------------------------------------

_STATS = ("count", "bytes", "time_s", "bus_bytes")


def _pack(pw: ProfiledWindow) -> list[float]:
    vals = [pw.comm_time_s, pw.comm_exposed_s, pw.comm_exposed_fraction]
    for src in (pw.comm, pw.comm_logger):
        for kind in KINDS:
            st = src.get(kind)
            vals += [getattr(st, s) if st else 0.0 for s in _STATS]
    return vals


def _unpack(pw: ProfiledWindow, mean: list[float], step_max: float) -> ProfiledWindow:
    it = iter(mean[3:])
    dicts = []
    for _ in range(2):
        d = {}
        for kind in KINDS:
            c, b, t, bb = next(it), next(it), next(it), next(it)
            if c or b or t:
                d[kind] = collective_stats(kind, c, b, t, bb)
        dicts.append(d)
    return ProfiledWindow(
        n_steps=pw.n_steps, step_time_s_profiled=step_max, comm_time_s=mean[0], comm_exposed_s=mean[1],
        comm_exposed_fraction=mean[2], comm=dicts[0], comm_logger=dicts[1],
        trace_device=pw.trace_device, trace_path=pw.trace_path, grad_accum=pw.grad_accum,
        micro_batches_profiled=pw.micro_batches_profiled,
    )


def reduce_across_ranks(pw: ProfiledWindow, device: Any = "cpu", group: Any = None) -> ProfiledWindow:
    """Means over ranks (max for the step time); see the module docstring. Collective call."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return pw
    n = dist.get_world_size(group)
    vals = torch.tensor(_pack(pw), dtype=torch.float64, device=device)
    # NaN (no steps annotated, a call's group unknown) stays NaN through the sum: missing, not zero.
    dist.all_reduce(vals, op=dist.ReduceOp.SUM, group=group)
    step = torch.tensor([pw.step_time_s_profiled], dtype=torch.float64, device=device)
    dist.all_reduce(step, op=dist.ReduceOp.MAX, group=group)
    mean = (vals / n).cpu().tolist()
    return _unpack(pw, mean, float(step.item()))
