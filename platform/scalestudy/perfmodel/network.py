"""Collectives as NCCL runs them on a two-level topology (NVLink/NVSwitch inside a node, a network
between nodes): alpha-beta costs with NCCL's own constants, and the physical floor of each call.

A group of n ranks, k per node, over m = n / k nodes; S bytes as nccl-tests counts them (the buffer
of all_reduce, the full output of all_gather, the full input of reduce_scatter).

Bandwidth (beta). Each rank moves factor * S over the ring, factor = 2(n-1)/n for all_reduce and
(n-1)/n for all_gather / reduce_scatter (nccl-tests doc/PERFORMANCE.md). Inside one node the
bottleneck is the GPU's NVLink port. Across nodes NCCL lays one ring per channel through all k GPUs
of a node over NVLink and crosses the network once per node per ring, the channels spread over the
node's NICs (NCCL's ring graphs "NET/0 GPU/0 .. GPU/3 NET/0", nccl #601), so the per-rank traffic
leaves the node through the k NICs together: busbw = min(NVLink, k x NIC). Published multi-node
nccl-tests reach exactly that node aggregate, not one GPU's NIC: DGX A100 8 x 200 Gb/s -> 192 GB/s
all-reduce busbw (NVIDIA, nccl #812); 4 x 200 Gb/s -> 86-96 GB/s (nccl-tests #175, #119, #100);
5 H100 nodes with 4 x 400 Gb/s -> 190 GB/s (nccl #1368). Point-to-point (pipeline send/recv) cannot
aggregate NICs: one NIC (sjeaugey, nccl-tests #267). Each link runs at its achievable fraction
(nvlink_efficiency, network_efficiency).

Latency (alpha). NCCL's tuning model (src/graph/tuning.cc, 2.19+ constants below) prices a ring as
base + nsteps * hop latency, nsteps = n-1 (x2 for all_reduce): linear in the ranks. A chunk crosses
every hop of the ring once, each at that hop's own latency: of the n-1 steps, m-1 (x2 for
all_reduce) cross the network at the network hop's latency and the others cross NVLink at
max(NVLink hop, NCCL's per-step cost of posting a network send: 1 us on Intel hosts, 2 us on AMD,
x3 for the Simple protocol), NCCL's own formula in every version read ("(nsteps-nInterSteps) *
intraLat + nInterSteps * interLat": tuning.cc at stored commit 01afd20a, NCCL 2.8; the same line
with the net overhead in newer versions; issue 35, item 7: latency per hop of the ring). So a ring
of 2,048 H100s (256 nodes) costs ~4-10 ms before a byte moves, by protocol, and NCCL takes the
fastest (algorithm, protocol): LL128's cheaper hops win for large gathers over thousands of ranks.
An earlier version of this model made every step wait for the network hop (lock-step, from one
nccl-tests run at 256 H100s, nccl #1218, 200 GB/s all_gather busbw); that reading left FSDP at
2,048 H100s 4x slower than the study measured and contradicts NCCL's own model; #1218 is kept as
a recorded miss (tests/validation/test_nccl_published.py).
Tree (all_reduce only) costs base + 2 * ((k-1) * intra + log2(m) * inter) at 0.92 of the ring's
bus bandwidth (tuning.cc), which NCCL prefers for mid-size all_reduces over many nodes.
Protocols LL / LL128 / Simple trade latency for bandwidth (LL moves 8 data bytes per 16, capped near
20 GB/s per node pair across nodes; LL128 120 of 128); the fastest (algorithm, protocol) is taken.
A profile measured by `scalestudy calibrate` carries `busbw_gbps_<op>` curves ([bytes, GB/s] at its
world size): single-node groups then use the measured curve instead.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

# The collective kinds are metrics.py's names (parallelism.py uses them as net.ALL_GATHER, ...).
from scalestudy.metrics import (  # noqa: F401
    ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, SEND_RECV, busbw_factor)
from scalestudy.parallel.layout import Layout
from scalestudy.perfmodel.params import ModelParams
from scalestudy.spec.catalog import HardwareProfile

if TYPE_CHECKING:
    from scalestudy.spec.study import TrialConfig


class Group(NamedTuple):
    """A process group's placement: n ranks, k per node, over m nodes."""

    n: int
    k: int
    m: int

    @staticmethod
    def of(layout: Layout, axis: str) -> Group:
        """The placement of a trial's group along one axis of its grid ("dp", "tp", "pp"), as the
        layout places ranks on nodes."""
        return Group(*layout.group_placement(axis))

    @staticmethod
    def along(cfg: TrialConfig, axis: str) -> Group:
        """Group.of(cfg.layout, axis), memoised: the placement depends only on the grid and the
        devices per node, not on the batch (a sweep prices many batches on one grid)."""
        key = (cfg.world_size, cfg.dp, cfg.tp, cfg.pp, cfg.hardware_profile.gpus_per_node, axis)
        group = _PLACED.get(key)
        if group is None:
            if len(_PLACED) > 65536:
                _PLACED.clear()
            group = _PLACED[key] = Group.of(cfg.layout, axis)
        return group


