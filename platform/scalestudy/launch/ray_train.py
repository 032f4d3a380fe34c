"""Run one trial for real: a Ray Train TorchTrainer with world_size DeepSpeed workers, each running
the trial body (train/body.py) through the Ray Train adapter (launch/worker.py)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from scalestudy.metrics import Status, TrialResult
from scalestudy.spec.trial import TrialConfig
from scalestudy.launch.placement import (HEALTH_CHECK_ENV, LOCAL_HEALTH_CHECK_S,
                                        health_check_interval_s, local_gpu_devices, local_shortfall,
                                        placement_for, sized_accelerator_resources)
from scalestudy.spec import catalog
from scalestudy.train.result import failure_reason, summarize

# Ray Train v2's controller polls workers every 2 s by default, which adds ~2 s to each report and
# to the end of every trial; 0.2 s costs nothing measurable on a local trial and saves most of that.
# The job-wide default; run_trial sets each trial's own (launch/placement.py) before it starts.
RAY_ENV = {HEALTH_CHECK_ENV: str(LOCAL_HEALTH_CHECK_S)}


def ensure_ray(verbose: bool = False, **init_kwargs) -> None:
    """Join RAY_ADDRESS when set (e.g. under `ray job submit`), else start a local instance."""
    import ray

    if ray.is_initialized():
        return
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    if not os.environ.get("RAY_ADDRESS"):
        # A Ray of our own on a GPU machine: declare the sized accelerator type the catalogue's
        # profile asks for (A100-80G), which Ray does not (launch/placement.py), or an A100 trial
        # would be turned away as unplaceable. Resources the caller gives win.
        sized = sized_accelerator_resources(
            local_gpu_devices(), [catalog.get_hardware(n) for n in catalog.hardware_names()])
        if sized:
            init_kwargs["resources"] = {**sized, **(init_kwargs.get("resources") or {})}
    ray.init(
        address=os.environ.get("RAY_ADDRESS") or None,
        runtime_env={"env_vars": {k: os.environ[k] for k in RAY_ENV}},
        include_dashboard=False if not os.environ.get("RAY_ADDRESS") else None,
        log_to_driver=verbose,
        logging_level=logging.INFO if verbose else logging.WARNING,
        **init_kwargs,
    )


def fixed_local_resources() -> dict[str, float] | None:
    """The Ray instance's total resources when this process started it itself (a head of its own:
    no autoscaler, nothing more will come), else None (a cluster joined, which may grow)."""
    import ray
    from ray._private import worker as ray_worker  # private: read defensively below

    # Ray's driver keeps the node it started or connected to; `head` is True only for one it
    # started (a connection to a running cluster is made with head=False, connect_only=True).
    node = getattr(ray_worker, "_global_node", None)
    if node is None or getattr(node, "head", False) is not True:
        return None
    return {k: float(v) for k, v in ray.cluster_resources().items()}


def unplaceable(cfg: TrialConfig, available: dict[str, float] | None,
                t0: float) -> TrialResult | None:
    """The trial's result when a Ray instance of fixed resources can never hold it, else None
    (available None: a cluster joined, which may grow)."""
    reason = local_shortfall(cfg, available) if available is not None else None
    if reason is None:
        return None
    return TrialResult.from_config(cfg, Status.timeout, reason=reason,
                                   wall_time_s=time.time() - t0)


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
    only: the summary comes back through a TrialChannel actor, which also tells this process when
    the worker group started (launch/deadline.py: placement_timeout_s, then trial_timeout_s)."""
    from scalestudy.launch.node_leases import PlacementWait, pinned_selectors, release_nodes
    from scalestudy.launch.storage_probe import visibility_marker
    from scalestudy.train.resume import wants_checkpoints

    t0 = time.time() if t0 is None else t0
    holder = f"{cfg.trial_id}-{uuid.uuid4().hex[:8]}"
    try:
        placement = placement_for(cfg, pinned_selectors(cfg, holder, t0))
    except PlacementWait as err:
        return TrialResult.from_config(cfg, Status.timeout, reason=str(err),
                                       wall_time_s=time.time() - t0)
    try:
        with visibility_marker(wants_checkpoints(cfg), storage_path,
                               storage_filesystem) as marker:
            return _fit_trial(cfg, placement, storage_path, t0, callbacks, storage_filesystem,
                              {"fault": fault, "instrument": instrument, "storage_marker": marker})
    finally:
        release_nodes(cfg, holder)


def _fit_trial(cfg: TrialConfig, placement, storage_path, t0: float, callbacks, storage_filesystem,
               worker_args: dict) -> TrialResult:
    """run_trial once its placement is known: the TorchTrainer, its limits, its result
    (`worker_args`: the fault to inject, instrumentation, the storage marker to check)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from scalestudy.launch.channel import open_channel, receive
    from scalestudy.launch.deadline import StartCallback, TrialTimeout, fit_within_limits
    from scalestudy.launch.worker import train_loop_per_worker

    # Read by the controller this trial starts (Ray Train propagates it from this process).
    os.environ[HEALTH_CHECK_ENV] = f"{health_check_interval_s(cfg):g}"
    channel = open_channel()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"trial": cfg.model_dump(mode="json"), "channel": channel,
                           **worker_args},
        scaling_config=ScalingConfig(**placement.scaling_kwargs()),
        torch_config=TorchConfig(backend=cfg.hardware_profile.process_group_backend),
        run_config=RunConfig(
            name=f"{cfg.study}-{cfg.run_name}-{cfg.trial_id}-{uuid.uuid4().hex[:6]}",
            storage_path=(str(storage_path.resolve()) if isinstance(storage_path, Path)
                          else storage_path),
            storage_filesystem=storage_filesystem,
            failure_config=FailureConfig(max_failures=cfg.fault_tolerance.max_failures),
            # A restart needs only the latest checkpoint; a long trial would otherwise keep them all.
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            callbacks=[*(callbacks or []), StartCallback(channel)],
        ),
    )
    try:
        fit_within_limits(trainer, cfg, channel, t0, placement.describe())
        summary = receive(channel)
    except TrialTimeout as err:
        return TrialResult.from_config(cfg, Status.timeout, reason=str(err),
                                       wall_time_s=time.time() - t0)
    except Exception as err:  # noqa: BLE001 - any trial failure is a recorded outcome
        return TrialResult.from_config(
            cfg, Status.failed, reason=failure_reason(err), wall_time_s=time.time() - t0
        )
    if summary is None:
        return TrialResult.from_config(cfg, Status.failed, wall_time_s=time.time() - t0,
                                       reason="the trial ended without rank 0's summary")
    return summarize(cfg, summary, t0)
