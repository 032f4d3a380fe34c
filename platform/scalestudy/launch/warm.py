"""Warm worker groups: consecutive trials of one worker shape share long-lived worker processes.

A cold trial (launch/ray_train.py) starts a Ray Train controller, a placement group and world_size
worker processes that import torch and DeepSpeed and start a process group, all for seconds of
training, then tears it all down. Here a group of Ray actors holding an initialised process group
stays up between trials of the same shape (world size, resources per worker, hardware): each trial
builds a fresh model and DeepSpeed engine in it, runs the same body (train/body.py) and puts the
process back as it found it (train/reentry.py). Ray Tune still decides which trials run and when;
the trainable only borrows a group for the trial it was given.

    with warm_pool(reuse=True, sweep_id) as pool:   # driver, around tuner.fit() (sweep/tune_runner.py)
        run = warm_run(pool, cfg)                   # in the trainable: None -> a cold trial
        result = run.run(t0, fault)                 # a TrialResult, as run_trial returns

The pool of groups is launch/warm_pool.py. A trial that fails (or times out, also while its group
is still being placed or started) takes its group down with it: the next trial starts a fresh one,
so nothing a failure left half-done (a rank stuck in a collective, a leaked allocation) reaches
another trial's numbers. Trials with fault tolerance or elastic sizes run cold: restarts and
resizes are Ray Train's. Idle groups of other shapes give their resources up when a trial needs them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import ray

from scalestudy.metrics import Status, TrialResult
from scalestudy.spec.trial import TrialConfig
from scalestudy.launch.placement import on_this_node
from scalestudy.train.result import failure_reason, summarize

if TYPE_CHECKING:
    from scalestudy.train.summary import TrialSummary

POOL_PREFIX = "scalestudy-warm-"
# How long a new group waits to be placed before idle groups of other shapes give their resources
# up (and again between looks for an idle group of its own shape): placing takes milliseconds when
# the resources are free.
WAIT_SLICE_S = 0.25


def resources_per_worker(cfg: TrialConfig) -> dict[str, float]:
    """As a cold trial's ScalingConfig asks (launch/placement.py): the profile's device and CPUs
    (HardwareProfile.ray_resources_per_worker), and its accelerator type as the 0.001-unit
    constraint resource Ray Train itself adds."""
    from ray._common.utils import RESOURCE_CONSTRAINT_PREFIX

    res = cfg.hardware_profile.ray_resources_per_worker()
    if cfg.hardware_profile.accelerator_type:
        res[f"{RESOURCE_CONSTRAINT_PREFIX}{cfg.hardware_profile.accelerator_type}"] = 0.001
    return res


def shape_of(cfg: TrialConfig) -> tuple:
    """What a group is reusable for: trials that start the same processes on the same devices."""
    return (cfg.world_size, tuple(sorted(resources_per_worker(cfg).items())), cfg.hardware)


def reusable(cfg: TrialConfig) -> bool:
    """Restarts from checkpoints and elastic resizes are Ray Train's: those trials run cold."""
    return cfg.fault_tolerance.max_failures == 0 and cfg.elastic is None


class WarmReporter:
    """The body's Reporter (train/body.py) in a warm worker: no checkpoints (only cold trials
    keep them), the summary returned by the actor call."""

    keeps_checkpoints = False

    def __init__(self, local_rank: int):
        self.local_rank = local_rank

    def save_checkpoint(self, directory: str, step: int) -> None:
        raise RuntimeError("warm workers keep no checkpoints (fault-tolerant trials run cold)")

    @contextmanager
    def latest_checkpoint(self) -> Iterator[None]:
        yield None

    def report_summary(self, summary: TrialSummary | None) -> None:
        """Nothing to send: TrialWorker.run returns rank 0's summary."""


@ray.remote
class TrialWorker:
    """One rank of a warm group: a process group that outlives its trials."""

    def where(self) -> tuple[str, str, list[str]]:
        """(node id, node IP, GPU ids Ray gave this actor)."""
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, cfg: TrialConfig, env: dict[str, str]) -> int:
        """Join the group's process group (torchrun's environment variables, as train/local.py);
        returns this worker's process id (the pool's description of its groups shows it)."""
        import os

        from scalestudy.train import reentry
        from scalestudy.train.process import init_process_group, prepare_process

        os.environ.update(env)
        self.local_rank = int(env["LOCAL_RANK"])
        prepare_process(cfg)
        init_process_group(cfg, self.local_rank)
        import scalestudy.train.body  # noqa: F401 - its imports are the group's start, not a trial's
        self.clean = reentry.snapshot()
        return os.getpid()

    def run(self, cfg: TrialConfig, fault: str | None, instrument: bool) -> TrialSummary | None:
        """One trial on this rank; rank 0 returns the summary. The process is put back as it was
        after the trial, also when it failed (the group is then discarded anyway)."""
        from scalestudy.train import reentry, timing
        from scalestudy.train.body import run_body

        from scalestudy.launch.placement import check_tp_nodes

        timing.start()
        timing.mark("worker_entry")
        try:
            reporter = WarmReporter(self.local_rank)
            # As a cold trial's workers do: a TP group across nodes fails with its reason.
            reporter.summary_extra = {"worker_node_ids": check_tp_nodes(cfg)}
            return run_body(cfg, reporter, fault=fault, instrument=instrument)
        finally:
            reentry.end_trial(self.clean)


