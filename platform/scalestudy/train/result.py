"""A trial body's summary (rank 0's TrialSummary, train/summary.py) -> its TrialResult: the one
place a measured trial's metrics are derived (throughput, MFU, energy per token, the utilization
column, what is missing and why). No Ray here: the Ray Train adapter (launch/ray_train.py), warm
groups (launch/warm.py) and the torchrun adapter (train/local.py) share it."""

from __future__ import annotations

import math
import time
from typing import Any

from scalestudy import metrics as M
from scalestudy.measure.energy import EnergyReading, energy_metrics
from scalestudy.measure.meters import MeterResult
from scalestudy.measure.profiled_window import ProfiledWindow
from scalestudy.measure.throughput import throughput_metrics
from scalestudy.metrics import Status, TrialResult
from scalestudy.spec.trial import TrialConfig
from scalestudy.train import segments
from scalestudy.train.pipeline_summary import result_fields as pipeline_fields
from scalestudy.train.summary import MemoryPeaks, TrialSummary

NO_PROFILED_WINDOW = "no profiled window (steps.profile = 0 or instrumentation off)"


def failure_reason(err: BaseException) -> str:
    """First line of the root cause; out-of-memory gets its own reason so sweeps can count it."""
    text = str(err)
    cause = err
    while cause.__cause__ is not None:
        cause = cause.__cause__
    root = str(cause) or type(cause).__name__
    lines = [ln.strip() for ln in root.splitlines() if ln.strip()]
    first = lines[-1] if "Traceback" in root and lines else (lines[0] if lines else type(cause).__name__)
    # torch's CPU allocator says "can't allocate memory"; the OS's ENOMEM "Cannot allocate memory"
    oom_words = ("OutOfMemoryError", "CUDA out of memory", "out of memory", "can't allocate memory",
                 "Cannot allocate memory")
    if any(s in text for s in oom_words):
        return f"oom: {first}"
    return first


def ran_config(cfg: TrialConfig, world_size: int) -> TrialConfig:
    """The config the trial finished at: an elastic trial's last world size, at its layout."""
    if world_size == cfg.world_size:
        return cfg
    layout = cfg.layout.resized(world_size)
    return cfg.model_copy(update={"world_size": layout.world_size, "dp": layout.dp,
                                  "grad_accum": layout.grad_accum, "nodes": layout.nodes})


def _energy_fields(reading: EnergyReading, tokens: float) -> tuple[dict[str, Any], dict[str, str]]:
    """Energy, power per device, energy per token and tokens per joule of the timed window's
    ``tokens``: the one place they are computed."""
    fields: dict[str, Any] = {**energy_metrics(reading, tokens), "energy_source": reading.source}
    missing = {}
    if reading.source == "none":
        for name in (M.ENERGY_J, M.POWER_W, M.ENERGY_PER_TOKEN_J, M.TOKENS_PER_J):
            missing[name] = reading.reason or "no energy meter"
    return fields, missing


def _utilization_fields(meters: MeterResult) -> tuple[dict[str, float], dict[str, str]]:
    """The meters' figure under its own column (device % on GPU, cores busy on CPU)."""
    metric = meters.utilization_metric
    missing = {}
    if not math.isfinite(meters.utilization):
        missing[metric] = meters.utilization_reason or "no device was sampled"
    return {metric: meters.utilization}, missing


def _comm_fields(pw: ProfiledWindow | None) -> tuple[dict[str, Any], dict[str, str]]:
    if pw is None:
        return {}, {name: NO_PROFILED_WINDOW
                    for name in (M.COMM_TIME_S, M.COMM_EXPOSED_S, M.COMM_EXPOSED_FRACTION)}
    return {"comm": dict(pw.comm), M.COMM_TIME_S: pw.comm_time_s, M.COMM_EXPOSED_S: pw.comm_exposed_s,
            M.COMM_EXPOSED_FRACTION: pw.comm_exposed_fraction,
            M.STEP_TIME_S_PROFILED: pw.step_time_s_profiled}, {}


def _memory_fields(mem: MemoryPeaks) -> tuple[dict[str, Any], dict[str, str]]:
    return {M.PEAK_MEMORY_GIB: mem.allocated_gib, M.PEAK_MEMORY_RESERVED_GIB: mem.reserved_gib,
            M.DEVICE_MEMORY_USED_GIB: mem.device_used_gib, "memory_source": mem.source}, dict(mem.missing)


def _extra(s: TrialSummary, t0: float) -> dict[str, Any]:
    """What a result keeps beside its metrics: how they were taken."""
    e, pw = s.meters.energy, s.profiled
    return {
        "deepspeed_config": s.deepspeed_config,
        "comm_logger": {k: v.model_dump() for k, v in pw.comm_logger.items()} if pw else {},
        "comm_trace_device": pw.trace_device if pw else None,
        # how the comm figures were taken: steps touched, micro-batches traced per step, and the
        # accumulation they were extrapolated to (measure/profiled_window.py)
        "profiled_window": ({"steps": pw.n_steps, "micro_batches": pw.micro_batches_profiled,
                             "grad_accum": pw.grad_accum} if pw else None),
        "shard_shapes": s.shard_shapes,
        "final_world_size": s.world_size,
        "final_grad_accum": s.grad_accum,
        # What the measured energy covers (GPU boards only under NVML) and what was cut out.
        "energy_scope": e.scope,
        "energy_excluded_s": e.excluded_s,
        "energy_excluded_intervals": e.excluded_intervals,
        "utilization_metric": s.meters.utilization_metric,
        "worker_node_ids": s.worker_node_ids,
        # per restore: from/to world size, each rank's bytes read of the checkpoint and its shard
        "checkpoint_restores": s.restores,
        # where the trial's time went: epoch-second marks of rank 0 and the adapter
        # (train/timing.py), from the trial's start in its adapter
        "timing": {"trial_start": t0, **s.timing},
    }


def summarize(cfg: TrialConfig, s: TrialSummary, t0: float) -> TrialResult:
    """The completed trial's TrialResult from rank 0's summary; ``t0`` the trial's start (epoch s)."""
    # An elastic trial's earlier sizes are other trials: throughput is the final segment's.
    resizes = (segments.summaries(s.segments, s.step_times_s, cfg.tokens_per_step)
               if len(s.segments) > 1 else [])
    fields = throughput_metrics(ran_config(cfg, s.world_size),
                                segments.final_step_times(s.step_times_s, resizes))
    missing: dict[str, str] = {}
    for part, why in (_energy_fields(s.meters.energy, cfg.tokens_per_step * len(s.step_times_s)),
                      _utilization_fields(s.meters), _comm_fields(s.profiled),
                      _memory_fields(s.memory)):
        fields.update(part)
        missing.update(why)
    pipeline, why = pipeline_fields(s.pipeline, fields.get("comm"))  # pp > 1 only
    fields.update(pipeline)
    missing.update(why)
    first = s.first_measured_step_wall
    return TrialResult.from_config(
        cfg, Status.completed, **fields, missing=missing,
        loss_first=s.losses[0], loss_last=s.losses[-1], step_times_s=s.step_times_s,
        losses=s.losses, wall_time_s=time.time() - t0,
        time_to_first_step_s=(first - t0) if first else M.NAN,
        restarts=s.restarts, resizes=[r.model_dump() for r in resizes], time_lost_s=s.time_lost_s,
        extra=_extra(s, t0),
    )
