"""Strict placement on a fake three-node cluster: a trial that spans nodes takes whole idle ones,
also while another job holds part of a node (launch/node_leases.py).

Each worker node has two device-like custom resources (`fake_device`); the profile says two per
node, so a world-4, tp-2 trial spans two nodes. A placement group of another driver (a stand-in for
a concurrent trial) holds one device of a node. Unpinned, Ray's PACK may put one of the trial's
workers beside it and a TP group across two nodes; pinned, the trial runs on the two idle nodes,
two consecutive ranks on each. With too few idle nodes it waits, then times out with the reason."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from scalestudy.metrics import Status, TrialResult
from tests.integration.fake_nodes import PROFILE, worker_nodes
from tests.integration.local_cluster import BIN, leftover_processes, local_head

pytestmark = pytest.mark.slow

NODE = {"CPU": 2, "fake_device": 2, "accelerator_type:fake-A": 1}
STUDY = """
name: {name}
model: llama2-tiny
hardware: strict-hw.yaml
world_size: 4
tp: 2
precision: fp32
steps: {{warmup: 1, measure: 2, profile: 0}}
placement_timeout_s: {timeout}
tracking: {{mlflow_uri: null}}
"""
# Holds `fake_device: 1` on each given worker node (by index in node-id order) until killed.
HOLDER = """
import sys, time, ray
from ray.util.placement_group import placement_group
ray.init(logging_level="ERROR", log_to_driver=False)
ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("fake_device"))
for i in map(int, sys.argv[1:]):
    pg = placement_group([{"fake_device": 1}], bundle_label_selector=[{"ray.io/node-id": ids[i]}])
    ray.get(pg.ready(), timeout=60)
    print("HELD", ids[i], flush=True)
time.sleep(3600)
"""
LEASES = """
import ray
from scalestudy.launch.node_leases import ACTOR_NAME, NAMESPACE
ray.init(logging_level="ERROR", log_to_driver=False)
print("LEASED", len(ray.get(ray.get_actor(ACTOR_NAME, namespace=NAMESPACE).held.remote())))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("nodes")
    with local_head(num_cpus=0) as head, worker_nodes(head, [NODE] * 3, logs):
        yield head
    assert leftover_processes(head) == []


def _hold(head, nodes: list[int]) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, nodes)], env=head.env,
                            stdout=subprocess.PIPE, text=True)
    held = []
    while len(held) < len(nodes):
        line = proc.stdout.readline()
        assert line, "the holder ended before it held its devices"
        if line.startswith("HELD "):
            held.append(line.split()[1])
    return proc, held


def _run(head, tmp_path, name: str, timeout: float) -> TrialResult:
    (tmp_path / "strict-hw.yaml").write_text(PROFILE.format(
        devices_per_node=2, accelerator_type="fake-A", device_resource="fake_device"))
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(STUDY.format(name=name, timeout=timeout))
    proc = subprocess.run([str(BIN / "scalestudy"), "run", str(spec), "--json"], cwd=tmp_path,
                          env=head.env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, (proc.stdout[-2000:], proc.stderr[-3000:])
    return TrialResult.model_validate_json(lines[-1])


def _leased(head) -> int:
    out = subprocess.run([sys.executable, "-c", LEASES], env=head.env, capture_output=True,
                         text=True, timeout=120)
    return int(next(ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("LEASED")))


def test_trial_over_two_nodes_takes_the_idle_ones(cluster, tmp_path):
    holder, (busy,) = _hold(cluster, [0])
    try:
        r = _run(cluster, tmp_path, "strict", timeout=300)
    finally:
        holder.kill()
    assert r.status is Status.completed, r.reason
    nodes = r.extra["worker_node_ids"]
    assert busy not in nodes, (busy, nodes)  # never beside the other job
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3], nodes  # each TP group on one node
    assert _leased(cluster) == 0  # the lease ended with the trial
    print(f"\nworld 4 on nodes {nodes[0][:8]}, {nodes[2][:8]}; node {busy[:8]} held elsewhere")


def test_too_few_idle_nodes_waits_then_times_out(cluster, tmp_path):
    holder, _ = _hold(cluster, [0, 1])
    t0 = time.time()
    try:
        r = _run(cluster, tmp_path, "wait", timeout=8)
    finally:
        holder.kill()
    assert r.status is Status.timeout
    assert r.reason == ("placement: exceeded placement_timeout_s=8 waiting for 2 whole idle "
                        "node(s) with 2 x fake_device (fake-A)"), r.reason
    assert 8 <= r.wall_time_s < 8 + 60 and time.time() - t0 < 8 + 120
    assert _leased(cluster) == 0
