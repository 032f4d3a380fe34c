"""Whole nodes for trials that span nodes (launch/node_leases.py): which trials are pinned, which
nodes count as idle, and the per-worker selectors Ray Train gets. Pure: no Ray started."""

from __future__ import annotations

from scalestudy.launch.node_leases import (NODE_ID_LABEL, NodeShape, nodes_needed, pick_idle,
                                           shape_of, worker_selectors)
from scalestudy.launch.placement import placement_for
from scalestudy.spec.study import StudySpec, expand


def _config(**fields):
    spec = StudySpec(name="p", model="llama2-7b", backend="measure", hardware="h100-80gb",
                     **fields)
    (planned,) = expand(spec)
    assert planned.feasible, planned.reason
    return planned.config


def test_only_fixed_trials_over_several_nodes_are_pinned():
    assert nodes_needed(_config(world_size=8)) == 0  # one node: STRICT_PACK already
    assert nodes_needed(_config(world_size=32, tp=8)) == 4
    assert nodes_needed(_config(world_size=16, fault_tolerance={"max_failures": 1})) == 0
    cores = expand(StudySpec(name="c", model="llama2-tiny", hardware="cpu-local", world_size=4,
                             tp=2))[0].config
    assert cores.world_size > cores.hardware_profile.gpus_per_node and nodes_needed(cores) == 0
    assert nodes_needed(_config(world_size=16, global_batch=64,
                                fault_tolerance={"max_failures": 1},
                                elastic={"min_workers": 16, "max_workers": 16})) == 0


def _node(node_id: str, devices: int, acc: str = "H100", alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive,
            "Resources": {"GPU": float(devices), f"accelerator_type:{acc}": 1.0, "CPU": 96.0}}


def test_idle_means_every_device_free_and_not_leased():
    shape = NodeShape("GPU", 8, "H100")
    nodes = [_node("a", 8), _node("b", 8), _node("c", 8), _node("d", 8, acc="A100"),
             _node("e", 4), _node("f", 8, alive=False), _node("g", 8)]
    free = {n["NodeID"]: {"GPU": 8.0} for n in nodes}
    free["a"] = {"GPU": 7.0}  # another trial holds one device of a
    free["e"] = {"GPU": 4.0}
    assert pick_idle(nodes, free, shape, leased={"b"}, n=2) == ["c", "g"]
    assert pick_idle(nodes, free, shape, leased={"b"}, n=3) is None  # wait for the autoscaler
    assert pick_idle(nodes, free, NodeShape("GPU", 4, None), leased=set(), n=1) == ["e"]


def test_workers_fill_each_leased_node_in_rank_order():
    sel = worker_selectors(["n1", "n2"], per_node=2, world_size=4)
    assert [s[NODE_ID_LABEL] for s in sel] == ["n1", "n1", "n2", "n2"]


def test_pinned_placement_is_a_valid_scaling_config():
    from ray.train import ScalingConfig

    cfg = _config(world_size=16, tp=8)
    shape = shape_of(cfg)
    assert shape == NodeShape("GPU", 8, "H100")
    assert shape.bundle() == {"GPU": 8.0, "accelerator_type:H100": 0.001}
    p = placement_for(cfg, worker_selectors(["x", "y"], 8, 16))
    kwargs = p.scaling_kwargs()
    assert kwargs["placement_strategy"] == "PACK" and len(kwargs["label_selector"]) == 16
    ScalingConfig(**kwargs)  # Ray Train accepts one selector per worker
    assert "pinned to 2 leased nodes" in p.describe()
    assert "label_selector" not in placement_for(cfg).scaling_kwargs()
