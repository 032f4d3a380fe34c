"""Whole nodes for a trial that spans nodes, so that concurrent trials never share one.

A trial whose world exceeds one node's devices takes whole nodes (the layout refuses a world that
is not a multiple of them), but Ray's PACK alone does not keep it there: with another trial on
part of a node, Ray may put some of this trial's workers beside it and the rest on other nodes,
and a TP group then crosses a node boundary (the workers' check fails the trial; the trial is
lost). So the trial's driver leases whole idle nodes (every device free, none leased to another
trial) from one NodeLeases actor per Ray cluster, and pins its workers to them, devices-per-node
workers on each (Ray Train's per-worker label_selector on Ray's node-id label). Ray Train orders
ranks node by node, so each node holds consecutive ranks and every TP group stays inside one.

While too few idle nodes are up, the actor asks the autoscaler for the missing ones: one
`request_resources` carrying every waiting trial's whole nodes (the call replaces the previous
request, so one owner must add them up), cleared once nobody waits. The trial waits within its
placement_timeout_s. A lease matters only until the trial's placement group holds the nodes'
devices (then they are not idle to anyone); it ends with the trial, or `LEASE_TTL_S` after it was
taken if its driver died without releasing it.

Not pinned: elastic trials (they exist to grow onto nodes that arrive, and to shrink) and
fault-tolerant ones (`max_failures > 0`): Ray Train restarts a group on whatever nodes are up, and
a node that was lost would never come back under its id. Both keep PACK and the workers' check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from scalestudy.spec.trial import TrialConfig

ACTOR_NAME = "scalestudy-node-leases"
NAMESPACE = "scalestudy"
NODE_ID_LABEL = "ray.io/node-id"
POLL_S = 1.0
LEASE_TTL_S = 600.0


@dataclass(frozen=True)
class NodeShape:
    """What a node must have to be one of a trial's whole nodes."""

    device_resource: str
    devices: int
    accelerator_type: str | None

    def matches(self, total: dict[str, float]) -> bool:
        acc = self.accelerator_type
        return (int(total.get(self.device_resource, 0)) == self.devices
                and (acc is None or total.get(f"accelerator_type:{acc}", 0) > 0))

    def bundle(self) -> dict[str, float]:
        """The autoscaler's request for one such node."""
        out = {self.device_resource: float(self.devices)}
        if self.accelerator_type:
            out[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return out


def nodes_needed(cfg: TrialConfig) -> int:
    """Whole nodes to pin the trial to; 0 for a trial that is not pinned (one node, elastic,
    fault-tolerant, or devices that are CPU cores: a CPU profile's "node" of a few cores is a
    slice of one machine, not a machine, as on this project's one-machine test Ray)."""
    hw = cfg.hardware_profile
    per_node = hw.gpus_per_node
    if cfg.elastic is not None or cfg.fault_tolerance.max_failures > 0:
        return 0
    if hw.ray_device_resource == "CPU":
        return 0
    if cfg.world_size <= per_node:
        return 0
    return -(-cfg.world_size // per_node)


def shape_of(cfg: TrialConfig) -> NodeShape:
    hw = cfg.hardware_profile
    return NodeShape(hw.ray_device_resource, hw.gpus_per_node, hw.accelerator_type)


def worker_selectors(node_ids: list[str], per_node: int, world_size: int) -> list[dict[str, str]]:
    """Ray Train's per-worker label_selector: `per_node` workers on each leased node, in order."""
    return [{NODE_ID_LABEL: node_ids[i // per_node]} for i in range(world_size)]


def pick_idle(nodes: list[dict], available: dict[str, dict[str, float]], shape: NodeShape,
              leased: set[str], n: int) -> list[str] | None:
    """`n` idle nodes of the shape (alive, every device free, not leased), or None. Pure."""
    idle = sorted(node["NodeID"] for node in nodes
                  if node["Alive"] and node["NodeID"] not in leased
                  and shape.matches(node["Resources"])
                  and available.get(node["NodeID"], {}).get(shape.device_resource, 0)
                  >= shape.devices)
    return idle[:n] if len(idle) >= n else None


@ray.remote(num_cpus=0)
class NodeLeases:
    """The cluster's leases: node id -> (holder, expiry); holders waiting -> their request."""

    def __init__(self) -> None:
        self.leases: dict[str, tuple[str, float]] = {}
        self.waiting: dict[str, tuple[NodeShape, int, float]] = {}
        self.requested: list[dict[str, float]] = []

    def acquire(self, holder: str, shape: NodeShape, n: int) -> list[str] | None:
        """Lease `n` idle nodes to `holder`, or None (it waits; the autoscaler is asked)."""
        from ray._private.state import available_resources_per_node  # no public per-node view

        now = time.time()
        self.leases = {k: v for k, v in self.leases.items() if v[1] > now}
        got = pick_idle(ray.nodes(), available_resources_per_node(), shape,
                        set(self.leases), n)
        if got is None:
            self.waiting[holder] = (shape, n, now + LEASE_TTL_S)
        else:
            self.waiting.pop(holder, None)
            self.leases.update({node: (holder, now + LEASE_TTL_S) for node in got})
        self._ask_autoscaler(now)
        return got

    def release(self, holder: str) -> None:
        self.leases = {k: v for k, v in self.leases.items() if v[0] != holder}
        self.waiting.pop(holder, None)
        self._ask_autoscaler(time.time())

    def held(self) -> dict[str, str]:
        return {node: holder for node, (holder, _) in self.leases.items()}

    def _ask_autoscaler(self, now: float) -> None:
        self.waiting = {h: w for h, w in self.waiting.items() if w[2] > now}
        bundles = [shape.bundle() for shape, n, _ in self.waiting.values() for _ in range(n)]
        if bundles != self.requested:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=bundles)  # replaces the previous request; [] clears it
            self.requested = bundles


def leases_actor():
    """The cluster's NodeLeases actor, started on first use. Detached: trials of several drivers
    (concurrent Tune trials, other jobs) share it; a lease outlives a dead driver by its TTL only."""
    return NodeLeases.options(name=ACTOR_NAME, namespace=NAMESPACE, get_if_exists=True,
                              lifetime="detached").remote()


class PlacementWait(RuntimeError):
    """No idle nodes for the trial within its placement_timeout_s."""


def lease_nodes(cfg: TrialConfig, holder: str, t0: float,
                abandoned: Callable[[], bool] = lambda: False) -> list[str]:
    """Block until `holder` leases the trial's whole nodes; PlacementWait past the timeout (or
    at once when `abandoned()` says the trial was given up meanwhile)."""
    actor, shape, n = leases_actor(), shape_of(cfg), nodes_needed(cfg)
    while True:
        got = ray.get(actor.acquire.remote(holder, shape, n))
        if got is not None:
            return got
        if abandoned():
            ray.get(actor.release.remote(holder))
            raise PlacementWait("placement: the trial was abandoned while waiting for nodes")
        if time.time() - t0 > cfg.placement_timeout_s:
            ray.get(actor.release.remote(holder))
            raise PlacementWait(
                f"placement: exceeded placement_timeout_s={cfg.placement_timeout_s:g} waiting "
                f"for {n} whole idle node(s) with {shape.devices} x {shape.device_resource}"
                + (f" ({shape.accelerator_type})" if shape.accelerator_type else ""))
        time.sleep(POLL_S)


def pinned_selectors(cfg: TrialConfig, holder: str, t0: float,
                     abandoned: Callable[[], bool] = lambda: False) -> list[dict[str, str]] | None:
    """The trial's per-worker label selectors on its leased nodes; None when it is not pinned."""
    if not nodes_needed(cfg):
        return None
    nodes = lease_nodes(cfg, holder, t0, abandoned)
    return worker_selectors(nodes, cfg.hardware_profile.gpus_per_node, cfg.world_size)


def release_nodes(cfg: TrialConfig, holder: str) -> None:
    if nodes_needed(cfg):
        ray.get(leases_actor().release.remote(holder))
