"""A trial body's summary (rank 0's dict, see train/body.py) -> its TrialResult. No Ray here: the
Ray Train adapter (train/launch.py) and the torchrun adapter (train/local.py) share it."""

from __future__ import annotations

import time
from typing import Any

from scalestudy import metrics as M
from scalestudy.measure.energy import EnergyReading, energy_metrics
from scalestudy.measure.throughput import throughput_metrics
from scalestudy.metrics import CollectiveStats, Status, TrialResult
from scalestudy.spec.trial import TrialConfig
from scalestudy.train.segments import final_step_times

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
    if any(s in text for s in ("OutOfMemoryError", "CUDA out of memory", "out of memory")):
        return f"oom: {first}"
    return first


def ran_config(cfg: TrialConfig, summary: dict[str, Any]) -> TrialConfig:
    """The config the trial finished at: an elastic trial's last world size, at its layout."""
    world = summary.get("world_size", cfg.world_size)
    if world == cfg.world_size:
        return cfg
    layout = cfg.layout.resized(world)
    return cfg.model_copy(update={"world_size": layout.world_size, "dp": layout.dp,
                                  "grad_accum": layout.grad_accum, "nodes": layout.nodes})


def _energy_fields(cfg: TrialConfig, summary: dict[str, Any], n_steps: int
                   ) -> tuple[dict[str, Any], dict[str, str]]:
    reading = EnergyReading(summary["energy_j"], 0.0, {}, summary["energy_source"],
                            summary.get("energy_reason"))
    fields: dict[str, Any] = energy_metrics(reading, cfg.tokens_per_step * n_steps)
    fields[M.POWER_W] = summary["power_w"]
    fields["energy_source"] = reading.source
    missing = {}
    if reading.source == "none":
        for name in (M.ENERGY_J, M.POWER_W, M.ENERGY_PER_TOKEN_J, M.TOKENS_PER_J):
            missing[name] = reading.reason or "no energy meter"
    return fields, missing


def _comm_fields(summary: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    fields: dict[str, Any] = {"comm": {k: CollectiveStats(**v)
                                       for k, v in summary.get("comm", {}).items()}}
    for name in (M.COMM_TIME_S, M.COMM_EXPOSED_S, M.COMM_EXPOSED_FRACTION, M.STEP_TIME_S_PROFILED):
        if name in summary:
            fields[name] = summary[name]
    missing = {}
    if M.COMM_TIME_S not in summary:
        missing = {name: NO_PROFILED_WINDOW
                   for name in (M.COMM_TIME_S, M.COMM_EXPOSED_S, M.COMM_EXPOSED_FRACTION)}
    return fields, missing


def summarize(cfg: TrialConfig, summary: dict[str, Any], t0: float) -> TrialResult:
    step_times, losses = summary["step_times_s"], summary["losses"]
    # Throughput of the final segment only: an elastic trial's earlier sizes are other trials.
    fields = throughput_metrics(ran_config(cfg, summary),
                                final_step_times(step_times, summary.get("resizes")))
    energy, missing = _energy_fields(cfg, summary, len(step_times))
    comm, comm_missing = _comm_fields(summary)
    missing.update(comm_missing)
    missing.update(summary.get("memory_missing", {}))
    gpu = cfg.hardware_profile.kind == "gpu" and summary.get("utilization_kind") == "NvmlUtilization"
    util = {M.DEVICE_UTILIZATION_PCT if gpu else M.CPU_UTILIZATION_CORES: summary["utilization"]}
    first = summary.get("first_measured_step_wall")
    return TrialResult.from_config(
        cfg, Status.completed, **fields, **energy, **util, **comm, missing=missing,
        peak_memory_gib=summary["peak_memory_gib"], memory_source=summary["memory_source"],
        peak_memory_reserved_gib=summary.get("peak_memory_reserved_gib", M.NAN),
        device_memory_used_gib=summary.get("device_memory_used_gib", M.NAN),
        loss_first=losses[0], loss_last=losses[-1], step_times_s=step_times, losses=losses,
        wall_time_s=time.time() - t0,
        time_to_first_step_s=(first - t0) if first else M.NAN,
        restarts=summary["restarts"], resizes=summary["resizes"],
        time_lost_s=summary["time_lost_s"],
        extra={"deepspeed_config": summary["deepspeed_config"],
               "comm_logger": summary.get("comm_logger", {}),
               "comm_trace_device": summary.get("comm_trace_device"),
               "shard_shapes": summary.get("shard_shapes"),
               "final_world_size": summary.get("world_size", cfg.world_size),
               "final_grad_accum": summary.get("grad_accum"),
               # What the measured energy covers (GPU boards only under NVML) and what was cut out.
               "energy_scope": summary.get("energy_scope"),
               "energy_excluded_s": summary.get("energy_excluded_s"),
               "utilization_metric": summary.get("utilization_metric"),
               "worker_node_ids": summary.get("worker_node_ids"),
               # where the trial's time went: epoch-second marks of rank 0 and the adapter
               # (train/timing.py), from the trial's start in its adapter
               "timing": {"trial_start": t0, **summary.get("timing", {})}},
    )
