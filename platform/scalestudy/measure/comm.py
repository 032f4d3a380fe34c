"""Communication accounting: nccl-tests bandwidths and per-step breakdowns per collective kind.

Bandwidths follow nccl-tests' doc/PERFORMANCE.md: for a collective of size S bytes taking t seconds,
algbw = S / t and busbw = algbw * factor, with S the full buffer (for all_gather the gathered output,
for reduce_scatter the unscattered input) and factor = ``metrics.busbw_factor(kind, n)`` for the
collective's OWN group size n (tp for a tensor-parallel all_reduce, dp for gradient reduction; never
the world size unless the group is the world). Per kind, ``bus_bytes`` sums S x factor over the calls,
so busbw = bus_bytes / time stays right when one kind runs in groups of different sizes. Reported in
GB/s (1e9 bytes/s), as nccl-tests does.

Two sources, one schema (dict[kind -> CollectiveStats] per optimizer step):

* ``stats_from_trace``: the torch.profiler trace of the profiled window (primary). Count and bytes come
  from the ``c10d::*`` ops the caller issued (record_shapes=True gives their tensor shapes); time per kind
  from what executed them (gloo worker spans on CPU, NCCL kernels on GPU). Correct on both backends,
  including async ops and gloo's reduce_scatter-as-all_reduce. Group sizes come from the trace
  (measure.comm_groups). The profiled units may be whole steps or the last micro-batches of a step;
  ``extrapolate_per_step`` turns them into per-step figures.
* ``stats_from_comms_logger``: DeepSpeed's comms logger. Verified in deepspeed 0.19.8
  (deepspeed/comm/comm.py ``timed_op``, utils/comms_logging.py): keys are DeepSpeed op names; msg size is
  bytes of the op's ``tensor`` argument, which is the *input*: the shard for all_gather_into_tensor but
  the full buffer for reduce_scatter_tensor (DeepSpeed then multiplies both by n, overstating
  reduce_scatter bandwidth n-fold, so we recompute bandwidths here); latencies are milliseconds
  (host wall clock on CPU, CUDA events on GPU). For async ops the latency is launch time only on CPU (the
  CPU accelerator's synchronize is a no-op), and on GPU the logger synchronises the device after every
  op, destroying overlap: so use it for counts and bytes, never for overlap, and never in the timed window.
  It does not record the group of a call: its busbw is NaN, and its all_gather sizes assume the
  gather spans the world (true for ZeRO without tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scalestudy import metrics as M
from scalestudy.metrics import CollectiveStats, busbw_factor
from scalestudy.measure.overlap import TraceIntervals, clip, kind_of, measure

NAN = float("nan")


def bandwidths_gbps(kind: str, size_bytes: float, time_s: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of a collective over a group of n ranks; NaN when there is no time or
    no payload to divide."""
    if not (time_s > 0) or not (size_bytes > 0):
        return NAN, NAN
    algbw = size_bytes / time_s / 1e9
    return algbw, algbw * busbw_factor(kind, n)


def bus_bytes(kind: str, size_bytes: float, group_size: int | None) -> float:
    """size x busbw_factor of one call; NaN when its group is unknown."""
    return size_bytes * busbw_factor(kind, group_size) if group_size else NAN


def collective_stats(kind: str, count: float, size_bytes: float, time_s: float,
                     bus_bytes_: float = NAN) -> CollectiveStats:
    """Per-step stats: algbw = bytes / time, busbw = bus_bytes / time (the mean call's rates)."""
    ok = time_s > 0 and size_bytes > 0
    algbw = size_bytes / time_s / 1e9 if ok else NAN
    busbw = bus_bytes_ / time_s / 1e9 if ok else NAN
    return CollectiveStats(count=count, bytes=size_bytes, time_s=time_s, bus_bytes=bus_bytes_,
                           algbw_gbps=algbw, busbw_gbps=busbw)