def _rank_env(placed: list[tuple[str, str, list[str]]]) -> list[dict[str, str]]:
    """torchrun's variables per worker: ranks contiguous per node in the order nodes first appear,
    each GPU worker seeing its node's GPUs with its own at LOCAL_RANK (as Ray Train does)."""
    nodes: dict[str, list[int]] = {}
    for i, (node, _, _) in enumerate(placed):
        nodes.setdefault(node, []).append(i)
    envs: list[dict[str, str]] = [{} for _ in placed]
    rank = 0
    for members in nodes.values():
        gpus = sorted({g for i in members for g in placed[i][2]}, key=lambda g: (len(g), g))
        members = sorted(members, key=lambda i: gpus.index(placed[i][2][0]) if gpus else i)
        for local, i in enumerate(members):
            envs[i] = {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(len(placed)),
                       "LOCAL_WORLD_SIZE": str(len(members))}
            if gpus:
                envs[i]["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            rank += 1
    return envs


def pool_name(reuse: bool, sweep_id: str) -> str | None:
    """The sweep's pool's actor name; None when reuse is off (every trial cold)."""
    return f"{POOL_PREFIX}{sweep_id}" if reuse else None


@contextmanager
def warm_pool(reuse: bool, sweep_id: str) -> Iterator[str | None]:
    """The sweep's pool, by name (see pool_name), for the sweep's duration: its groups go with it."""
    name = pool_name(reuse, sweep_id)
    if name is None:
        yield None
        return
    # On the driver's node: a worker node that the autoscaler scales down or that is lost would
    # otherwise take the sweep's pool with it (see on_this_node).
    from scalestudy.launch.warm_pool import WarmPool  # it starts this module's TrialWorkers

    pool = WarmPool.options(name=name, **on_this_node()).remote()
    try:
        yield name
    finally:
        try:
            ray.get(pool.shutdown.remote(), timeout=60)
        finally:
            ray.kill(pool, no_restart=True)


def _unwrap(err: BaseException) -> BaseException:
    """The trial's own exception from a Ray task error (its first line is the reason)."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


class WarmRun:
    """One trial on a warm group, from the trainable."""

    def __init__(self, pool_name: str, cfg: TrialConfig):
        self.pool = ray.get_actor(pool_name)
        self.cfg = cfg
        # Names this trial to the pool from before it has a group, so an abandon during the
        # group's placement or start finds it (WarmPool.abandon).
        self.holder = uuid.uuid4().hex
        self.holding = False

    def run(self, t0: float, fault: str | None = None, instrument: bool = True) -> TrialResult:
        cfg, healthy = self.cfg, False
        try:
            gid, workers, before, start_s = ray.get(self.pool.acquire.remote(cfg, self.holder))
            self.holding = True
            refs = [w.run.remote(cfg, fault, instrument) for w in workers]
            pending = list(refs)
            while pending:  # the first rank that fails ends the trial: the others may be stuck
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done[0])
            summary = ray.get(refs[0])
            healthy = True
        except Exception as err:  # noqa: BLE001 - any trial failure is a recorded outcome
            return TrialResult.from_config(cfg, Status.failed, reason=failure_reason(_unwrap(err)),
                                           wall_time_s=time.time() - t0)
        finally:
            self._release(healthy)
        result = summarize(cfg, summary, t0)
        result.extra["worker_group"] = {"id": gid, "trials_before": before, "start_s": start_s}
        return result

    def _release(self, healthy: bool) -> None:
        holding, self.holding = self.holding, False
        if holding:
            ray.get(self.pool.release.remote(self.holder, healthy))

    def abandon(self) -> None:
        """The trial timed out: its group goes, whatever it is doing, also while it is still
        being placed or started (then acquire fails in the trial's thread)."""
        self.holding = False
        ray.get(self.pool.abandon.remote(self.holder))


def warm_run(pool_name: str | None, cfg: TrialConfig) -> WarmRun | None:
    """The trial's warm run, or None when it runs cold (after idle groups made room for it)."""
    if pool_name is None:
        return None
    if reusable(cfg):
        return WarmRun(pool_name, cfg)
    ray.get(ray.get_actor(pool_name).evict_idle.remote())
    return None
