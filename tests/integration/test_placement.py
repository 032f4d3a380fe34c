"""Placement on a fake cluster: a head with no CPUs and two worker nodes on this machine, each with
two device-like custom resources (`fake_device`), one more that stands for a one-device node
(`fake_single`) and the accelerator type `fake-A`. Trials run through `scalestudy run` against it,
with hardware profiles that name those resources (fake_nodes.PROFILE); so does the calibration of
the network between nodes (calibrate/across_nodes.py)."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from scalestudy.calibrate import across_nodes
from scalestudy.calibrate.run import QUICK_SIZES_BYTES
from scalestudy.metrics import CALIBRATED_COLLECTIVES, Status, TrialResult
from scalestudy.spec.catalog import load_hardware_file
from scalestudy.spec.load import load_spec
from scalestudy.spec.study import expand
from tests.integration.fake_nodes import PROFILE, worker_nodes
from tests.integration.local_cluster import BIN, leftover_processes, local_head

pytestmark = pytest.mark.slow

NODE = {"CPU": 2, "fake_device": 2, "fake_single": 1, "accelerator_type:fake-A": 1}
STUDY = """
name: {name}
model: llama2-tiny
hardware: {profile}.yaml
world_size: 2
tp: {tp}
steps: {{warmup: 1, measure: 3, profile: 0}}
placement_timeout_s: {placement_timeout_s}
tracking: {{mlflow_uri: null}}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("nodes")
    with local_head(num_cpus=0) as head, worker_nodes(head, [NODE, NODE], logs) as nodes:
        yield head, nodes
    assert leftover_processes(head) == []


def _spec(tmp_path, name: str, profile: dict, tp: int = 1, placement_timeout_s: float = 600):
    (tmp_path / f"{name}-hw.yaml").write_text(PROFILE.format(**profile))
    path = tmp_path / f"{name}.yaml"
    path.write_text(STUDY.format(name=name, profile=f"{name}-hw", tp=tp,
                                 placement_timeout_s=placement_timeout_s))
    return path


