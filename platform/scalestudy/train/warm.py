"""Warm worker groups: consecutive trials of one worker shape share long-lived worker processes.

A cold trial (train/launch.py) starts a Ray Train controller, a placement group and world_size
worker processes that import torch and DeepSpeed and start a process group, all for seconds of
training, then tears it all down. Here a group of Ray actors holding an initialised process group
stays up between trials of the same shape (world size, resources per worker, hardware): each trial
builds a fresh model and DeepSpeed engine in it, runs the same body (train/body.py) and puts the
process back as it found it (train/reentry.py). Ray Tune still decides which trials run and when;
the trainable only borrows a group for the trial it was given.

    with warm_pool(reuse=True, sweep_id) as pool:   # driver, around tuner.fit() (sweep/tune_runner.py)
        run = warm_run(pool, cfg)                   # in the trainable: None -> a cold trial
        result = run.run(t0, fault)                 # a TrialResult, as run_trial returns

A trial that fails (or times out) takes its group down with it: the next trial starts a fresh one,
so nothing a failure left half-done (a rank stuck in a collective, a leaked allocation) reaches
another trial's numbers. Trials with fault tolerance or elastic sizes run cold: restarts and
resizes are Ray Train's. Idle groups of other shapes give their resources up when a trial needs them.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import ray

from scalestudy.metrics import Status, TrialResult
from scalestudy.spec.trial import TrialConfig
from scalestudy.train.placement import on_this_node
from scalestudy.train.result import failure_reason, summarize

POOL_PREFIX = "scalestudy-warm-"
# How long a new group waits to be placed before idle groups of other shapes give their resources
# up (and again between looks for an idle group of its own shape): placing takes milliseconds when
# the resources are free.
WAIT_SLICE_S = 0.25


def resources_per_worker(cfg: TrialConfig) -> dict[str, float]:
    """As a cold trial's ScalingConfig asks (train/placement.py: the profile's device and CPUs,
    and its accelerator type as the 0.001-unit constraint resource Ray Train itself adds)."""
    from ray._common.utils import RESOURCE_CONSTRAINT_PREFIX

    from scalestudy.train.placement import resources_per_worker as from_profile

    res = from_profile(cfg)
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
    def latest_checkpoint(self) -> Iterator[str | None]:
        yield None

    def report_summary(self, summary: dict[str, Any] | None) -> None:
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

    def start(self, cfg: TrialConfig, env: dict[str, str]) -> None:
        """Join the group's process group (torchrun's environment variables, as train/local.py)."""
        import os

        from scalestudy.train import reentry
        from scalestudy.train.process import init_process_group, prepare_process

        os.environ.update(env)
        self.local_rank = int(env["LOCAL_RANK"])
        prepare_process(cfg)
        init_process_group(cfg, self.local_rank)
        import scalestudy.train.body  # noqa: F401 - its imports are the group's start, not a trial's
        self.clean = reentry.snapshot()

    def run(self, cfg: TrialConfig, fault: str | None, instrument: bool) -> dict[str, Any] | None:
        """One trial on this rank; rank 0 returns the summary. The process is put back as it was
        after the trial, also when it failed (the group is then discarded anyway)."""
        from scalestudy.train import reentry, timing
        from scalestudy.train.body import run_body

        from scalestudy.train.placement import check_tp_nodes

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


@dataclass
class Group:
    shape: tuple
    pg: Any
    workers: list = field(default_factory=list)  # in rank order
    busy: bool = True
    trials: int = 0  # trials started on it

    def kill(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            ray.kill(w, no_restart=True)
        remove_placement_group(self.pg)


@ray.remote(num_cpus=0, max_concurrency=64)
class WarmPool:
    """The sweep's warm groups (owned by the driver: they die with it). Threaded: a trial waiting
    for resources never blocks another trial's release."""

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.lock = threading.Lock()

    def _take_idle(self, shape: tuple, evict: bool) -> tuple[str, Group] | None:
        """Under the lock: an idle group of the shape, now busy. With `evict`, idle groups of other
        shapes are taken down: a new group that cannot start waits for exactly their resources."""
        found = next(((gid, g) for gid, g in self.groups.items()
                      if not g.busy and g.shape == shape), None)
        for gid, g in list(self.groups.items()):
            if evict and not g.busy and g.shape != shape:
                self.groups.pop(gid).kill()
        if found:
            found[1].busy = True
            found[1].trials += 1
        return found

    def acquire(self, cfg: TrialConfig) -> tuple[str, list, int, float]:
        """(group id, workers in rank order, trials the group ran before this one, seconds spent
        placing and starting a new group: 0 when an idle one was taken)."""
        from ray.util.placement_group import placement_group, remove_placement_group

        shape, t = shape_of(cfg), time.time()
        with self.lock:
            found = self._take_idle(shape, evict=False)
        if found:
            return found[0], found[1].workers, found[1].trials - 1, 0.0
        from scalestudy.train.placement import placement_for

        pg = placement_group([resources_per_worker(cfg)] * cfg.world_size,
                             strategy=placement_for(cfg).placement_strategy)
        placed = pg.ready()
        while True:
            ready, _ = ray.wait([placed], timeout=WAIT_SLICE_S)
            if not ready and time.time() - t > cfg.placement_timeout_s:
                remove_placement_group(pg)
                raise RuntimeError(
                    f"placement: exceeded placement_timeout_s={cfg.placement_timeout_s:g} waiting "
                    f"for {cfg.world_size} x {resources_per_worker(cfg)}")
            with self.lock:
                found = None if ready else self._take_idle(shape, evict=True)
            if found:
                remove_placement_group(pg)
                return found[0], found[1].workers, found[1].trials - 1, time.time() - t
            if ready:
                break
        group = self._start(cfg, shape, pg)
        gid = uuid.uuid4().hex[:8]
        with self.lock:
            self.groups[gid] = group
        return gid, group.workers, 0, time.time() - t

    def _start(self, cfg: TrialConfig, shape: tuple, pg) -> Group:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = resources_per_worker(cfg)
        workers = [TrialWorker.options(
            num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote() for i in range(cfg.world_size)]
        group = Group(shape, pg, workers, trials=1)
        try:
            envs = _rank_env(ray.get([w.where.remote() for w in workers]))
            order = sorted(range(len(workers)), key=lambda i: int(envs[i]["RANK"]))
            group.workers = [workers[i] for i in order]
            master = order[0]
            addr, port = ray.get(workers[master].where.remote())[1], ray.get(
                workers[master].free_port.remote())
            ray.get([w.start.remote(cfg, {**envs[i], "MASTER_ADDR": addr, "MASTER_PORT": str(port)})
                     for i, w in enumerate(workers)])
        except Exception:
            group.kill()
            raise
        return group

    def release(self, gid: str, healthy: bool) -> None:
        """A finished trial's group: idle for the next trial, or (after a failure) gone."""
        with self.lock:
            group = self.groups.get(gid)
            if group is None:
                return
            if healthy:
                group.busy = False
                return
            self.groups.pop(gid)
        group.kill()

    def evict_idle(self) -> None:
        """Before a cold trial (Ray Train's own workers): idle groups give their resources back."""
        with self.lock:
            idle = [self.groups.pop(gid) for gid, g in list(self.groups.items()) if not g.busy]
        for g in idle:
            g.kill()

    def node_id(self) -> str:
        """The Ray node this pool lives on (the driver's: see warm_pool)."""
        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        with self.lock:
            groups, self.groups = list(self.groups.values()), {}
        for g in groups:
            g.kill()


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
        self.gid: str | None = None

    def run(self, t0: float, fault: str | None = None, instrument: bool = True) -> TrialResult:
        cfg, healthy = self.cfg, False
        try:
            gid, workers, before, start_s = ray.get(self.pool.acquire.remote(cfg))
            self.gid = gid
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
        gid, self.gid = self.gid, None
        if gid is not None:
            ray.get(self.pool.release.remote(gid, healthy))

    def abandon(self) -> None:
        """The trial timed out: its group goes, whatever it is doing."""
        self._release(False)


def warm_run(pool_name: str | None, cfg: TrialConfig) -> WarmRun | None:
    """The trial's warm run, or None when it runs cold (after idle groups made room for it)."""
    if pool_name is None:
        return None
    if reusable(cfg):
        return WarmRun(pool_name, cfg)
    ray.get(ray.get_actor(pool_name).evict_idle.remote())
    return None
