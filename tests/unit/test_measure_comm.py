"""nccl-tests bandwidth definitions and the two per-step breakdown sources."""

from __future__ import annotations

import math

import pytest

from scalestudy.measure.comm import bandwidths_gbps, stats_from_comms_logger, stats_from_trace
from scalestudy.metrics import busbw_factor as bus_factor
from scalestudy.measure.overlap import CollectiveCall, TraceIntervals


@pytest.mark.parametrize("n", [1, 2, 8, 1024])
def test_bus_factors(n):
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert bus_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert bus_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert bus_factor("broadcast", n) == 1 and bus_factor("send_recv", n) == 1
    assert math.isnan(bus_factor("barrier", n))


def test_bandwidths_in_gb_per_s():
    # 8 ranks all-reduce 1 GB in 0.1 s: algbw 10 GB/s, busbw 10 * 2 * 7 / 8 = 17.5 GB/s
    algbw, busbw = bandwidths_gbps("all_reduce", 1e9, 0.1, 8)
    assert algbw == pytest.approx(10.0) and busbw == pytest.approx(17.5)
    assert all(math.isnan(x) for x in bandwidths_gbps("all_reduce", 1e9, 0.0, 8))


def test_comms_logger_units_and_all_gather_size():
    # DeepSpeed: {op: {msg_size_bytes: [count, [latency_ms], [algbw], [busbw]]}}; the all_gather size
    # is the input shard. 2 steps on 4 ranks.
    raw = {
        "all_gather_into_tensor": {1000: [4, [2.0, 2.0, 2.0, 2.0], [0] * 4, [0] * 4]},
        "all_reduce": {8: [2, [1.0, 3.0], [0, 0], [0, 0]], 4000: [2, [5.0, 5.0], [0, 0], [0, 0]]},
        "reduce_scatter_tensor | [Caller Func: f]": {4000: [2, [1.0, 1.0], [0, 0], [0, 0]]},
    }
    s = stats_from_comms_logger(raw, world_size=4, n_steps=2)
    assert s["all_gather"].count == 2 and s["all_gather"].bytes == 2 * 4000  # shard x 4 ranks
    assert s["all_gather"].time_s == pytest.approx(4e-3)  # ms -> s, per step
    assert s["all_reduce"].count == 2 and s["all_reduce"].bytes == 4008
    assert s["reduce_scatter"].bytes == 4000
    # per call: 4000 B in 1 ms -> 4e-3 GB/s algbw, x 3/4 bus
    assert s["reduce_scatter"].algbw_gbps == pytest.approx(4e-3)
    assert s["reduce_scatter"].busbw_gbps == pytest.approx(3e-3)


def test_trace_stats_count_calls_inside_the_steps_only():
    ti = TraceIntervals(
        device="cpu",
        calls=[CollectiveCall("all_gather", 100, 5, 6), CollectiveCall("all_gather", 100, 15, 16),
               CollectiveCall("all_gather", 100, 50, 51)],  # the last is after the window
        comm_by_kind={"all_gather": [(6, 10), (8, 12), (16, 18), (50, 60)]},
        steps=[(0, 10), (10, 20)],
    )
    s = stats_from_trace(ti, world_size=2, n_steps=2)
    assert s["all_gather"].count == 1 and s["all_gather"].bytes == 100
    assert s["all_gather"].time_s == pytest.approx((6 + 2) * 1e-6 / 2)  # union, clipped to [0, 20]