_PLACED: dict[tuple[int, int, int, int, int, str], Group] = {}


@dataclass(frozen=True)
class _Links:
    """The two link rates of a profile, all that the cost of a collective depends on."""

    nvlink_gbps_per_gpu: float
    network_gbps_per_gpu: float


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


def link_rates(g: Group, hw: HardwareProfile | _Links) -> tuple[float, float]:
    """(NVLink bytes/s per GPU, network bytes/s available to the group on one node), line rates."""
    return hw.nvlink_gbps_per_gpu * 1e9, g.k * hw.network_gbps_per_gpu * 1e9


def bus_bandwidth(g: Group, hw: HardwareProfile | _Links, p: ModelParams | _NetParams) -> float:
    """Achievable bytes/s of the ring's bottleneck, per rank (see the module doc)."""
    nvlink, net = link_rates(g, hw)
    intra = nvlink * p.nvlink_efficiency
    return intra if g.m == 1 else min(intra, net * p.network_efficiency)


def link_floor_s(op: str, size_bytes: float, g: Group, hw: HardwareProfile) -> float:
    """No algorithm moves one collective faster: each rank's bytes over the slowest link the ring
    crosses at its line rate (NVLink in a node, the node's NICs across nodes; one NIC for
    send/recv across nodes)."""
    if g.n <= 1 or size_bytes <= 0:
        return 0.0
    nvlink, net = link_rates(g, hw)
    if op == SEND_RECV:
        return size_bytes / (nvlink if g.m == 1 else hw.network_gbps_per_gpu * 1e9)
    return busbw_factor(op, g.n) * size_bytes / (nvlink if g.m == 1 else min(nvlink, net))


# NCCL tuning.cc (2.19+): base latency per algorithm and protocol, hop latency per link kind, us.
# Order (LL, LL128, Simple).
BASE_US = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 0.0)}
NVLINK_HOP_US = {"ring": (0.6, 1.9, 3.4), "tree": (0.6, 1.25, 28.0)}
NET_HOP_US = {"ring": (2.7, 4.0, 14.0), "tree": (5.0, 8.5, 28.0)}
# Bandwidth relative to the ring's bus bandwidth: LL sends 8 data bytes in 16 (NCCL x1/4 across
# nodes, x1/3 inside), LL128 120 of 128; tree x0.92 (tuning.cc "Various model refinements").
LL_NET_CAP_BPS = 20e9  # llMaxBws across > 2 nodes (19.0 AMD, 20.4 Intel host): LL tops out here
PROTOCOLS = ("LL", "LL128", "Simple")


def _proto_bw(i: int, bus: float, g: Group, op: str) -> float:
    if i == 0:
        if g.m == 1:
            return bus / (4.0 if op == ALL_REDUCE else 3.0)
        return min(bus / 4.0, LL_NET_CAP_BPS)
    return bus * 0.92 if i == 1 else bus


def _ring_latency_s(op: str, g: Group, i: int, p: _NetParams) -> float:
    """NCCL's ring latency for protocol i: every step at its own hop's latency (module doc)."""
    factor = 2 if op == ALL_REDUCE else 1
    steps, inter_steps = factor * (g.n - 1), factor * (g.m - 1)
    intra = NVLINK_HOP_US["ring"][i] * 1e-6
    if g.m == 1:
        return BASE_US["ring"][i] * 1e-6 + steps * intra
    # Inter-node rings still post a network send per step (tuning.cc: intraLat = max(intraLat,
    # netOverhead), x3 for Simple's send, receive and flush).
    intra = max(intra, p.net_overhead_s * (3.0 if PROTOCOLS[i] == "Simple" else 1.0))
    inter = NET_HOP_US["ring"][i] * 1e-6
    return BASE_US["ring"][i] * 1e-6 + (steps - inter_steps) * intra + inter_steps * inter


