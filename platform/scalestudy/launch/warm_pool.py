"""The sweep's pool of warm worker groups (launch/warm.py says what a warm group is): a Ray actor
that places, starts, lends, takes back and takes down groups of TrialWorkers.

A group is registered, busy for the trial that asked for it (its holder, WarmRun.holder), from the
moment its placement group is asked for, and goes through placing -> starting -> ready. A trial
abandoned at its time limit (WarmPool.abandon) takes its group down in whatever stage it is, so a
timeout while a group is still being placed or started leaves nothing allocated and nothing busy;
an abandon that arrives before the trial's acquire began makes that acquire refuse.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from scalestudy.launch.node_leases import nodes_needed, pinned_selectors, release_nodes
from scalestudy.launch.placement import placement_for
from scalestudy.launch.warm import WAIT_SLICE_S, TrialWorker, _rank_env, resources_per_worker, shape_of
from scalestudy.spec.trial import TrialConfig

ABANDONED = "abandoned: the trial ran past its time limit while its worker group was placed or started"


class TrialAbandoned(RuntimeError):
    """The trial was given up (WarmRun.abandon) before its group was ready."""


@dataclass
class Group:
    shape: tuple
    pg: Any
    holder: str | None = None  # the trial that has it (WarmRun.holder); None: idle
    workers: list = field(default_factory=list)  # in rank order once started
    pids: list[int] = field(default_factory=list)  # the workers' processes, in rank order
    state: str = "placing"  # placing -> starting -> ready
    trials: int = 0  # trials started on it

    @property
    def busy(self) -> bool:
        return self.holder is not None

    def kill(self) -> None:
        """Its workers and its placement group go. Called by whoever popped it from the pool's
        groups under the lock, so once."""
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            ray.kill(w, no_restart=True)
        remove_placement_group(self.pg)


@ray.remote(num_cpus=0, max_concurrency=64)
class WarmPool:
    """The sweep's warm groups (owned by the driver: they die with it). Threaded: a trial waiting
    for resources never blocks another trial's release. A group is registered, busy for the trial
    that asked (its holder), from the moment its placement group is asked for: a trial abandoned
    while its group is placed or started takes the group down with it, whatever stage it is in."""

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.abandoned: set[str] = set()  # holders abandoned before their acquire began
        self.lock = threading.Lock()

    def _take_idle(self, shape: tuple, evict: bool, holder: str) -> tuple[str, Group] | None:
        """Under the lock: an idle group of the shape, now the holder's. With `evict`, idle groups of
        other shapes are taken down: a new group that cannot start waits for exactly their resources."""
        found = next(((gid, g) for gid, g in self.groups.items()
                      if not g.busy and g.shape == shape), None)
        for gid, g in list(self.groups.items()):
            if evict and not g.busy and g.shape != shape:
                self.groups.pop(gid).kill()
        if found:
            found[1].holder = holder
            found[1].trials += 1
        return found

    def _held_by(self, holder: str) -> str | None:
        """Under the lock: the id of the group the holder has, if any."""
        return next((gid for gid, g in self.groups.items() if g.holder == holder), None)

    def _drop(self, gid: str) -> bool:
        """Take the group down; False when it was gone already (abandoned)."""
        with self.lock:
            group = self.groups.pop(gid, None)
        if group is not None:
            group.kill()
        return group is not None

    def acquire(self, cfg: TrialConfig, holder: str) -> tuple[str, list, int, float]:
        """(group id, workers in rank order, trials the group ran before this one, seconds spent
        placing and starting a new group: 0 when an idle one was taken) for the trial `holder`."""
        shape, t = shape_of(cfg), time.time()
        selectors = None
        if nodes_needed(cfg):  # a group over whole nodes: leased first (launch/node_leases.py)
            with self.lock:
                found = self._take_idle_unless_abandoned(shape, holder)
            if found:
                return found[0], found[1].workers, found[1].trials - 1, 0.0
            selectors = pinned_selectors(cfg, holder, t, lambda: holder in self.abandoned)
        try:
            return self._acquire(cfg, holder, shape, t, selectors)
        finally:  # once its placement group holds the nodes' devices, they are idle to nobody
            release_nodes(cfg, holder)

    def _take_idle_unless_abandoned(self, shape: tuple, holder: str) -> tuple[str, Group] | None:
        if holder in self.abandoned:
            self.abandoned.discard(holder)
            raise TrialAbandoned(ABANDONED)
        return self._take_idle(shape, evict=False, holder=holder)

    def _acquire(self, cfg: TrialConfig, holder: str, shape: tuple, t: float,
                 selectors: list | None) -> tuple[str, list, int, float]:
        from ray.util.placement_group import placement_group

        with self.lock:
            found = self._take_idle_unless_abandoned(shape, holder)
            if found is None:  # registered before it is placed: an abandon finds it from now on
                gid = uuid.uuid4().hex[:8]
                self.groups[gid] = Group(shape, placement_group(
                    [resources_per_worker(cfg)] * cfg.world_size,
                    strategy=placement_for(cfg).placement_strategy,
                    bundle_label_selector=selectors), holder=holder, trials=1)
        if found:
            return found[0], found[1].workers, found[1].trials - 1, 0.0
        try:
            found = self._wait_placed(cfg, gid, holder, t)
            if found is None:
                self._start(cfg, gid)
        except Exception:
            if not self._drop(gid):
                raise TrialAbandoned(ABANDONED) from None  # its own reason, not the killed workers'
            raise
        if found:
            self._drop(gid)
            return found[0], found[1].workers, found[1].trials - 1, time.time() - t
        with self.lock:
            group = self.groups.get(gid)
            if group is None:
                raise TrialAbandoned(ABANDONED)
            group.state = "ready"
        return gid, group.workers, 0, time.time() - t

    def _wait_placed(self, cfg: TrialConfig, gid: str, holder: str,
                     t: float) -> tuple[str, Group] | None:
        """Wait for the new group's placement group; meanwhile an idle group of the shape that
        another trial released is taken instead (returned). Raises past placement_timeout_s."""
        placed = self.groups[gid].pg.ready()
        shape = self.groups[gid].shape
        while True:
            ready, _ = ray.wait([placed], timeout=WAIT_SLICE_S)
            if not ready and time.time() - t > cfg.placement_timeout_s:
                raise RuntimeError(
                    f"placement: exceeded placement_timeout_s={cfg.placement_timeout_s:g} waiting "
                    f"for {cfg.world_size} x {resources_per_worker(cfg)}")
            with self.lock:
                if gid not in self.groups:
                    raise TrialAbandoned(ABANDONED)
                found = None if ready else self._take_idle(shape, evict=True, holder=holder)
            if found or ready:
                return found

    def _start(self, cfg: TrialConfig, gid: str) -> None:
        """Start the group's workers and their process group (its workers, rank order, pids)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = resources_per_worker(cfg)
        with self.lock:  # the workers are the group's before they start: an abandon kills them
            group = self.groups.get(gid)
            if group is None:
                raise TrialAbandoned(ABANDONED)
            group.state = "starting"
            group.workers = workers = [TrialWorker.options(
                num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group.pg, placement_group_bundle_index=i),
            ).remote() for i in range(cfg.world_size)]
        envs = _rank_env(ray.get([w.where.remote() for w in workers]))
        order = sorted(range(len(workers)), key=lambda i: int(envs[i]["RANK"]))
        master = order[0]
        addr, port = ray.get(workers[master].where.remote())[1], ray.get(
            workers[master].free_port.remote())
        pids = ray.get([w.start.remote(cfg, {**envs[i], "MASTER_ADDR": addr, "MASTER_PORT": str(port)})
                        for i, w in enumerate(workers)])
        group.workers, group.pids = [workers[i] for i in order], [pids[i] for i in order]

    def release(self, holder: str, healthy: bool) -> None:
        """A finished trial's group: idle for the next trial, or (after a failure) gone."""
        with self.lock:
            gid = self._held_by(holder)
            if gid is None:
                return
            if healthy:
                self.groups[gid].holder = None
                return
            group = self.groups.pop(gid)
        group.kill()

    def abandon(self, holder: str) -> None:
        """A trial past its time limit: the group it holds goes, in whatever stage (placing,
        starting, running); one whose acquire has not begun is refused when it does."""
        with self.lock:
            gid = self._held_by(holder)
            group = self.groups.pop(gid) if gid is not None else None
            if group is None:
                self.abandoned.add(holder)
        if group is not None:
            group.kill()

    def describe(self) -> list[dict[str, Any]]:
        """Each group: id, state, busy, trials started on it, worker pids in rank order."""
        with self.lock:
            return [{"id": gid, "state": g.state, "busy": g.busy, "trials": g.trials,
                     "pids": list(g.pids)} for gid, g in self.groups.items()]

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
