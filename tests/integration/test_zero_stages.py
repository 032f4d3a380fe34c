"""Real DeepSpeed trials on 2 CPU workers (Ray actors, one warm group for the module, as a sweep
runs them): ZeRO does not change the maths."""

from __future__ import annotations

import math

import pytest

from scalestudy.metrics import Status
from tests.conftest import trial

STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def fp32_results(warm_trial):
    out = {}
    for stage in STAGES:
        cfg = trial(["world_size=2", "tp=1", f"zero_stage={stage}", "precision=fp32", "micro_batch=2",
                     "steps={warmup: 2, measure: 8, profile: 0}"])
        out[stage] = warm_trial(cfg)
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_stage_trains_and_reports(fp32_results, stage):
    r = fp32_results[stage]
    assert r.status is Status.completed, r.reason
    assert r.loss_last < r.loss_first
    assert len(r.losses) == 10 and len(r.step_times_s) == 8
    assert r.tokens_per_s > 0 and 0 < r.mfu < 1
    assert r.world_size == 2 and r.dp == 2 and r.zero_stage == stage
    assert r.peak_memory_gib > 0 and r.memory_source == "process_peak_rss"


def test_stages_agree_in_fp32(fp32_results):
    ref = fp32_results[0].losses
    for stage in STAGES[1:]:
        for a, b in zip(ref, fp32_results[stage].losses):
            assert math.isclose(a, b, rel_tol=1e-3), (stage, ref, fp32_results[stage].losses)
