"""Bus bandwidth between nodes: what a calibration on one machine cannot measure.

`scalestudy calibrate --across-nodes N` ends with this step on the current Ray cluster: a Ray Train
group of one worker per node on N nodes (STRICT_SPREAD: never two on one node), each holding one
device as a trial's worker does (launch/placement.py's profile_resources), runs all_reduce,
all_gather and reduce_scatter over the group at growing message sizes, as nccl-tests measures
(collectives.py on CPU, gloo; gpu.py on CUDA, NCCL: warm-up, fixed count, median, slowest rank).

With one rank per node every ring hop crosses the network, through the NIC nearest the rank's device:
the model's `network_gbps_per_gpu`. network.py runs a group of k ranks per node at k times that (the
node's NICs together, as published multi-node nccl-tests reach), so the per-device figure is the one
to measure. Written into the profile: network_gbps_per_gpu = the best all_reduce busbw measured,
network_efficiency 1 (the figure is already the achieved rate), the curves as
`across_nodes_busbw_gbps_<op>` ([bytes, GB/s], kept as the record of what was measured) and
`calibration_nodes`. The nodes must be up: the step refuses to start when fewer than N alive nodes
hold the device (a STRICT_SPREAD group that cannot be placed would wait forever).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from scalestudy import metrics as M
from scalestudy.metrics import CALIBRATED_COLLECTIVES
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.launch.placement import profile_device_resource, profile_resources

RESULT_FILE = "across_nodes.json"


class TooFewNodes(RuntimeError):
    """The cluster has fewer nodes able to hold one worker than the calibration asked for."""


def nodes_holding(nodes: list[dict[str, Any]], resources: dict[str, float]) -> list[str]:
    """Ids of the alive nodes (ray.nodes() entries) whose total resources hold one worker."""
    return [n["NodeID"] for n in nodes if n.get("Alive")
            and all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in resources.items())]


def check_nodes(hw: HardwareProfile, nodes: int, cluster: list[dict[str, Any]]) -> None:
    if nodes < 2:
        raise TooFewNodes(f"--across-nodes needs 2 or more nodes, got {nodes}")
    resources = profile_resources(hw)
    able = nodes_holding(cluster, resources)
    if len(able) < nodes:
        raise TooFewNodes(
            f"the cluster has {len(able)} alive node(s) that can hold a worker of {resources}, "
            f"{nodes} asked for: start that many nodes first (e.g. min_workers in the cluster "
            "YAML) or ask for fewer")


def check_cluster(hw: HardwareProfile, nodes: int) -> None:
    """check_nodes on the current Ray cluster (joined, or started here when none is)."""
    import ray

    from scalestudy.launch.ray_train import ensure_ray

    ensure_ray()
    check_nodes(hw, nodes, ray.nodes())


def across_nodes_loop(config: dict[str, Any]) -> None:
    """Ray Train worker: the collectives over the group, one rank per node."""
    import torch
    import torch.distributed as dist

    from scalestudy.calibrate.run import report_result
    from scalestudy.launch.placement import gather_node_ids

    world = dist.get_world_size()
    if torch.cuda.is_available():
        from ray.train.torch import get_device

        from scalestudy.calibrate import gpu

        torch.cuda.set_device(get_device())
        sizes = gpu.QUICK_COMM_SIZES_BYTES if config["quick"] else gpu.COMM_SIZES_BYTES
        curves = gpu.comm_curves_cuda(world, sizes)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        from scalestudy.calibrate.collectives import comm_curves
        from scalestudy.calibrate.run import QUICK_SIZES_BYTES, SIZES_BYTES

        torch.set_num_threads(1)  # one core per worker, as in trials
        deepspeed.init_distributed(dist_backend="gloo")
        sizes = QUICK_SIZES_BYTES if config["quick"] else SIZES_BYTES
        curves = comm_curves(world, sizes, iters=16 if config["quick"] else 30)
    report_result({"world_size": world, "node_ids": gather_node_ids(), "comm": curves},
                  RESULT_FILE)


def measure(hw: HardwareProfile, nodes: int, quick: bool = False,
            results_root: str | Path | None = None) -> dict[str, Any]:
    """Rank 0's result of the group on `nodes` nodes of the current Ray cluster. Ray Train's storage
    is under the results root (calibration_storage): each worker writes its report from its own
    node, so a folder only the driver's machine has would lose it."""
    from scalestudy.calibrate.run import calibration_storage, run_group

    check_cluster(hw, nodes)
    use_gpu = profile_device_resource(hw) == "GPU"
    scaling = {"num_workers": nodes, "use_gpu": use_gpu, "resources_per_worker": profile_resources(hw),
               "placement_strategy": "STRICT_SPREAD", "accelerator_type": hw.accelerator_type}
    return run_group(across_nodes_loop, {"quick": quick}, scaling, calibration_storage(results_root),
                     "calibrate-nodes", RESULT_FILE, backend="nccl" if use_gpu else "gloo")


def with_network(hw: HardwareProfile, measured: dict[str, Any]) -> HardwareProfile:
    """The profile with the measured network figures (see the module docstring)."""
    if len(set(measured["node_ids"])) != len(measured["node_ids"]):
        raise RuntimeError(f"two ranks of the across-nodes group shared a node: {measured['node_ids']}")
    data = hw.model_dump(mode="json")
    cal = dict(data.get("calibration") or {})
    for op in CALIBRATED_COLLECTIVES:
        cal[f"across_nodes_busbw_gbps_{op}"] = measured["comm"][op]
    data["network_gbps_per_gpu"] = max(gbps for _, gbps in measured["comm"][M.ALL_REDUCE])
    cal["network_efficiency"] = 1.0
    cal["calibration_nodes"] = float(measured["world_size"])
    data["calibration"] = cal
    return HardwareProfile(**data)


def calibrate_across_nodes(hw: HardwareProfile, nodes: int, quick: bool = False,
                           results_root: str | Path | None = None) -> HardwareProfile:
    return with_network(hw, measure(hw, nodes, quick, results_root))


def summary(hw: HardwareProfile) -> str:
    """One line for the CLI: what the step measured and the figure it wrote."""
    cal = hw.calibration
    size, best = max(cal["across_nodes_busbw_gbps_all_reduce"], key=lambda point: point[1])
    return (f"across {int(cal['calibration_nodes'])} nodes, one device each: best all_reduce busbw "
            f"{best:.3f} GB/s (at {int(size):,} bytes) -> network_gbps_per_gpu "
            f"{hw.network_gbps_per_gpu:.3f}")
