"""Run one trial for real: a Ray Train TorchTrainer with world_size DeepSpeed workers."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path

from scalestudy import metrics as M
from scalestudy.measure.energy import EnergyReading, energy_metrics
from scalestudy.measure.throughput import throughput_metrics
from scalestudy.metrics import CollectiveStats, Status, TrialResult
from scalestudy.spec.study import TrialConfig
from scalestudy.train.worker import SUMMARY_FILE, train_loop_per_worker

# Ray Train v2's controller polls workers every 2 s by default, which adds ~2 s to each report and
# to the end of every trial; 0.2 s costs nothing measurable on a trial and saves most of that.
RAY_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}


def ensure_ray(verbose: bool = False, **init_kwargs) -> None:
    """Join RAY_ADDRESS when set (e.g. under `ray job submit`), else start a local instance."""
    import ray

    if ray.is_initialized():
        return
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    ray.init(
        address=os.environ.get("RAY_ADDRESS") or None,
        runtime_env={"env_vars": {k: os.environ[k] for k in RAY_ENV}},
        include_dashboard=False if not os.environ.get("RAY_ADDRESS") else None,
        log_to_driver=verbose,
        logging_level=logging.INFO if verbose else logging.WARNING,
        **init_kwargs,
    )


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


def run_trial(
    cfg: TrialConfig,
    storage_path: Path,
    t0: float | None = None,
    fault: str | None = None,
    callbacks: list | None = None,
    instrument: bool = True,
) -> TrialResult:
    """Run the trial and return its TrialResult; a failing trial returns status `failed`.

    `fault` ("RUN_NAME@STEP" or "*@STEP", from $SCALESTUDY_INJECT_FAULT) makes rank 0 raise at that
    step: the failure-path tests use it to fail a real trial on purpose."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    t0 = time.time() if t0 is None else t0
    gpu = cfg.hardware_profile.kind == "gpu"
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"trial": cfg.model_dump(mode="json"), "fault": fault,
                           "instrument": instrument},
        scaling_config=ScalingConfig(
            num_workers=((cfg.elastic.min_workers, cfg.elastic.max_workers) if cfg.elastic
                         else cfg.world_size),
            use_gpu=gpu,
            resources_per_worker={"GPU": 1, "CPU": 8} if gpu else {"CPU": 1},
            **({"elastic_resize_monitor_interval_s": cfg.elastic.resize_check_s}
               if cfg.elastic else {}),
        ),
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
        run_config=RunConfig(
            name=f"{cfg.study}-{cfg.run_name}-{cfg.trial_id}-{uuid.uuid4().hex[:6]}",
            storage_path=str(Path(storage_path).resolve()),
            failure_config=FailureConfig(max_failures=cfg.fault_tolerance.max_failures),
            # A restart needs only the latest checkpoint; a long trial would otherwise keep them all.
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            callbacks=callbacks or [],
        ),
    )
    try:
        result = trainer.fit()
        with result.checkpoint.as_directory() as d:
            summary = json.loads((Path(d) / SUMMARY_FILE).read_text())
    except Exception as err:  # noqa: BLE001 - any trial failure is a recorded outcome
        return TrialResult.from_config(
            cfg, Status.failed, reason=failure_reason(err), wall_time_s=time.time() - t0
        )
    return summarize(cfg, summary, t0)


def summarize(cfg: TrialConfig, summary: dict, t0: float) -> TrialResult:
    step_times = summary["step_times_s"]
    losses = summary["losses"]
    world = summary.get("world_size", cfg.world_size)
    ran = cfg if world == cfg.world_size else cfg.model_copy(update={  # an elastic trial's real size
        "world_size": world, "dp": summary["dp"], "grad_accum": summary["grad_accum"]})
    fields = throughput_metrics(ran, step_times)
    first = summary.get("first_measured_step_wall")
    missing: dict[str, str] = {}
    reading = EnergyReading(summary["energy_j"], 0.0, {}, summary["energy_source"],
                            summary.get("energy_reason"))
    energy = energy_metrics(reading, cfg.tokens_per_step * len(step_times))
    energy[M.POWER_W] = summary["power_w"]
    if reading.source == "none":
        for name in (M.ENERGY_J, M.POWER_W, M.ENERGY_PER_TOKEN_J, M.TOKENS_PER_J):
            missing[name] = reading.reason or "no energy meter"
    comm = {k: CollectiveStats(**v) for k, v in summary.get("comm", {}).items()}
    if "comm_time_s" not in summary:
        for name in (M.COMM_TIME_S, M.COMM_EXPOSED_S, M.COMM_EXPOSED_FRACTION):
            missing[name] = "no profiled window (steps.profile = 0 or instrumentation off)"
    gpu = cfg.hardware_profile.kind == "gpu" and summary.get("utilization_kind") == "NvmlUtilization"
    util = {M.DEVICE_UTILIZATION_PCT if gpu else M.CPU_UTILIZATION_CORES: summary["utilization"]}
    return TrialResult.from_config(
        cfg,
        Status.completed,
        **fields,
        **energy,
        **util,
        energy_source=reading.source,
        comm=comm,
        comm_time_s=summary.get("comm_time_s", M.NAN),
        comm_exposed_s=summary.get("comm_exposed_s", M.NAN),
        comm_exposed_fraction=summary.get("comm_exposed_fraction", M.NAN),
        step_time_s_profiled=summary.get("step_time_s_profiled", M.NAN),
        missing=missing,
        peak_memory_gib=summary["peak_memory_gib"],
        memory_source=summary["memory_source"],
        loss_first=losses[0],
        loss_last=losses[-1],
        step_times_s=step_times,
        losses=losses,
        wall_time_s=time.time() - t0,
        time_to_first_step_s=(first - t0) if first else M.NAN,
        restarts=summary["restarts"],
        resizes=summary["resizes"],
        time_lost_s=summary["time_lost_s"],
        extra={"deepspeed_config": summary["deepspeed_config"],
               "comm_logger": summary.get("comm_logger", {}),
               "comm_trace_device": summary.get("comm_trace_device"),
               "shard_shapes": summary.get("shard_shapes"),
               "final_world_size": world, "final_grad_accum": summary.get("grad_accum")},
    )
