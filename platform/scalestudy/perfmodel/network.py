"""Alpha-beta cost of collectives on a two-level topology (a fast link inside a node, a network between).

This follows NCCL's own tuning model (src/graph/tuning.cc, ncclTopoTuneModel), which NCCL uses to pick
an algorithm and protocol per call. For n ranks in the group, k per node, m = n / k nodes, and S bytes
as nccl-tests counts them (the buffer of all_reduce, the full output of all_gather, the full input of
reduce_scatter):
  time = latency + factor * S / (busbw * protocol bandwidth factor), factor = 2(n-1)/n for all_reduce
  and (n-1)/n for all_gather / reduce_scatter (the data each rank sends in a ring);
  ring latency  = base + (steps - inter_steps) * intra_hop + inter_steps * inter_hop, with
                  steps = n-1 (x2 for all_reduce) and inter_steps = m-1 (x2): every ring step waits
                  for its slowest hop, so the latency grows with the number of ranks and of nodes;
  tree latency  = base + 2 * [(k-1) * intra_hop + log2(m) * inter_hop] (all_reduce only; NCCL's
                  double binary tree between nodes, a chain inside);
  protocols LL / LL128 / Simple trade latency for bandwidth (table below, NCCL's figures in us);
  the fastest (algorithm, protocol) pair is taken, as NCCL does.
  send_recv     = base + hop + S / link (one NIC, or the NVLink port, of one GPU).
Bus bandwidth: inside one node the NVLink/NVSwitch rate per GPU; across nodes the ring is limited by
the network, where the k GPUs of a node in the group each drive their own NIC (DGX: one NIC per GPU),
so busbw = min(nvlink, k * network per GPU), each at its achievable efficiency. The latency terms make
the effective bus bandwidth a function of message size (small messages are latency-bound).
A profile measured by `scalestudy calibrate` carries `busbw_gbps_<op>` curves ([bytes, GB/s] pairs at
its world size): single-node groups then use the measured curve instead of the formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The collective kinds are metrics.py's names (parallelism.py uses them as net.ALL_GATHER, ...).
from scalestudy.metrics import (  # noqa: F401
    ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, SEND_RECV, busbw_factor)
from scalestudy.parallel.layout import Layout
from scalestudy.perfmodel.params import ModelParams
from scalestudy.spec.catalog import HardwareProfile


@dataclass(frozen=True)
class Group:
    """A process group's placement: n ranks, k per node, over m nodes."""

    n: int
    k: int
    m: int

    @staticmethod
    def of(layout: Layout, axis: str) -> Group:
        """The placement of a trial's group along one axis of its grid ("dp", "tp", "pp"), as the
        layout places ranks on nodes."""
        return Group(*layout.group_placement(axis))


def _interp(curve: list[list[float]], x: float) -> float:
    """Log-log interpolation of a measured [bytes, GB/s] curve, clamped at its ends."""
    pts = sorted(curve)
    if x <= pts[0][0]:
        return pts[0][1] * pts[0][0] / x if x > 0 else pts[0][1]  # latency-bound below the range
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp((1 - w) * math.log(y0) + w * math.log(y1))
    return pts[-1][1]


def bus_bandwidth(g: Group, hw: HardwareProfile, p: ModelParams) -> float:
    """Bytes/s of the ring's bottleneck link, per rank."""
    intra = hw.nvlink_gbps_per_gpu * 1e9 * p.nvlink_efficiency
    if g.m == 1:
        return intra
    return min(intra, g.k * hw.network_gbps_per_gpu * 1e9 * p.network_efficiency)


# protocol: (base latency, NVLink hop, network hop) in seconds, bandwidth factor (NCCL tuning.cc,
# ring; LL moves 8 bytes per 16 on the wire and more per flag, LL128 120 of 128).
PROTOCOLS = {
    "LL": (6.6e-6, 0.47e-6, 2.7e-6, 0.25),
    "LL128": (14.0e-6, 1.9e-6, 4.0e-6, 0.92),
    "Simple": (8.4e-6, 3.4e-6, 9.6e-6, 1.0),
}
TREE_SIMPLE = (0.0, 28e-6, 50e-6, 0.9)  # per-chunk hop latencies of the tree with Simple protocol


def _ring_latency(op: str, g: Group, proto: tuple[float, float, float, float]) -> float:
    base, intra, inter = proto[:3]
    mult = 2 if op == ALL_REDUCE else 1
    steps, inter_steps = mult * (g.n - 1), mult * (g.m - 1)
    return base + (steps - inter_steps) * intra + inter_steps * inter


def collective_time(op: str, size_bytes: float, g: Group, hw: HardwareProfile,
                    p: ModelParams) -> float:
    """Seconds for one collective of `size_bytes` (nccl-tests convention) over group g."""
    if g.n <= 1 or size_bytes <= 0:
        return 0.0
    scale = p.latency_scale
    if op == SEND_RECV:
        link = (hw.nvlink_gbps_per_gpu * p.nvlink_efficiency if g.m == 1
                else hw.network_gbps_per_gpu * p.network_efficiency) * 1e9
        base, intra, inter, _ = PROTOCOLS["Simple"]
        return size_bytes / link + scale * (base + (intra if g.m == 1 else inter))
    factor = busbw_factor(op, g.n)
    curve = hw.calibration.get(f"busbw_gbps_{op}")
    if g.m == 1 and isinstance(curve, list) and curve:
        return factor * size_bytes / (_interp(curve, size_bytes) * 1e9)
    wire = factor * size_bytes / bus_bandwidth(g, hw, p)
    best = min(scale * _ring_latency(op, g, proto) + wire / proto[3]
               for proto in PROTOCOLS.values())
    if op == ALL_REDUCE and g.m > 1:
        base, intra, inter, bw = TREE_SIMPLE
        tree = base + 2 * ((g.k - 1) * intra + math.log2(g.m) * inter)
        best = min(best, scale * tree + wire / bw)
    return best