def _tree_terms(g: Group, bus: float, p: _NetParams) -> list[tuple[float, float]]:
    """(latency s, bus bytes/s) of the tree all_reduce per protocol."""
    out = []
    for i in range(3):
        lat = (BASE_US["tree"][i] + 2 * ((g.k - 1) * NVLINK_HOP_US["tree"][i]
                                         + math.log2(g.m) * NET_HOP_US["tree"][i])) * 1e-6
        out.append((p.latency_scale * lat, bus * 0.92 * (0.25 if i == 0 else 1.0)))
    return out


_CURVE_KEY = {op: f"busbw_gbps_{op}" for op in (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, SEND_RECV)}


def collective_time(op: str, size_bytes: float, g: Group, hw: HardwareProfile,
                    p: ModelParams) -> float:
    """Seconds for one collective of `size_bytes` (nccl-tests convention) over group g."""
    if g.n <= 1 or size_bytes <= 0:
        return 0.0
    if g.m == 1:
        curve = hw.calibration.get(_CURVE_KEY[op])
        if isinstance(curve, list) and curve:
            return busbw_factor(op, g.n) * size_bytes / (_interp(curve, size_bytes) * 1e9)
    return _cost(op, float(size_bytes), g.n, g.k, g.m, hw.nvlink_gbps_per_gpu,
                 hw.network_gbps_per_gpu, p.nvlink_efficiency, p.network_efficiency,
                 p.latency_scale, p.net_overhead_s)


@dataclass(frozen=True)
class _NetParams:
    """The ModelParams fields a collective's cost depends on."""

    nvlink_efficiency: float
    network_efficiency: float
    latency_scale: float
    net_overhead_s: float


@functools.lru_cache(maxsize=16384)
def _alternatives(op: str, n: int, k: int, m: int, nvlink_gbps: float, net_gbps: float,
                  nvlink_eff: float, net_eff: float, latency_scale: float,
                  net_overhead_s: float) -> tuple[tuple[float, float], ...]:
    """(latency s, bytes of the call per second) of every (algorithm, protocol) NCCL may pick for
    one op over one group: a call of S bytes costs min(latency + S / rate). A pure function of the
    group and the link rates, memoised, so a call of a new size costs a few multiplications."""
    g, hw = Group(n, k, m), _Links(nvlink_gbps, net_gbps)
    p = _NetParams(nvlink_eff, net_eff, latency_scale, net_overhead_s)
    if op == SEND_RECV:
        link = (hw.nvlink_gbps_per_gpu * p.nvlink_efficiency if g.m == 1
                else hw.network_gbps_per_gpu * p.network_efficiency) * 1e9
        hop = NVLINK_HOP_US["ring"][2] if g.m == 1 else NET_HOP_US["ring"][2]
        return ((p.latency_scale * (BASE_US["ring"][2] + hop) * 1e-6, link),)
    factor = busbw_factor(op, g.n)  # bus bytes per byte of the call
    bus = bus_bandwidth(g, hw, p)
    terms = [(p.latency_scale * _ring_latency_s(op, g, i, p), _proto_bw(i, bus, g, op))
             for i in range(3)]
    if op == ALL_REDUCE and g.m > 1:
        terms += _tree_terms(g, bus, p)
    return tuple((lat, bw / factor) for lat, bw in terms)


def _cost(op: str, size_bytes: float, n: int, k: int, m: int, nvlink_gbps: float, net_gbps: float,
          nvlink_eff: float, net_eff: float, latency_scale: float, net_overhead_s: float) -> float:
    # A plain loop: min() over a generator costs twice as much, and this runs for every collective.
    best = math.inf
    for lat, rate in _alternatives(op, n, k, m, nvlink_gbps, net_gbps, nvlink_eff, net_eff,
                                   latency_scale, net_overhead_s):
        t = lat + size_bytes / rate
        if t < best:
            best = t
    return best


def busbw_gbps(op: str, size_bytes: float, g: Group, hw: HardwareProfile, p: ModelParams) -> float:
    """Effective bus bandwidth of one call (what nccl-tests prints as busbw): the model's collective
    cost in nccl-tests' terms, so it can be checked against published nccl-tests figures."""
    t = collective_time(op, size_bytes, g, hw, p)
    if t <= 0:
        return float("nan")
    return busbw_factor(op, g.n) * size_bytes / t / 1e9
