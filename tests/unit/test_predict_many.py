"""predict_many: the same results as one call each, no cyclic garbage, the collector as found."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from scalestudy.perfmodel.predict import predict, predict_many, predict_planned
from scalestudy.spec.load import load_spec, plan

PAPER = Path(__file__).parents[2] / "experiments" / "paper"


@pytest.fixture(scope="module")
def planned():
    trials = plan(load_spec(PAPER / "model_parallel.yaml")) + plan(load_spec(PAPER / "power.yaml"))
    assert any(not p.feasible for p in trials) and any(p.feasible for p in trials)
    return trials


def test_same_results_as_one_call_each_for_planned_trials_and_configs(planned):
    feasible = [p.config for p in planned if p.feasible]
    many = predict_many([*planned, *feasible])
    one = [predict_planned(p) for p in planned] + [predict(c) for c in feasible]
    assert [r.model_dump_json() for r in many] == [r.model_dump_json() for r in one]
    assert {r.status.value for r in many} == {"completed", "infeasible"}


def test_a_batch_leaves_no_cyclic_garbage(planned):
    """Why pausing the collector is safe: what a prediction drops, reference counting frees."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        predict_many(planned)  # results dropped at once
        assert gc.collect() == 0
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_left_as_it_was_even_when_a_trial_fails(planned, enabled):
    was_enabled = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        assert len(predict_many(planned[:3])) == 3
        assert gc.isenabled() is enabled
        with pytest.raises(AttributeError):
            predict_many([planned[0], "not a trial"])
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was_enabled else gc.disable)()
