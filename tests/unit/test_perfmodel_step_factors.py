"""The step-level factors: what they multiply in the model, and calibrate's solve for them."""

from __future__ import annotations

import pytest

from scalestudy.calibrate.reference_step import factors, reference_config, solve_factor
from scalestudy.perfmodel.compute import compute_times
from scalestudy.perfmodel.params import params_for, without_precision_ratios
from scalestudy.perfmodel.predict import simulate
from scalestudy.spec import catalog

CPU = catalog.get_hardware("cpu-local")


def _step_s(cfg, **params) -> float:
    return simulate(cfg, params_for(cfg.hardware_profile, **params))[0].step_s


def test_in_step_slowdown_scales_forward_and_backward_not_the_optimizer():
    cfg = reference_config("bf16", 1)
    base = compute_times(cfg, params_for(CPU))
    slow = compute_times(cfg, params_for(CPU, in_step_slowdown=1.5))
    assert slow.forward_s == pytest.approx(1.5 * base.forward_s)
    assert slow.backward_s == pytest.approx(1.5 * base.backward_s)
    assert slow.optimizer_s == base.optimizer_s  # measured inside an engine step


def test_shared_node_slowdown_applies_only_when_devices_share_the_node():
    alone, shared = reference_config("bf16", 1), reference_config("bf16", 2)
    p = params_for(CPU, shared_node_slowdown=2.0)
    assert compute_times(alone, p).forward_s == compute_times(alone, params_for(CPU)).forward_s
    assert compute_times(shared, p).forward_s == pytest.approx(
        2.0 * compute_times(shared, params_for(CPU)).forward_s)


@pytest.mark.parametrize("name, world", [("in_step_slowdown", 1), ("shared_node_slowdown", 2)])
def test_solve_factor_recovers_the_factor_behind_a_step_time(name, world):
    cfg = reference_config("bf16", world)
    assert solve_factor(cfg, name, _step_s(cfg, **{name: 1.37})) == pytest.approx(1.37, rel=1e-6)


def test_solve_factor_clamps_to_its_physical_range():
    cfg = reference_config("fp32", 1)
    assert solve_factor(cfg, "in_step_slowdown", 0.5 * _step_s(cfg)) == 1.0  # faster than the parts
    assert solve_factor(cfg, "in_step_slowdown", 1e3 * _step_s(cfg)) == 8.0


def test_factors_solve_the_shared_slowdown_with_the_in_step_one_fixed():
    one, two = reference_config("bf16", 1), reference_config("bf16", 2)
    measured_1 = _step_s(one, in_step_slowdown=1.2)
    measured_2 = _step_s(two, in_step_slowdown=1.2, shared_node_slowdown=1.3)
    out = factors(CPU, "cpu-local", {"bf16": measured_1}, {"bf16": measured_2}, world=2)
    assert out["in_step_slowdown"] == pytest.approx(1.2, rel=1e-6)
    assert out["shared_node_slowdown"] == pytest.approx(1.3, rel=1e-6)
    assert "shared_node_slowdown" not in factors(CPU, "cpu-local", {"bf16": measured_1})


def test_reference_shape_is_not_the_quickstart_shape():
    # The measured-CPU validation compares against the quick start: the reference must differ.
    from scalestudy.spec.load import load_spec
    from scalestudy.plan import plan_study
    from tests.conftest import QUICKSTART

    ref = reference_config("bf16", 1)
    for planned in plan_study(load_spec(QUICKSTART)):
        c = planned.config
        assert (c.micro_batch, c.seq_len) != (ref.micro_batch, ref.seq_len)