def _run(head, spec, cwd) -> TrialResult:
    proc = subprocess.run([str(BIN / "scalestudy"), "run", str(spec), "--json"], cwd=cwd,
                          env=head.env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, (proc.stdout[-2000:], proc.stderr[-3000:])
    return TrialResult.model_validate_json(lines[-1])


def _run_config(head, cfg_file, cwd) -> TrialResult:
    """run_trial on a TrialConfig as given, past the planner's checks."""
    code = ("import pathlib, sys\n"
            "from scalestudy.spec.trial import TrialConfig\n"
            "from scalestudy.launch.ray_train import ensure_ray, run_trial\n"
            "cfg = TrialConfig.model_validate_json(pathlib.Path(sys.argv[1]).read_text())\n"
            "ensure_ray()\n"
            "print(run_trial(cfg, pathlib.Path('ray')).model_dump_json())\n")
    proc = subprocess.run([sys.executable, "-c", code, str(cfg_file)], cwd=cwd, env=head.env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, (proc.stdout[-2000:], proc.stderr[-3000:])
    return TrialResult.model_validate_json(lines[-1])


def test_placement_world2_lands_on_one_node(cluster, tmp_path):
    head, _ = cluster
    spec = _spec(tmp_path, "onenode", {"devices_per_node": 2, "accelerator_type": "fake-A",
                                       "device_resource": "fake_device"})
    r = _run(head, spec, tmp_path)
    assert r.status is Status.completed, r.reason
    nodes = r.extra["worker_node_ids"]
    assert len(nodes) == 2 and len(set(nodes)) == 1, nodes  # STRICT_PACK: one node, not two
    print(f"\nworld 2 on node {nodes[0][:8]}, wall {r.wall_time_s:.1f} s")


def test_placement_tp_group_across_nodes_is_refused(cluster, tmp_path):
    """One device per node and tp 2: the planner refuses it; run anyway (`scalestudy run` takes
    the point as given), the workers land on two nodes and the check at start fails the trial."""
    head, _ = cluster
    spec = _spec(tmp_path, "tpspan", {"devices_per_node": 1, "accelerator_type": "fake-A",
                                      "device_resource": "fake_single"}, tp=2)
    reason = "tp 2 exceeds the 1 devices per node of tpspan-hw: a TP group would cross nodes"
    (planned,) = expand(load_spec(spec))
    assert planned.reason == reason
    refused = subprocess.run([str(BIN / "scalestudy"), "run", str(spec)], cwd=tmp_path,
                             env=head.env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and reason in " ".join((refused.stdout + refused.stderr).split())
    # Past the planner (a stale profile, another trial on part of a node): the workers' check.
    cfg_file = tmp_path / "tpspan-config.json"
    cfg_file.write_text(planned.config.model_dump_json())
    r = _run_config(head, cfg_file, tmp_path)
    assert r.status is Status.failed
    assert "placement: TP group [0, 1] spans nodes " in r.reason, r.reason
    assert r.reason.endswith("a TP group must share one node"), r.reason
    print(f"\nrefused: {r.reason}")


def test_placement_other_accelerator_waits_then_times_out(cluster, tmp_path):
    head, _ = cluster
    spec = _spec(tmp_path, "otheracc", {"devices_per_node": 2, "accelerator_type": "fake-B",
                                        "device_resource": "fake_device"},
                 placement_timeout_s=8)
    t0 = time.time()
    r = _run(head, spec, tmp_path)
    assert r.status is Status.timeout
    assert r.reason.startswith("placement: exceeded placement_timeout_s=8 waiting for 2 x "), r.reason
    assert "accelerator_type fake-B" in r.reason and "STRICT_PACK" in r.reason, r.reason
    assert 8 <= r.wall_time_s < 8 + 60 and time.time() - t0 < 8 + 120
    print(f"\nwaited {r.wall_time_s:.1f} s: {r.reason}")


def test_calibrate_across_nodes_puts_one_device_on_each_node(cluster, tmp_path):
    """`calibrate --across-nodes 2 --network-only` into a profile file: the collectives run over one
    worker per node (gloo between the two fake nodes' processes; with_network refuses a group that
    shared a node), and a request for more nodes than hold the device is refused before any
    benchmark runs."""
    head, _ = cluster
    hw_file, out = tmp_path / "nodes-hw.yaml", tmp_path / "nodes-calibrated.yaml"
    hw_file.write_text(PROFILE.format(devices_per_node=2, accelerator_type="fake-A",
                                      device_resource="fake_device"))
    cmd = [str(BIN / "scalestudy"), "calibrate", "--hardware", str(hw_file), "--network-only",
           "--quick", "--out", str(out), "--across-nodes"]
    proc = subprocess.run(cmd + ["2"], cwd=tmp_path, env=head.env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    hw, base = load_hardware_file(out), load_hardware_file(hw_file)
    assert hw.calibration["calibration_nodes"] == 2.0
    for op in CALIBRATED_COLLECTIVES:
        curve = hw.calibration[f"across_nodes_busbw_gbps_{op}"]
        assert [size for size, _ in curve] == [float(s) for s in QUICK_SIZES_BYTES]
        assert all(math.isfinite(gbps) and gbps > 0 for _, gbps in curve), (op, curve)
    best = max(gbps for _, gbps in hw.calibration["across_nodes_busbw_gbps_all_reduce"])
    assert hw.network_gbps_per_gpu == best != base.network_gbps_per_gpu
    assert (hw.peak_tflops, hw.hbm_gbps) == (base.peak_tflops, base.hbm_gbps)  # network only
    assert "one device each" in proc.stdout
    print(f"\n{across_nodes.summary(hw)}")

    refused = subprocess.run(cmd + ["3"], cwd=tmp_path, env=head.env, capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 2, (refused.stdout[-1000:], refused.stderr[-2000:])
    assert "2 alive node(s)" in refused.stderr and "3 asked for" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


def test_helper_actors_live_on_the_drivers_node(cluster, tmp_path):
    """A trial's channel, the sweep's warm pool and calibrate's relay ask for no resources, which Ray
    places on a random node, soft affinity or not; on_this_node pins them to the driver's node so
    that a worker node scaled down or lost does not take them along. Eight bare actors and three
    warm pools: unpinned, all eleven would land on the head (of three nodes) once in 177,147."""
    head, _ = cluster
    code = ("import ray\n"
            "from scalestudy.launch.ray_train import ensure_ray\n"
            "from scalestudy.launch.placement import on_this_node\n"
            "from scalestudy.launch.warm import warm_pool\n"
            "ensure_ray()\n"
            "here = ray.get_runtime_context().get_node_id()\n"
            "@ray.remote(num_cpus=0)\n"
            "class Helper:\n"
            "    def node_id(self):\n"
            "        return ray.get_runtime_context().get_node_id()\n"
            "actors = [Helper.options(**on_this_node()).remote() for _ in range(8)]\n"
            "for a in actors:\n"
            "    print('PLACED', ray.get(a.node_id.remote()) == here)\n"
            "for i in range(3):\n"
            "    with warm_pool(True, f'pin{i}') as name:\n"
            "        print('PLACED', ray.get(ray.get_actor(name).node_id.remote()) == here)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=head.env,
                          capture_output=True, text=True, timeout=300)
    placed = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("PLACED ")]
    assert placed == ["True"] * 11, (proc.stdout[-2000:], proc.stderr[-3000:])
