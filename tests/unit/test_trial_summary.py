"""The trial summary (train/summary.py) is typed and closed, and train/result.py derives every metric
from it once: throughput, energy per token and tokens per joule, the utilization column, and a reason
for each NaN."""

from __future__ import annotations

import ast
import math
import pickle
from pathlib import Path

import pydantic
import pytest

from scalestudy import metrics as M
from scalestudy.measure.comm import collective_stats
from scalestudy.measure.energy import EnergyReading
from scalestudy.measure.memory import MemoryReading
from scalestudy.measure.meters import MeterResult
from scalestudy.measure.profiled_window import ProfiledWindow
from scalestudy.spec.study import StudySpec, expand
from scalestudy.train.result import NO_PROFILED_WINDOW, summarize
from scalestudy.train.summary import MemoryPeaks, TrialSummary

REPO = Path(__file__).parents[2]
NAN = float("nan")


def _cfg():
    (planned,) = expand(StudySpec(name="s", model="llama2-tiny", hardware="cpu-local", world_size=1,
                                  micro_batch=2, seq_len=64, steps={"warmup": 1, "measure": 4}))
    return planned.config


def _summary(**over) -> TrialSummary:
    fields = dict(
        step_times_s=[0.2, 0.1, 0.1, 0.3], losses=[3.0, 2.5, 2.0, 1.5, 1.0], world_size=1,
        grad_accum=1, memory=MemoryPeaks.of(MemoryReading(0.5, missing={M.PEAK_MEMORY_RESERVED_GIB: "cpu"})),
        meters=MeterResult(EnergyReading(64.0, 0.7, {"mean": 91.4}, "rapl", excluded_intervals=2),
                           1.5, M.CPU_UTILIZATION_CORES, devices_utilization=1),
        deepspeed_config={"train_batch_size": 2}, timing={"model_built": 5.0})
    return TrialSummary(**{**fields, **over})


def test_a_misspelt_field_fails_where_the_summary_is_built():
    with pytest.raises(pydantic.ValidationError, match="restart"):
        _summary(restart=1)
    with pytest.raises(pydantic.ValidationError):
        _summary(step_times_s="fast")


def test_the_summary_travels_pickled_as_it_is():
    s = _summary(profiled=ProfiledWindow(1, 0.2, 0.05, 0.01, 0.05,
                                         comm={M.ALL_REDUCE: collective_stats(M.ALL_REDUCE, 2, 1e6, 0.01)}))
    back = pickle.loads(pickle.dumps(s))
    assert repr(back) == repr(s)  # NaN fields (bus bytes here) compare unequal, their reprs do not


def test_memory_peaks_hold_every_field_of_a_memory_reading():
    r = MemoryReading(1.0, 2.0, 3.0, "cuda_allocator", {M.DEVICE_MEMORY_USED_GIB: "no NVML"})
    p = MemoryPeaks.of(r)
    assert (p.allocated_gib, p.reserved_gib, p.device_used_gib, p.source, p.missing) == (
        1.0, 2.0, 3.0, "cuda_allocator", r.missing)


def test_metrics_are_derived_from_the_readings():
    cfg = _cfg()
    r = summarize(cfg, _summary(), t0=0.0)
    tokens = cfg.tokens_per_step * 4  # the timed steps' tokens
    assert r.step_time_s == pytest.approx(0.15)  # the median
    assert r.tokens_per_s == cfg.tokens_per_step / r.step_time_s
    assert r.energy_j == 64.0 and r.power_w == 91.4 and r.energy_source == "rapl"
    assert r.energy_per_token_j == 64.0 / tokens and r.tokens_per_j == tokens / 64.0
    assert r.cpu_utilization_cores == 1.5 and math.isnan(r.device_utilization_pct)
    assert r.peak_memory_gib == 0.5 and r.memory_source == "process_peak_rss"
    assert r.missing[M.PEAK_MEMORY_RESERVED_GIB] == "cpu"
    assert r.missing[M.COMM_TIME_S] == NO_PROFILED_WINDOW and r.comm == {}
    assert (r.loss_first, r.loss_last) == (3.0, 1.0)
    assert r.extra["energy_excluded_intervals"] == 2 and r.extra["profiled_window"] is None
    assert r.extra["timing"] == {"trial_start": 0.0, "model_built": 5.0}


def test_every_nan_has_its_reason():
    s = _summary(meters=MeterResult(EnergyReading(NAN, 0.7, source="none", reason="no RAPL here"),
                                    NAN, M.DEVICE_UTILIZATION_PCT, "NVML unavailable (no driver)"))
    r = summarize(_cfg(), s, t0=0.0)
    for name in (M.ENERGY_J, M.POWER_W, M.ENERGY_PER_TOKEN_J, M.TOKENS_PER_J):
        assert math.isnan(getattr(r, name)) and r.missing[name] == "no RAPL here"
    assert math.isnan(r.device_utilization_pct)
    assert r.missing[M.DEVICE_UTILIZATION_PCT] == "NVML unavailable (no driver)"


def test_the_profiled_window_fills_the_comm_columns():
    pw = ProfiledWindow(2, 0.25, 0.05, 0.02, 0.08,
                        comm={M.ALL_GATHER: collective_stats(M.ALL_GATHER, 3, 3e6, 0.01)},
                        trace_device="cpu", grad_accum=4, micro_batches_profiled=2)
    r = summarize(_cfg(), _summary(profiled=pw), t0=0.0)
    assert (r.comm_time_s, r.comm_exposed_s, r.comm_exposed_fraction, r.step_time_s_profiled) == (
        0.05, 0.02, 0.08, 0.25)
    assert r.comm[M.ALL_GATHER].count == 3 and M.COMM_TIME_S not in r.missing
    assert r.extra["profiled_window"] == {"steps": 2, "micro_batches": 2, "grad_accum": 4}


def _callers(function: str) -> set[str]:
    """Files of the platform that call `function` by name."""
    out = set()
    for path in (REPO / "platform" / "scalestudy").rglob("*.py"):
        calls = (n.func for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call))
        if any(getattr(f, "id", getattr(f, "attr", None)) == function for f in calls):
            out.add(path.relative_to(REPO).as_posix())
    return out


def test_measured_metrics_are_derived_in_one_place():
    # energy was computed twice (the meters' summary in the body, then again here): once now
    assert _callers("energy_metrics") == {"platform/scalestudy/train/result.py"}
    assert _callers("throughput_metrics") == {"platform/scalestudy/train/result.py"}
