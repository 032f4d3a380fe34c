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

from tests.integration.local_cluster import (
    BIN, TEARDOWN_GRACE_S, Head, _kill_group, alive_nodes, free_port)

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


ATTEMPTS = 3


@dataclass
class Node:
    proc: subprocess.Popen
    resources: dict[str, float]

    def remove(self, grace_s: float = 30.0) -> None:
        """Kill the node's raylet and everything on it at once, as a lost machine."""
        _kill_group(self.proc, grace_s)


def _start_node(head: Head, resources: dict[str, float], log) -> subprocess.Popen:
    custom = {k: v for k, v in resources.items() if k != "CPU"}
    cmd = [str(BIN / "ray"), "start", f"--address={head.gcs_address}", "--block",
           f"--num-cpus={int(resources.get('CPU', 1))}",
           f"--resources={json.dumps(custom)}", "--disable-usage-stats",
           # Several raylets on one machine: every port of their own (as Ray's fake multi-node
           # provider does), or the second node's agents fail to bind.
           "--min-worker-port=0", "--max-worker-port=0",
           *(f"--{p}={free_port()}" for p in (
               "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
               "metrics-export-port", "runtime-env-agent-port"))]
    return subprocess.Popen(cmd, env=head.env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _raylet_errors(head: Head) -> str:
    return "".join(p.read_text(errors="replace")[-600:]
                   for p in head.temp_dir.glob("session_*/logs/raylet*.err"))


@contextlib.contextmanager
def worker_nodes(head: Head, specs: list[dict[str, float]], log_dir) -> Iterator[list[Node]]:
    """Start one node per resource dict (its "CPU" entry is its CPU count), one at a time, each
    alive before the next starts; every node is killed on exit. `ray start` gives a raylet 30 s to
    register, which a loaded 2-core machine can miss: a node that gave up is started again."""
    nodes: list[Node] = []
    logs = []
    try:
        for i, resources in enumerate(specs):
            for attempt in range(ATTEMPTS):
                log = open(log_dir / f"node{i}-{attempt}.log", "w")
                logs.append(log)
                node = Node(_start_node(head, resources, log), resources)
                nodes.append(node)
                deadline = time.time() + 120
                while alive_nodes(head) < 2 + i and node.proc.poll() is None:
                    assert time.time() < deadline, f"node {i} did not join"
                    time.sleep(1)
                if node.proc.poll() is None:
                    break
                node.remove()
            else:
                raise AssertionError(f"node {i} did not start in {ATTEMPTS} attempts: "
                                     f"{(log_dir / f'node{i}-{ATTEMPTS - 1}.log').read_text()[-800:]}"
                                     f"{_raylet_errors(head)}")
        yield [n for n in nodes if n.proc.poll() is None]
    finally:
        for node in nodes:
            node.remove(TEARDOWN_GRACE_S)
        for log in logs:
            log.close()