def extrapolate_per_step(values: list[float], boundary: list[bool], grad_accum: int = 1) -> float:
    """Per-step total of an additive figure measured per profiled unit.

    Units that end a step (``boundary``: a whole step, or a step's last micro-batch, which also holds
    the gradient reduction of ZeRO-0/1 and the optimizer step) average to B; the others (plain
    micro-batches: forward, backward, ZeRO-2/3 and TP collectives) to M. Per step = B + (grad_accum - 1)
    x M, exact when every micro-batch of a step was profiled, and for whole steps (grad_accum = 1).
    Additive figures: time, comm time, exposed time, collective counts, bytes, bus bytes. Ratios
    (exposed fraction, bandwidths) are recomputed from the extrapolated figures, never scaled."""
    b = [v for v, f in zip(values, boundary) if f]
    m = [v for v, f in zip(values, boundary) if not f]
    if grad_accum == 1 and m:
        raise ValueError("plain micro-batches profiled but grad_accum = 1")
    if not b or (grad_accum > 1 and not m):
        return NAN  # the window must hold a step's end, and a plain micro-batch when there are any
    est = sum(b) / len(b)
    if grad_accum > 1:
        est += (grad_accum - 1) * sum(m) / len(m)
    return est


def stats_from_trace(ti: TraceIntervals, grad_accum: int = 1) -> dict[str, CollectiveStats]:
    """Per-step breakdown from a parsed profiler trace: calls and executed spans inside each profiled
    unit, extrapolated per step (``extrapolate_per_step``).

    time_s per kind is the union of that kind's executed spans within a unit (concurrent calls of one
    kind count once), so kinds can overlap each other and their sum can exceed ``comm_time_s``."""
    if not ti.units:
        return {}
    per_unit: dict[str, list[list[float]]] = {}  # kind -> per unit [count, bytes, bus_bytes, time]
    kinds = sorted({c.kind for c in ti.calls} | set(ti.comm_by_kind))
    for kind in kinds:
        per_unit[kind] = [[0.0, 0.0, 0.0, 0.0] for _ in ti.units]
    for c in ti.calls:
        for u, (lo, hi) in enumerate(ti.units):
            if lo <= c.start_us <= hi:
                row = per_unit[c.kind][u]
                row[0] += 1
                row[1] += c.bytes
                row[2] += bus_bytes(c.kind, c.bytes, c.group_size)
                break
    for kind in kinds:
        for u, unit in enumerate(ti.units):
            per_unit[kind][u][3] = measure(clip(ti.comm_by_kind.get(kind, []), unit)) * 1e-6
    out = {}
    for kind, rows in per_unit.items():
        count, size, bus, time_s = (extrapolate_per_step([r[i] for r in rows], ti.unit_boundary, grad_accum)
                                    for i in range(4))
        if count or time_s:
            out[kind] = collective_stats(kind, count, size, time_s, bus)
    return out


def stats_from_comms_logger(
    comms_dict: Mapping[str, Mapping[int, Any]], world_size: int, n_steps: int
) -> dict[str, CollectiveStats]:
    """Per-step breakdown from ``deepspeed.comm.comms_logger.comms_dict``
    (``{op_name: {msg_size_bytes: [count, [latency_ms...], [algbw...], [busbw...]]}}``).

    Sizes are converted to the nccl-tests convention (all_gather: input shard x n). The logger's own
    bandwidth lists are ignored (see the module docstring)."""
    if n_steps < 1:
        raise ValueError("n_steps must be >= 1")
    acc: dict[str, list[float]] = {}
    for op, by_size in comms_dict.items():
        kind = kind_of(op.split("|")[0])  # debug mode appends " | [Caller Func: ...]"
        a = acc.setdefault(kind, [0.0, 0.0, 0.0])
        for msg_size, vals in by_size.items():
            count, latencies_ms = vals[0], vals[1]
            full = msg_size * world_size if kind == M.ALL_GATHER else msg_size
            a[0] += count
            a[1] += full * count
            a[2] += sum(latencies_ms) * 1e-3
    return {k: collective_stats(k, c / n_steps, b / n_steps, t / n_steps)
            for k, (c, b, t) in sorted(acc.items())}
