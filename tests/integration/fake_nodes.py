"""Extra Ray nodes on this machine for a head from local_cluster.local_head: each a `ray start
--address ... --block` in its own process group with the resources a test gives it (device-like
custom resources, an accelerator type), so a test can place trials on "nodes" and remove one by
killing its group (what a lost machine looks like to Ray: its raylet and workers gone at once)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tests.integration.local_cluster import BIN, Head, _kill_group, alive_nodes, free_port

# A fake cluster's profile: cpu-local's figures, with one device per `devices_per_node` custom
# resource instead of a core, so placement is decided by the test's resources alone.
PROFILE = """kind: cpu
description: fake device for placement tests (a core behind a custom resource)
peak_tflops: {{fp32: 0.083, fp16: 0.083, bf16: 0.166}}
hbm_gib: 11
hbm_gbps: 20
gpus_per_node: {devices_per_node}
nvlink_gbps_per_gpu: 5
network_gbps_per_gpu: 1.0
tdp_w: 15
idle_w: 5
node_overhead_w: 30
accelerator_type: {accelerator_type}
cpus_per_device: 1
device_resource: {device_resource}
calibration: {{overlap_slowdown: 1.0}}
"""


@dataclass
class Node:
    proc: subprocess.Popen
    resources: dict[str, float]

    def remove(self) -> None:
        """Kill the node's raylet and everything on it at once, as a lost machine."""
        _kill_group(self.proc)


@contextlib.contextmanager
def worker_nodes(head: Head, specs: list[dict[str, float]], log_dir) -> Iterator[list[Node]]:
    """Start one node per resource dict (its "CPU" entry is its CPU count) and wait until all
    are alive; every node is killed on exit."""
    nodes: list[Node] = []
    logs = []
    try:
        for i, resources in enumerate(specs):
            custom = {k: v for k, v in resources.items() if k != "CPU"}
            log = open(log_dir / f"node{i}.log", "w")
            logs.append(log)
            cmd = [str(BIN / "ray"), "start", f"--address={head.gcs_address}", "--block",
                   f"--num-cpus={int(resources.get('CPU', 1))}",
                   f"--resources={json.dumps(custom)}", "--disable-usage-stats",
                   # Several raylets on one machine: every port of their own (as Ray's fake
                   # multi-node provider does), or the second node's agents fail to bind.
                   "--min-worker-port=0", "--max-worker-port=0",
                   *(f"--{p}={free_port()}" for p in (
                       "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                       "metrics-export-port", "runtime-env-agent-port"))]
            proc = subprocess.Popen(cmd, env=head.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            nodes.append(Node(proc, resources))
        deadline = time.time() + 180
        while alive_nodes(head) < 1 + len(specs):
            assert time.time() < deadline, "worker nodes did not join: " + "".join(
                (log_dir / f"node{i}.log").read_text()[-800:] for i in range(len(specs)))
            time.sleep(1)
        yield nodes
    finally:
        for node in nodes:
            node.remove()
        for log in logs:
            log.close()
