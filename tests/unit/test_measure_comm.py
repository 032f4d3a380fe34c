"""nccl-tests bandwidth definitions, per-call group sizes, micro-batch extrapolation, the two sources."""

from __future__ import annotations

import math

import pytest

from scalestudy.measure.comm import (
    bandwidths_gbps, bus_bytes, collective_stats, extrapolate_per_step, stats_from_comms_logger,
    stats_from_trace,
)
from scalestudy.measure.overlap import CollectiveCall, TraceIntervals
from scalestudy.metrics import busbw_factor


@pytest.mark.parametrize("n", [1, 2, 8, 1024])
def test_busbw_factors(n):
    assert busbw_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert busbw_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert busbw_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert busbw_factor("all_to_all", n) == pytest.approx((n - 1) / n)
    for kind in ("broadcast", "reduce", "send_recv", "barrier", "other"):
        assert busbw_factor(kind, n) == 1


def test_busbw_factor_rejects_an_empty_group():
    with pytest.raises(ValueError, match="group size"):
        busbw_factor("all_reduce", 0)


def test_bandwidths_in_gb_per_s():
    # 8 ranks all-reduce 1 GB in 0.1 s: algbw 10 GB/s, busbw 10 * 2 * 7 / 8 = 17.5 GB/s
    algbw, busbw = bandwidths_gbps("all_reduce", 1e9, 0.1, 8)
    assert algbw == pytest.approx(10.0) and busbw == pytest.approx(17.5)
    assert all(math.isnan(x) for x in bandwidths_gbps("all_reduce", 1e9, 0.0, 8))


def test_busbw_uses_each_calls_own_group():
    """One kind in two group sizes (tp = 2 and dp = 4 all_reduces): bus bytes add per call."""
    bb = bus_bytes("all_reduce", 100, 2) + bus_bytes("all_reduce", 100, 4)
    assert bb == pytest.approx(100 * 1.0 + 100 * 1.5)
    st = collective_stats("all_reduce", 2, 200, 1e-6, bb)
    assert st.algbw_gbps == pytest.approx(0.2) and st.busbw_gbps == pytest.approx(0.25)
    assert math.isnan(bus_bytes("all_reduce", 100, None))  # unknown group: NaN, not a guess


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
    # per call: 4000 B in 1 ms -> 4e-3 GB/s algbw; the logger knows no group, so no busbw
    assert s["reduce_scatter"].algbw_gbps == pytest.approx(4e-3)
    assert math.isnan(s["reduce_scatter"].busbw_gbps)


def test_extrapolation_from_the_last_micro_batches():
    # 16 micro-batches per step, the last 4 profiled: 3 plain (10 each) and the boundary (25).
    assert extrapolate_per_step([10, 10, 10, 25], [False, False, False, True], 16) == 25 + 15 * 10
    # every micro-batch profiled: exactly their sum
    assert extrapolate_per_step([1, 2, 3, 4], [False, False, False, True], 4) == 10
    # whole steps: the mean step
    assert extrapolate_per_step([4, 6], [True, True], 1) == 5
    assert math.isnan(extrapolate_per_step([1, 2], [False, False], 4))  # no step end in the window
    with pytest.raises(ValueError):
        extrapolate_per_step([1, 2], [False, True], 1)


def test_trace_stats_count_calls_inside_the_units_and_extrapolate():
    # Units: a plain micro-batch [0, 10] and the boundary one [10, 20] of a 4-micro-batch step.
    ti = TraceIntervals(
        device="cpu",
        calls=[CollectiveCall("all_gather", 100, 5, 6, group_size=2),
               CollectiveCall("all_gather", 100, 15, 16, group_size=2),
               CollectiveCall("all_reduce", 40, 17, 18, group_size=4),  # the boundary's gradient sum
               CollectiveCall("all_gather", 100, 50, 51, group_size=2)],  # after the window
        comm_by_kind={"all_gather": [(6, 10), (8, 12), (16, 18), (50, 60)], "all_reduce": [(18, 19)]},
        units=[(0, 10), (10, 20)], unit_boundary=[False, True],
    )
    s = stats_from_trace(ti, grad_accum=4)
    # all_gather: 1 per micro-batch -> 4 per step; all_reduce only at the boundary -> 1 per step
    assert s["all_gather"].count == 4 and s["all_gather"].bytes == 400
    assert s["all_gather"].bus_bytes == pytest.approx(400 * 0.5)
    assert s["all_reduce"].count == 1 and s["all_reduce"].bus_bytes == pytest.approx(40 * 1.5)
    # time: plain unit 4 us (union [6, 10]), boundary unit 2 + 2 = 4 us ([10, 12] and [16, 18])
    assert s["all_gather"].time_s == pytest.approx((4 + 3 * 4) * 1e-6)
    assert s["all_reduce"].time_s == pytest.approx(1e-6)
