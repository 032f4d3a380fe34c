"""Per-step window figures and the packing used by the cross-rank reduction."""

from __future__ import annotations

import math

import pytest

from scalestudy.measure.comm import collective_stats
from scalestudy.measure.overlap import TraceIntervals
from scalestudy.measure.profiled_window import ProfiledWindow, _pack, _unpack, window_figures


def test_window_figures_per_step_and_fraction_within_steps_only():
    ti = TraceIntervals(
        device="cpu",
        comm=[(5, 15), (-10, 0), (25, 30)],  # the part before the first step is outside the window
        compute=[(0, 8), (20, 27)],
        steps=[(0, 20), (20, 40)],
    )
    comm_s, exposed_s, frac = window_figures(ti, n_steps=2)
    assert comm_s == pytest.approx(15e-6 / 2)
    assert exposed_s == pytest.approx(10e-6 / 2)  # [8, 15] and [27, 30]
    assert frac == pytest.approx(10 / 40)


def test_window_without_step_annotations_is_missing_not_zero():
    assert all(math.isnan(x) for x in window_figures(TraceIntervals(device="cpu"), 1))


def test_pack_unpack_roundtrip_recomputes_bandwidth():
    pw = ProfiledWindow(
        n_steps=3, step_time_s_profiled=0.5, comm_time_s=0.2, comm_exposed_s=0.1, comm_exposed_fraction=0.2,
        comm={"all_gather": collective_stats("all_gather", 4, 4e9, 2.0, 8)},
        comm_logger={"all_reduce": collective_stats("all_reduce", 1, 1e9, 0.1, 8)},
    )
    back = _unpack(pw, _pack(pw), 0.5, 8)
    assert back == pw
    assert back.comm["all_gather"].algbw_gbps == pytest.approx(2.0)  # 1 GB per call in 0.5 s
