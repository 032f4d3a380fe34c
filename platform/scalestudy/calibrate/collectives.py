"""`scalestudy calibrate`'s collectives: all_reduce / all_gather / reduce_scatter bus bandwidth vs
message size through deepspeed.comm (what trials call), as nccl-tests measures it: warm-up, a fixed
number of timed calls (each started together), their lower quartile, the slowest rank's time,
busbw = algbw x metrics.busbw_factor."""

from __future__ import annotations

import statistics
import time

from scalestudy import metrics as M
from scalestudy.metrics import CALIBRATED_COLLECTIVES, busbw_factor

def _collective(op: str, size: int, world: int):
    import deepspeed.comm as dc
    import torch

    n = max(1, size // 4)
    if op == M.ALL_REDUCE:
        t = torch.ones(n)
        return lambda: dc.all_reduce(t)
    if op == M.ALL_GATHER:
        shard = torch.ones(max(1, n // world))
        full = torch.empty(shard.numel() * world)
        return lambda: dc.all_gather_into_tensor(full, shard)
    full = torch.ones(max(1, n // world) * world)
    shard = torch.empty(full.numel() // world)
    return lambda: dc.reduce_scatter_tensor(shard, full)


def _fixed_quartile(fn, iters: int, warmup: int = 3) -> float:
    """The lower quartile over a FIXED number of calls (every rank must issue the same collectives:
    a time-based loop would let ranks disagree on the count and deadlock), each call started
    together (a barrier first) so that it times the collective, not the ranks' skew.

    Why not the median: between two processes on two cores, gloo's per-call time is bimodal
    (0.5 or ~3 ms for the same 64 KiB, as the OS schedules its threads), and a median of a few
    calls lands in either mode from one calibration to the next (AMD EPYC, 2026-12-07). The lower
    quartile is the collective's own cost, stable run to run; what a step's collectives wait
    beyond it is what calibrate's tp reference step solves tp_collective_overhead_s for."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.quantiles(times, n=4, method="inclusive")[0]


def comm_curves(world: int, sizes: list[int], iters: int = 20) -> dict[str, list[list[float]]]:
    import torch.distributed as dist

    out: dict[str, list[list[float]]] = {}
    for op in CALIBRATED_COLLECTIVES:
        factor = busbw_factor(op, world)
        curve = []
        for size in sizes:
            fn = _collective(op, size, world)
            dist.barrier()
            t_max = _all_max(_fixed_quartile(fn, iters))  # the slowest rank closes the collective
            curve.append([float(size), factor * size / t_max / 1e9])
        out[op] = curve
    return out


def _all_max(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


