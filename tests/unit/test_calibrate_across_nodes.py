"""`scalestudy calibrate --across-nodes`: which nodes can hold a worker, the refusal before any
benchmark when too few can, and the profile written from a measurement (the measurement itself runs
on a fake two-node cluster in tests/integration/test_placement.py)."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from scalestudy.calibrate import across_nodes as an
from scalestudy.cli import app
from scalestudy.metrics import CALIBRATED_COLLECTIVES
from scalestudy.perfmodel import network as net
from scalestudy.perfmodel.params import params_for
from scalestudy.spec import catalog

GIB = 1 << 30


def _node(node_id: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": resources}


CLUSTER = [_node("head", CPU=0.0), _node("a", CPU=8.0, GPU=8.0), _node("b", CPU=8.0, GPU=8.0),
           _node("gone", alive=False, CPU=8.0, GPU=8.0), _node("cpu-only", CPU=64.0)]


def test_nodes_holding_counts_alive_nodes_with_the_device_and_its_cpus():
    gpu = catalog.get_hardware("a100-80gb")
    assert an.nodes_holding(CLUSTER, {"GPU": 1.0, "CPU": gpu.cpus_per_device}) == ["a", "b"]
    assert an.nodes_holding(CLUSTER, {"CPU": 1.0}) == ["a", "b", "cpu-only"]
    fake = gpu.model_copy(update={"device_resource": "fake_device"})
    with pytest.raises(an.TooFewNodes, match=r"0 alive node\(s\).*fake_device.*2 asked for"):
        an.check_nodes(fake, 2, CLUSTER)


def test_too_few_nodes_is_refused_with_what_the_cluster_has():
    gpu = catalog.get_hardware("h100-80gb")
    an.check_nodes(gpu, 2, CLUSTER)
    with pytest.raises(an.TooFewNodes, match=r"2 alive node\(s\).*3 asked for.*start that many"):
        an.check_nodes(gpu, 3, CLUSTER)
    with pytest.raises(an.TooFewNodes, match="2 or more"):
        an.check_nodes(gpu, 1, CLUSTER)


def _measured(best_gbps: float) -> dict:
    sizes = [2**20, 2**26, 2**30]
    curve = [[float(s), best_gbps * f] for s, f in zip(sizes, (0.2, 0.8, 1.0))]
    return {"world_size": 2, "node_ids": ["a", "b"],
            "comm": {op: [[s, g * (0.9 if op != "all_reduce" else 1.0)] for s, g in curve]
                     for op in CALIBRATED_COLLECTIVES}}


def test_the_profile_takes_the_measured_network_and_the_model_prices_it():
    base = catalog.get_hardware("a100-80gb")
    hw = an.with_network(base, _measured(21.5))
    assert hw.network_gbps_per_gpu == 21.5
    assert hw.calibration["network_efficiency"] == 1.0 and hw.calibration["calibration_nodes"] == 2.0
    assert hw.calibration["across_nodes_busbw_gbps_all_gather"][-1] == [float(2**30), 21.5 * 0.9]
    assert base.network_gbps_per_gpu == 25.0  # the catalogue's shared object is left as it was
    p = params_for(hw)
    one_per_node = net.busbw_gbps("all_reduce", 8 * GIB, net.Group(2, 1, 2), hw, p)
    assert math.isclose(one_per_node, 21.5, rel_tol=0.02)  # what was measured, latency aside
    # k ranks per node: the node's NICs together (network.py), k x the measured per-device figure
    eight_per_node = net.busbw_gbps("all_reduce", 8 * GIB, net.Group(16, 8, 2), hw, p)
    assert math.isclose(eight_per_node, 8 * 21.5, rel_tol=0.02)
    assert "21.500 GB/s" in an.summary(hw) and "network_gbps_per_gpu 21.500" in an.summary(hw)


def test_a_group_that_shared_a_node_is_not_written():
    shared = {**_measured(10.0), "node_ids": ["a", "a"]}
    with pytest.raises(RuntimeError, match="shared a node"):
        an.with_network(catalog.get_hardware("a100-80gb"), shared)


@pytest.mark.parametrize("args", [["--across-nodes", "1"], ["--local", "--across-nodes", "2"]])
def test_cli_refuses_bad_across_nodes_before_any_benchmark(args, tmp_path):
    res = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path / "p.yaml"), *args])
    assert res.exit_code == 2, res.output
    assert "--across-nodes" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize("args, field", [
    (["--network-only"], "--network-only"),
    (["--hardware", "{profile}", "--across-nodes", "2"], "--hardware"),  # a file: --network-only
])
def test_cli_network_only_needs_across_nodes_and_only_it_takes_a_profile_file(args, field, tmp_path):
    profile = tmp_path / "some-profile.yaml"
    catalog.write_profile(catalog.get_hardware("a100-80gb"), profile)
    args = [a.format(profile=profile) for a in args]
    res = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path / "p.yaml"), *args])
    assert res.exit_code == 2, res.output
    assert field in res.output and "Traceback" not in res.output
