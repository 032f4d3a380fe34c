"""The profiled window: a few extra steps after the timed window, under torch.profiler.

API
---
``run_profiled_window(step_fn, n_steps, *, world_size, device, first_step=0, comms_logger=False,
trace_path=None) -> ProfiledWindow`` (per rank)

* ``step_fn(step: int)`` runs one full optimizer step (all micro-batches); its return value is ignored.
* Runs ``n_steps`` steps under ``torch.profiler`` (CPU activity, plus CUDA when ``device`` is cuda),
  each step wrapped in a ``scalestudy.profiled_step`` annotation and closed by a device sync so its
  kernels fall inside it. The trace gives comm time, exposed comm and the per-collective breakdown
  (``scalestudy.measure.comm.stats_from_trace``).
* ``comms_logger=True`` additionally runs ``n_steps`` more steps with DeepSpeed's comms logger on (and
  the profiler off, because the logger synchronises after every collective) and returns that breakdown in
  ``comm_logger`` as a cross-check. Off by default: it costs steps and its times are not overlap-safe.
* Call it only after the timed window: the profiler and logger perturb step times, and
  ``step_time_s_profiled`` is for reference, never for throughput.

``reduce_across_ranks(pw, device) -> ProfiledWindow`` (collective: every rank must call it) combines
ranks with one all_reduce: ``step_time_s_profiled`` is the max (the slowest rank sets the step, as in the
timed window); ``comm_time_s``, ``comm_exposed_s``, ``comm_exposed_fraction`` and every per-kind count,
bytes and time are means over ranks (the per-device figure the paper plots; each rank's fraction is in
[0, 1], so the mean is too); bandwidths are recomputed from the mean bytes and times.

Example (worker.py, after the timed window, before the final reduction)::

    from scalestudy.measure.profiled_window import run_profiled_window, reduce_across_ranks
    pw = run_profiled_window(lambda s: one_step(n_steps + s), cfg.steps.profile,
                             world_size=dist.get_world_size(), device=device)
    pw = reduce_across_ranks(pw, device)
    summary.update(pw.summary())   # comm_time_s, comm_exposed_s, comm_exposed_fraction, comm, ...
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scalestudy.metrics import CollectiveStats
from scalestudy.measure.comm import collective_stats, stats_from_comms_logger, stats_from_trace
from scalestudy.measure.overlap import (
    KINDS, STEP_ANNOTATION, TraceIntervals, clip, exposed_time, intervals_from_chrome_trace,
    load_chrome_trace, measure,
)

NAN = float("nan")


@dataclass
class ProfiledWindow:
    n_steps: int
    step_time_s_profiled: float  # mean wall time of a profiled step (perturbed by the profiler)
    comm_time_s: float  # per step: time with >= 1 collective in flight
    comm_exposed_s: float  # per step: collective in flight and no compute running
    comm_exposed_fraction: float  # comm_exposed_s / step time (in the trace), in [0, 1]
    comm: dict[str, CollectiveStats] = field(default_factory=dict)  # per step, from the trace
    comm_logger: dict[str, CollectiveStats] = field(default_factory=dict)  # per step, cross-check
    trace_device: str = "cpu"
    trace_path: str | None = None

    def summary(self) -> dict[str, Any]:
        """JSON-ready fields named as in TrialResult (comm, comm_time_s, ...) plus extras."""
        return {
            "comm_time_s": self.comm_time_s,
            "comm_exposed_s": self.comm_exposed_s,
            "comm_exposed_fraction": self.comm_exposed_fraction,
            "comm": {k: v.model_dump() for k, v in self.comm.items()},
            "comm_logger": {k: v.model_dump() for k, v in self.comm_logger.items()},
            "step_time_s_profiled": self.step_time_s_profiled,
            "steps_profiled": self.n_steps,
            "comm_trace_device": self.trace_device,
        }


def window_figures(ti: TraceIntervals, n_steps: int) -> tuple[float, float, float]:
    """(comm_time_s, comm_exposed_s, comm_exposed_fraction) per step from parsed intervals.

    Only the annotated steps count; the fraction uses the steps' own span in the trace so that
    numerator and denominator come from the same clock."""
    if not ti.steps:
        return NAN, NAN, NAN
    step_us = measure(ti.steps)
    comm = [iv for s in ti.steps for iv in clip(ti.comm, s)]
    compute = [iv for s in ti.steps for iv in clip(ti.compute, s)]
    comm_us = measure(comm)
    exposed_us = exposed_time(comm, compute)
    frac = exposed_us / step_us if step_us > 0 else NAN
    return comm_us * 1e-6 / n_steps, exposed_us * 1e-6 / n_steps, frac


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
    """Profile ``n_steps`` steps (see the module docstring). ``trace_path`` keeps the chrome trace."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if n_steps < 1:
        raise ValueError("n_steps must be >= 1")
    activities = [ProfilerActivity.CPU]
    if getattr(device, "type", str(device)) == "cuda":
        activities.append(ProfilerActivity.CUDA)

    step_times = []
    _align_ranks(device)
    # record_shapes: collective sizes are read from the c10d ops' argument shapes.
    with profile(activities=activities, record_shapes=True) as prof:
        for k in range(n_steps):
            t = time.perf_counter()
            with record_function(STEP_ANNOTATION):
                step_fn(first_step + k)
                _sync(device)
            step_times.append(time.perf_counter() - t)
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        ti = intervals_from_chrome_trace(load_chrome_trace(path))
    comm_s, exposed_s, frac = window_figures(ti, n_steps)

    logged: dict[str, CollectiveStats] = {}
    if comms_logger:
        logged = _run_with_comms_logger(step_fn, n_steps, first_step + n_steps, world_size, device)
    return ProfiledWindow(
        n_steps=n_steps,
        step_time_s_profiled=sum(step_times) / n_steps,
        comm_time_s=comm_s,
        comm_exposed_s=exposed_s,
        comm_exposed_fraction=frac,
        comm=stats_from_trace(ti, world_size, n_steps),
        comm_logger=logged,
        trace_device=ti.device,
        trace_path=trace_path,
    )


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

