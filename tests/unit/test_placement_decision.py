"""Where a measured trial's workers go (launch/placement.py) and what the layout refuses of its nodes
(parallel/layout.py): pure decisions, no Ray started."""

from __future__ import annotations

import pytest

from scalestudy.errors import InfeasibleTrial
from scalestudy.parallel.layout import Layout
from scalestudy.spec.study import StudySpec, expand
from scalestudy.launch.placement import (health_check_interval_s, local_shortfall, placement_for,
                                        tp_node_reason)


def _trials(**fields):
    spec = StudySpec(name="p", model="llama2-tiny", **{"backend": "measure", **fields})
    return expand(spec)


def test_placement_fits_one_node_is_strict_pack():
    (planned,) = _trials(hardware="h100-80gb", world_size=8)
    p = placement_for(planned.config)
    assert planned.feasible
    assert p.placement_strategy == "STRICT_PACK" and p.num_workers == 8
    assert p.accelerator_type == "H100" and p.use_gpu
    assert p.resources_per_worker == {"GPU": 1.0, "CPU": 8.0}  # from the profile, not launch.py


def test_placement_larger_trials_take_whole_nodes():
    whole, partial = _trials(hardware="a100-80gb", world_size=[16, 12])
    assert whole.feasible and placement_for(whole.config).placement_strategy == "PACK"
    assert placement_for(whole.config).accelerator_type == "A100-80G"
    assert not partial.feasible
    assert partial.reason == ("world_size 12 spans nodes but is not a multiple of the 8 devices "
                              "per node of a100-80gb: a trial larger than one node takes whole nodes")


def test_placement_simulated_trials_keep_partial_nodes():
    """The performance model prices a partly filled last node; only measured trials need whole."""
    (planned,) = _trials(hardware="a100-80gb", world_size=12, backend="simulate")
    assert planned.feasible


def test_placement_tp_larger_than_a_node_is_refused():
    with pytest.raises(InfeasibleTrial, match="tp 4 exceeds the 2 devices per node of cpu-local: "
                                              "a TP group would cross nodes"):
        Layout.of(4, tp=4, devices_per_node=2).check_placement("cpu-local")
    Layout.of(4, tp=2, devices_per_node=2).check_placement("cpu-local")


def test_placement_cpu_profile_reserves_cores():
    (planned,) = _trials(hardware="cpu-local", world_size=2)
    p = placement_for(planned.config)
    assert p.resources_per_worker == {"CPU": 1.0} and not p.use_gpu
    assert p.placement_strategy == "STRICT_PACK" and p.accelerator_type is None


def test_placement_elastic_packs_loosely_to_grow_onto_new_nodes():
    (planned,) = _trials(hardware="cpu-local", world_size=2, global_batch=4,
                         elastic={"min_workers": 1, "max_workers": 2},
                         fault_tolerance={"max_failures": 1})
    p = placement_for(planned.config)
    assert p.num_workers == (1, 2) and p.placement_strategy == "PACK"
    assert p.scaling_kwargs()["elastic_resize_monitor_interval_s"] == 60.0
    (wide,) = _trials(hardware="cpu-local", world_size=3, global_batch=6,
                      elastic={"min_workers": 2, "max_workers": 3},
                      fault_tolerance={"max_failures": 1})
    assert wide.feasible, wide.reason  # an elastic world need not fill nodes; its TP groups are checked at start
    assert placement_for(wide.config).placement_strategy == "PACK"


def test_placement_tp_group_across_nodes_has_its_reason():
    lay = Layout.of(4, tp=2, devices_per_node=2)
    assert tp_node_reason(lay, ["nodeAAAA1", "nodeAAAA1", "nodeBBBB2", "nodeBBBB2"]) is None
    reason = tp_node_reason(lay, ["nodeAAAA1", "nodeBBBB2", "nodeBBBB2", "nodeAAAA1"])
    assert reason == ("placement: TP group [0, 1] spans nodes nodeAAAA, nodeBBBB (2 of 2 TP "
                      "groups cross nodes); a TP group must share one node")


def test_placement_health_check_interval():
    (cpu,) = _trials(hardware="cpu-local", world_size=2)
    small, large = _trials(hardware="h100-80gb", world_size=[8, 2048])
    assert health_check_interval_s(cpu.config) == 0.2
    assert health_check_interval_s(small.config) == 2.0  # Ray's default
    assert health_check_interval_s(large.config) == 16.0  # 2048 workers: 128 polls a second


def test_placement_fields_leave_trial_ids_alone():
    (planned,) = _trials(hardware="h100-80gb", world_size=8)
    cfg = planned.config
    moved = cfg.model_copy(update={
        "hardware_profile": cfg.hardware_profile.model_copy(
            update={"accelerator_type": "H200", "cpus_per_device": 4.0}),
        "placement_timeout_s": 5.0})
    assert moved.trial_id == cfg.trial_id
    assert "placement_timeout_s" not in cfg.config_fields()


def test_a_ray_of_fixed_resources_turns_away_what_it_can_never_hold():
    """A Ray instance this process started has no autoscaler: a trial needing more waits for
    nothing (placement_timeout_s, 30 min by default), so it is turned away at once."""
    (gpu,) = _trials(hardware="h100-80gb", world_size=8)
    laptop = {"CPU": 2.0, "memory": 2e10}
    reason = local_shortfall(gpu.config, laptop)
    assert reason.startswith("placement: needs 8 x {'GPU': 1.0, 'CPU': 8.0} (STRICT_PACK, "
                             "accelerator_type H100)"), reason
    assert "'GPU': 0.0" in reason and "ray job submit" in reason
    node = {"CPU": 64.0, "GPU": 8.0, "accelerator_type:H100": 1.0}
    assert local_shortfall(gpu.config, node) is None
    assert "accelerator_type:H100" in local_shortfall(
        gpu.config, {"CPU": 64.0, "GPU": 8.0, "accelerator_type:A100": 1.0})
    two, four = _trials(hardware="cpu-local", world_size=[2, 4])
    assert local_shortfall(two.config, laptop) is None
    assert "{'CPU': 2.0}" in local_shortfall(four.config, laptop)
