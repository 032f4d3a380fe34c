"""The comparison's arithmetic (perfmodel/ensemble.py compare), the same for measured and predicted
groups: aggregates, energy attributed per member by its meter, the fallback without a meter, the
members' overlap, and a group with a failed member."""

from __future__ import annotations

import math

import pytest

from scalestudy import metrics as M
from scalestudy.metrics import EnsembleRole, Status, TrialResult
from scalestudy.perfmodel.ensemble import NOT_CONCURRENT_K1, compare, windows_overlap
from scalestudy.plan import plan_study
from scalestudy.plan.ensemble import plan_ensemble
from scalestudy.spec.load import validate_spec
from scalestudy.sweep.ensemble import timed_window, with_window

BUDGET = 1e9


def _members(source: str, tps=(1000.0, 500.0), energy_j=(10.0, 12.0), steps=10,
             windows=((100.0, 110.0), (101.0, 111.0))):
    """Two measured members on one device each (tokens_per_step 512), as the sweep tags them."""
    spec = validate_spec({"name": "e", "model": "llama2-tiny", "hardware": "cpu-local",
                          "world_size": 2, "micro_batch": 4,
                          "ensemble": {"members": [2], "token_budget": BUDGET}})
    [c] = plan_ensemble(spec, plan_study(spec))
    out = []
    for slot, t, e, (a, b) in zip(c.groups[0], tps, energy_j, windows):
        cfg = slot.entry.config
        tokens = cfg.tokens_per_step * steps
        fields = dict(tokens_per_s=t, model_tflops_per_device=t * 3e6 / 1e12, energy_source=source,
                      timed_window_start_epoch_s=a, timed_window_end_epoch_s=b)
        if source != "none":
            fields.update(energy_j=e, energy_per_token_j=e / tokens)
        else:
            fields.update(missing={M.ENERGY_J: "no RAPL here"})
        out.append(slot.tag(TrialResult.from_config(cfg, Status.completed, **fields), c))
    return out


def test_rapl_energy_is_attributed_by_device_share_and_aggregated():
    a, b = compare(_members("rapl"))
    # each member saw the whole machine; its share is 1 of the group's 2 devices
    assert a.energy_attributed_j == pytest.approx(5.0)
    assert b.energy_attributed_j == pytest.approx(6.0)
    e_a, e_b = 10.0 / 5120 / 2, 12.0 / 5120 / 2  # attributed J per token
    assert a.ensemble_tokens_per_s == b.ensemble_tokens_per_s == 1500.0
    power = 1000 * e_a + 500 * e_b
    assert a.ensemble_tokens_per_j == pytest.approx(1500 / power)
    assert a.ensemble_model_flops_per_j == pytest.approx(1500 * 3e6 / power)
    assert a.model_flops_per_j == pytest.approx(3e6 / e_a)
    assert a.ensemble_device_s_per_token == pytest.approx(2 / 1500)
    assert a.device_s_per_token == pytest.approx(1 / 1000)
    assert a.time_to_budget_s == pytest.approx(BUDGET / 1000)
    assert a.ensemble_time_to_budget_s == pytest.approx(BUDGET / 500)  # the slowest member's
    assert a.ensemble_energy_to_budget_j == pytest.approx(BUDGET * (e_a + e_b))
    assert a.ensemble_overlap_fraction == pytest.approx(0.9)  # 101..110 of two 10 s windows
    assert a.ensemble_energy_source == "rapl" and a.ensemble_k == 2 and b.member_index == 1


def test_nvml_energy_is_each_members_own():
    a, _ = compare(_members("nvml"))
    assert a.energy_attributed_j == pytest.approx(10.0)
    assert a.model_flops_per_j == pytest.approx(3e6 / (10.0 / 5120))


def test_without_a_meter_energy_is_nan_with_the_reason_and_device_seconds_remain():
    a, b = compare(_members("none"))
    for name in (M.ENSEMBLE_TOKENS_PER_J, M.ENSEMBLE_MODEL_FLOPS_PER_J, M.MODEL_FLOPS_PER_J,
                 M.ENERGY_TO_BUDGET_J, M.ENERGY_ATTRIBUTED_J):
        assert math.isnan(getattr(a, name)) and a.missing[name] == "no RAPL here"
    assert a.ensemble_device_s_per_token == pytest.approx(2 / 1500)
    assert a.ensemble_model_flops_per_device_s == pytest.approx(1500 * 3e6 / 2)
    assert math.isfinite(b.ensemble_overlap_fraction)


def test_overlap_is_the_time_all_ran_over_the_shortest_window():
    assert windows_overlap([(0, 10), (0, 10)]) == 1.0
    assert windows_overlap([(0, 10), (5, 25)]) == 0.5
    assert windows_overlap([(0, 10), (10, 20)]) == 0.0
    assert windows_overlap([(0, 10), (2, 4), (3, 12)]) == 0.5  # 3..4 of the 2 s window


def test_a_group_with_a_failed_member_has_no_aggregate():
    a, b = _members("none")
    failed = b.model_copy(update={"status": Status.failed, "reason": "oom: boom"})
    out = compare([a, failed])
    assert math.isnan(out[0].ensemble_tokens_per_s)
    assert "member 1 of the group did not complete (failed: oom: boom)" in (
        out[0].missing[M.ENSEMBLE_TOKENS_PER_S])


def test_a_group_of_one_has_no_overlap():
    single = _members("none")[0].model_copy(update={M.ENSEMBLE_ROLE: EnsembleRole.single})
    [r] = compare([single])
    assert math.isnan(r.ensemble_overlap_fraction)
    assert r.missing[M.ENSEMBLE_OVERLAP_FRACTION] == NOT_CONCURRENT_K1
    assert r.ensemble_tokens_per_s == r.tokens_per_s


def test_the_timed_window_is_read_off_the_trials_marks():
    r = _members("none")[0].model_copy(update={
        "time_to_first_step_s": 4.0, "extra": {"timing": {"trial_start": 100.0,
                                                          "timed_window_done": 109.5}}})
    assert timed_window(r) == (104.0, 109.5)
    w = with_window(r)
    assert (w.timed_window_start_epoch_s, w.timed_window_end_epoch_s) == (104.0, 109.5)
    failed = with_window(r.model_copy(update={"extra": {}}))
    assert math.isnan(failed.timed_window_start_epoch_s)
    assert M.TIMED_WINDOW_START_EPOCH_S in failed.missing
