"""Run one trial for real: a Ray Train TorchTrainer with world_size DeepSpeed workers, each running
the trial body (train/body.py) through the Ray Train adapter (train/worker.py)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from scalestudy.metrics import Status, TrialResult
from scalestudy.spec.trial import TrialConfig
from scalestudy.train.result import failure_reason, summarize

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


def run_trial(
    cfg: TrialConfig,
    storage_path: str | Path,
    t0: float | None = None,
    fault: str | None = None,
    callbacks: list | None = None,
    instrument: bool = True,
    storage_filesystem=None,
) -> TrialResult:
    """Run the trial and return its TrialResult; a failing trial returns status `failed`.

    `fault` ("RUN_NAME@STEP" or "*@STEP", from $SCALESTUDY_INJECT_FAULT) makes rank 0 raise at that
    step: the failure-path tests use it to fail a real trial on purpose. `storage_path` and
    `storage_filesystem` are Ray Train's (track/storage.py's ray_storage makes them from a results
    root): a Path is made absolute, a string (a URI) goes to Ray untouched. They hold checkpoints
    only: the summary comes back through a TrialChannel actor."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from scalestudy.train.channel import open_channel, receive
    from scalestudy.train.worker import train_loop_per_worker

    t0 = time.time() if t0 is None else t0
    gpu = cfg.hardware_profile.kind == "gpu"
    channel = open_channel()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"trial": cfg.model_dump(mode="json"), "fault": fault,
                           "instrument": instrument, "channel": channel},
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
            storage_path=(str(storage_path.resolve()) if isinstance(storage_path, Path)
                          else storage_path),
            storage_filesystem=storage_filesystem,
            failure_config=FailureConfig(max_failures=cfg.fault_tolerance.max_failures),
            # A restart needs only the latest checkpoint; a long trial would otherwise keep them all.
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            callbacks=callbacks or [],
        ),
    )
    try:
        trainer.fit()
        summary = receive(channel)
    except Exception as err:  # noqa: BLE001 - any trial failure is a recorded outcome
        return TrialResult.from_config(
            cfg, Status.failed, reason=failure_reason(err), wall_time_s=time.time() - t0
        )
    if summary is None:
        return TrialResult.from_config(cfg, Status.failed, wall_time_s=time.time() - t0,
                                       reason="the trial ended without rank 0's summary")
    return summarize(cfg, summary, t0)
