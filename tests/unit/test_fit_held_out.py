"""`scalestudy fit` scores trials it did not fit: each trial's held-out prediction comes from a fit
without it (leave-one-out, k-fold beyond LOO_MAX_TRIALS)."""

from __future__ import annotations

import pytest

from scalestudy.perfmodel import fit as F
from scalestudy.perfmodel.params import params_for
from scalestudy.spec import catalog
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand


def _configs():
    spec = validate_spec({"name": "t", "model": "llama2-tiny", "hardware": "cpu-local",
                          "precision": "fp32", "world_size": [1, 2], "zero_stage": [0, 3],
                          "micro_batch": [1, 4]})
    return [p.config for p in expand(spec)]


def test_held_out_predictions_differ_from_the_fit_and_recover_a_consistent_truth():
    hw = catalog.get_hardware("cpu-local")
    cfgs = _configs()
    truth = params_for(hw, in_step_slowdown=2.0, shared_node_slowdown=1.3, step_overhead_s=0.004)
    measured = [F.tokens_per_s(c, truth) for c in cfgs]
    held, label = F.held_out_predictions(cfgs, measured, hw)
    assert label == "leave-one-out" and len(held) == len(cfgs)
    assert F.FitResult.mape(held, measured) < 0.02  # data the model can express: predicted
    # Noise on one trial: the fit absorbs part of it in sample, none of it out of sample.
    noisy = list(measured)
    noisy[0] *= 1.5
    res = F.fit(cfgs, noisy, hw)
    held, _ = F.held_out_predictions(cfgs, noisy, hw)
    assert abs(held[0] / noisy[0] - 1) > abs(res.predicted_after[0] / noisy[0] - 1)


def test_k_fold_beyond_the_leave_one_out_limit(monkeypatch):
    hw = catalog.get_hardware("cpu-local")
    cfgs = _configs()
    measured = [F.tokens_per_s(c, params_for(hw)) for c in cfgs]
    monkeypatch.setattr(F, "LOO_MAX_TRIALS", 4)
    monkeypatch.setattr(F, "K_FOLDS", 3)
    held, label = F.held_out_predictions(cfgs, measured, hw)
    assert label == "3-fold" and all(h == h for h in held)
    with pytest.raises(ValueError):
        F.held_out_predictions(cfgs[:1], measured[:1], hw)
