"""Per-step window figures and the packing used by the cross-rank reduction."""

from __future__ import annotations

import math

import pytest

from scalestudy.measure.comm import collective_stats
from scalestudy.measure.overlap import TraceIntervals
from scalestudy.measure.profiled_window import (
    ProfiledWindow, _pack, _unpack, profiled_micro_batches, window_figures,
)


def test_window_figures_per_step_and_fraction_within_steps_only():
    ti = TraceIntervals(
        device="cpu",
        comm=[(5, 15), (-10, 0), (25, 30)],  # the part before the first step is outside the window
        compute=[(0, 8), (20, 27)],
        units=[(0, 20), (20, 40)], unit_boundary=[True, True],  # two whole steps
    )
    comm_s, exposed_s, frac = window_figures(ti)
    assert comm_s == pytest.approx(15e-6 / 2)
    assert exposed_s == pytest.approx(10e-6 / 2)  # [8, 15] and [27, 30]
    assert frac == pytest.approx(10 / 40)


def test_window_figures_extrapolate_micro_batches_and_keep_the_fraction_a_ratio():
    # A 10-micro-batch step, its last two profiled: a plain one (20 us, 5 exposed) and the boundary
    # one (30 us, 12 exposed: the gradient all_reduce after the last backward).
    ti = TraceIntervals(device="cpu", comm=[(0, 5), (20, 32)], compute=[(5, 20), (32, 50)],
                        units=[(0, 20), (20, 50)], unit_boundary=[False, True])
    comm_s, exposed_s, frac = window_figures(ti, grad_accum=10)
    assert exposed_s == pytest.approx((12 + 9 * 5) * 1e-6) and comm_s == pytest.approx(exposed_s)
    assert frac == pytest.approx((12 + 9 * 5) / (30 + 9 * 20))


def test_window_without_step_annotations_is_missing_not_zero():
    assert all(math.isnan(x) for x in window_figures(TraceIntervals(device="cpu")))


def test_profiled_window_is_capped_in_micro_batches_at_any_global_batch():
    # Global batch 2,048 on 8 GPUs (dp 8), micro-batch 1: 256 micro-batches per step; 8 are traced.
    global_batch, dp, micro_batch = 2048, 8, 1
    grad_accum = global_batch // (dp * micro_batch)
    assert grad_accum == 256 and profiled_micro_batches(grad_accum) == 8
    assert profiled_micro_batches(256, cap=16) == 16
    assert profiled_micro_batches(3) == 3 and profiled_micro_batches(1) == 1  # whole (short) steps
    with pytest.raises(ValueError):
        profiled_micro_batches(256, cap=1)  # no plain micro-batch to extrapolate from


def test_pack_unpack_roundtrip_recomputes_bandwidth():
    pw = ProfiledWindow(
        n_steps=3, step_time_s_profiled=0.5, comm_time_s=0.2, comm_exposed_s=0.1, comm_exposed_fraction=0.2,
        comm={"all_gather": collective_stats("all_gather", 4, 4e9, 2.0, 3.5e9)},
        comm_logger={"all_reduce": collective_stats("all_reduce", 1, 1e9, 0.1)},
        grad_accum=16, micro_batches_profiled=8,
    )
    back = _unpack(pw, _pack(pw), 0.5)
    assert back.comm == pw.comm and back.grad_accum == 16 and back.micro_batches_profiled == 8
    assert back.comm["all_gather"].algbw_gbps == pytest.approx(2.0)  # 1 GB per call in 0.5 s
    assert back.comm["all_gather"].busbw_gbps == pytest.approx(1.75)  # bus bytes / time
    assert math.isnan(back.comm_logger["all_reduce"].busbw_gbps)  # NaN bus bytes survive the trip