def test_factors_are_solved_per_precision_and_kept_as_ratios_to_their_median():
    """fp32's parts 20% under its step, bf16's 20% over (the in-step factor below 1: params.py); the
    TP overhead twice as large in bf16. The profile keeps the medians and each precision's ratio,
    and predicts each precision's measured reference steps from them."""
    truth = {"fp32": {"in_step_slowdown": 1.2, "tp_collective_overhead_s": 1e-3},
             "bf16": {"in_step_slowdown": 0.8, "tp_collective_overhead_s": 2e-3}}
    measured = {kind: {p: _step_s(reference_config(p, ws, tp=tp), **truth[p]) for p in truth}
                for kind, ws, tp in (("alone", 1, 1), ("shared", 2, 1), ("tp", 2, 2))}
    out = factors(CPU, "cpu-local", measured["alone"], measured["shared"], world=2,
                  tp_s=measured["tp"])
    assert out["in_step_slowdown"] == pytest.approx(1.0, rel=1e-6)
    assert out["in_step_slowdown_ratio_fp32"] == pytest.approx(1.2, rel=1e-6)
    assert out["in_step_slowdown_ratio_bf16"] == pytest.approx(0.8, rel=1e-6)
    assert out["tp_collective_overhead_s_ratio_bf16"] == pytest.approx(
        2 * out["tp_collective_overhead_s_ratio_fp32"], rel=1e-4)
    assert out["shared_node_slowdown"] == pytest.approx(1.0, abs=1e-6)
    profile = CPU.model_copy(update={"calibration": {**CPU.calibration, **out}})
    for kind, ws, tp in (("alone", 1, 1), ("shared", 2, 1), ("tp", 2, 2)):
        for p in truth:
            cfg = reference_config(p, ws, tp=tp).model_copy(update={"hardware_profile": profile})
            assert _step_s(cfg) == pytest.approx(measured[kind][p], rel=1e-4)
    # A new calibration starts without them: none outlives the medians it was taken against.
    assert not any("_ratio_" in k for k in without_precision_ratios(profile.calibration))


def test_an_overhead_solved_at_zero_for_one_precision_stays_zero():
    """A quick calibration on the 2-core EPYC (2026-12-07) solved bf16's TP overhead at 0 and fp32's
    above it: bf16's ratio is 0, which the model must read as 0, not as 'not calibrated' (1)."""
    truth = {"fp32": 2e-3, "bf16": 0.0}
    tp_s = {p: _step_s(reference_config(p, 2, tp=2), tp_collective_overhead_s=v)
            for p, v in truth.items()}
    alone = {p: _step_s(reference_config(p, 1)) for p in truth}
    shared = {p: _step_s(reference_config(p, 2)) for p in truth}
    out = factors(CPU, "cpu-local", alone, shared, world=2, tp_s=tp_s)
    assert out["tp_collective_overhead_s_ratio_bf16"] == pytest.approx(0.0, abs=1e-6)
    profile = CPU.model_copy(update={"calibration": {**CPU.calibration, **out}})
    cfg = reference_config("bf16", 2, tp=2).model_copy(update={"hardware_profile": profile})
    assert _step_s(cfg) == pytest.approx(tp_s["bf16"], rel=1e-4)


def test_the_pipeline_factor_is_kept_per_precision_too():
    """One calibration solved the pipeline factor 20% apart between fp32 and emulated bf16; kept as
    one median, each precision's pipeline reference came back 9-11% off in sample."""
    truth = {"fp32": 0.75, "bf16": 0.95}
    alone = {p: _step_s(reference_config(p, 1)) for p in truth}
    shared = {p: _step_s(reference_config(p, 2)) for p in truth}
    piped = {p: _step_s(reference_config(p, 2, pp=2), pipeline_compute_factor=f)
             for p, f in truth.items()}
    out = factors(CPU, "cpu-local", alone, shared, world=2, pp_s=piped)
    profile = CPU.model_copy(update={"calibration": {**CPU.calibration, **out}})
    for p in truth:
        cfg = reference_config(p, 2, pp=2).model_copy(update={"hardware_profile": profile})
        assert _step_s(cfg) == pytest.approx(piped[p], rel=1e-4)
