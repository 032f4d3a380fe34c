"""The step-level factors: what they multiply in the model, and calibrate's solve for them."""

from __future__ import annotations

import pytest

from scalestudy.calibrate.reference_step import factors, reference_config, solve_factor
from scalestudy.perfmodel.compute import compute_times
from scalestudy.perfmodel.params import params_for
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
