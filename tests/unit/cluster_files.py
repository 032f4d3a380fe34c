"""What the cluster tests know about the files under cluster/ and the instances they launch
(tests/unit/test_cluster_*.py). No tests here."""

from __future__ import annotations

from pathlib import Path

import yaml

from scalestudy.spec.catalog import get_hardware, hardware_names

REPO = Path(__file__).parents[2]
CLUSTER = REPO / "cluster"
KUBERAY = CLUSTER / "kuberay"
CONSTRAINTS = CLUSTER / "constraints.txt"

# Each GPU instance as its cloud documents it: GPUs, GB of memory per GPU, vCPUs, EFA network cards
# (0: none), and the accelerator type Ray detects on it (from NVML's name: "NVIDIA A100-SXM4-80GB"
# -> "A100"). https://aws.amazon.com/ec2/instance-types/p4/ and /p5/;
# https://cloud.google.com/compute/docs/gpus (A3 High).
INSTANCES = {
    "p4d.24xlarge": (8, 40, 96, 4, "A100"),
    "p4de.24xlarge": (8, 80, 96, 4, "A100"),
    "p5.48xlarge": (8, 80, 192, 32, "H100"),
    "a3-highgpu-8g": (8, 80, 208, 0, "H100"),
}
# launcher file -> its GPU node types
LAUNCHER = {
    "aws-a100.yaml": {"gpu-a100-40gb", "gpu-a100-80gb"},
    "aws-h100.yaml": {"gpu-h100"},
    "gcp-h100.yaml": {"gpu-h100"},
}
EFA_CARDS = {instance: facts[3] for instance, facts in INSTANCES.items() if facts[3]}


def load(path: Path):
    return yaml.safe_load(path.read_text())


def worker_types(config: dict) -> dict:
    return {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}


def instance_of(node_type: dict) -> str:
    node = node_type["node_config"]
    return node.get("InstanceType", node.get("machineType"))


def accelerator_labels(resources: dict) -> set[str]:
    """The accelerator types a node type declares (Ray's `accelerator_type:<name>` resources)."""
    return {k.removeprefix("accelerator_type:") for k in resources if k.startswith("accelerator_type:")}


def profile_for(labels: set[str]):
    """The one catalogue profile a node of these labels serves (a trial of it asks for its label)."""
    matches = [hw for hw in map(get_hardware, hardware_names())
               if hw.accelerator_type and hw.accelerator_type in labels]
    assert len(matches) == 1, (labels, [hw.name for hw in matches])
    return matches[0]