_STATS = ("count", "bytes", "time_s")


def _pack(pw: ProfiledWindow) -> list[float]:
    vals = [pw.comm_time_s, pw.comm_exposed_s, pw.comm_exposed_fraction]
    for src in (pw.comm, pw.comm_logger):
        for kind in KINDS:
            st = src.get(kind)
            vals += [getattr(st, s) if st else 0.0 for s in _STATS]
    return vals


def _unpack(pw: ProfiledWindow, mean: list[float], step_max: float, world_size: int) -> ProfiledWindow:
    it = iter(mean[3:])
    dicts = []
    for _ in range(2):
        d = {}
        for kind in KINDS:
            c, b, t = next(it), next(it), next(it)
            if c or b or t:
                d[kind] = collective_stats(kind, c, b, t, world_size)
        dicts.append(d)
    return ProfiledWindow(
        n_steps=pw.n_steps, step_time_s_profiled=step_max, comm_time_s=mean[0], comm_exposed_s=mean[1],
        comm_exposed_fraction=mean[2], comm=dicts[0], comm_logger=dicts[1],
        trace_device=pw.trace_device, trace_path=pw.trace_path,
    )


def reduce_across_ranks(pw: ProfiledWindow, device: Any = "cpu", group: Any = None) -> ProfiledWindow:
    """Means over ranks (max for the step time); see the module docstring. Collective call."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return pw
    n = dist.get_world_size(group)
    vals = torch.tensor(_pack(pw), dtype=torch.float64, device=device)
    # NaN (no steps annotated) stays NaN through the sum, which is what we want: missing, not zero.
    dist.all_reduce(vals, op=dist.ReduceOp.SUM, group=group)
    step = torch.tensor([pw.step_time_s_profiled], dtype=torch.float64, device=device)
    dist.all_reduce(step, op=dist.ReduceOp.MAX, group=group)
    mean = (vals / n).cpu().tolist()
    return _unpack(pw, mean, float(step.item()), n)
