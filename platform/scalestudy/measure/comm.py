"""Communication accounting: nccl-tests bandwidths and per-step breakdowns per collective kind.

Bandwidths follow nccl-tests' doc/PERFORMANCE.md: for a collective of size S bytes taking t seconds,
algbw = S / t and busbw = algbw * metrics.busbw_factor(kind, n), with S the full buffer (for all_gather
the gathered output, for reduce_scatter the unscattered input). Reported in GB/s (1e9 bytes/s), as
nccl-tests does.

Two sources, one schema (dict[kind -> CollectiveStats] per optimizer step):

* ``stats_from_trace``: the torch.profiler trace of the profiled window (primary). Count and bytes come
  from the ``c10d::*`` ops the caller issued (record_shapes=True gives their tensor shapes); time per kind
  from what executed them (gloo worker spans on CPU, NCCL kernels on GPU). Correct on both backends,
  including async ops and gloo's reduce_scatter-as-all_reduce.
* ``stats_from_comms_logger``: DeepSpeed's comms logger. Verified in deepspeed 0.19.8
  (deepspeed/comm/comm.py ``timed_op``, utils/comms_logging.py): keys are DeepSpeed op names; msg size is
  bytes of the op's ``tensor`` argument, which is the *input*: the shard for all_gather_into_tensor but
  the full buffer for reduce_scatter_tensor (DeepSpeed then multiplies both by n, overstating
  reduce_scatter bandwidth n-fold, so we recompute bandwidths here); latencies are milliseconds
  (host wall clock on CPU, CUDA events on GPU). For async ops the latency is launch time only on CPU (the
  CPU accelerator's synchronize is a no-op), and on GPU the logger synchronises the device after every
  op, destroying overlap: so use it for counts and bytes, never for overlap, and never in the timed window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from scalestudy.metrics import CollectiveStats, busbw_factor
from scalestudy.measure.overlap import TraceIntervals, clip, kind_of, measure

NAN = float("nan")


def bandwidths_gbps(kind: str, size_bytes: float, time_s: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s; NaN when there is no time or no payload to divide."""
    if not (time_s > 0) or not (size_bytes > 0):
        return NAN, NAN
    algbw = size_bytes / time_s / 1e9
    return algbw, algbw * busbw_factor(kind, n)


def collective_stats(kind: str, count: float, size_bytes: float, time_s: float, n: int) -> CollectiveStats:
    """Per-step stats; bandwidth uses the mean size per call over the mean time per call."""
    per_call_bytes = size_bytes / count if count else 0.0
    per_call_s = time_s / count if count else 0.0
    algbw, busbw = bandwidths_gbps(kind, per_call_bytes, per_call_s, n)
    return CollectiveStats(count=count, bytes=size_bytes, time_s=time_s, algbw_gbps=algbw, busbw_gbps=busbw)


def stats_from_trace(ti: TraceIntervals, world_size: int, n_steps: int) -> dict[str, CollectiveStats]:
    """Per-step breakdown from a parsed profiler trace, restricted to the profiled steps' span.

    time_s per kind is the union of that kind's executed spans (concurrent calls of one kind count
    once), so kinds can overlap each other and their sum can exceed ``comm_time_s``."""
    if n_steps < 1:
        raise ValueError("n_steps must be >= 1")
    window = (ti.steps[0][0], ti.steps[-1][1]) if ti.steps else (-math.inf, math.inf)
    counts: dict[str, float] = {}
    sizes: dict[str, float] = {}
    for c in ti.calls:
        if window[0] <= c.start_us <= window[1]:
            counts[c.kind] = counts.get(c.kind, 0) + 1
            sizes[c.kind] = sizes.get(c.kind, 0) + c.bytes
    out = {}
    for kind in sorted(set(counts) | set(ti.comm_by_kind)):
        time_s = measure(clip(ti.comm_by_kind.get(kind, []), window)) * 1e-6
        out[kind] = collective_stats(kind, counts.get(kind, 0) / n_steps, sizes.get(kind, 0) / n_steps,
                                     time_s / n_steps, world_size)
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
            full = msg_size * world_size if kind == "all_gather" else msg_size
            a[0] += count
            a[1] += full * count
            a[2] += sum(latencies_ms) * 1e-3
    return {k: collective_stats(k, c / n_steps, b / n_steps, t / n_steps, world_size)
            for k, (c, b, t) in sorted(acc.items())}
