"""Every file under cluster/ is checked here, offline, in about a second.

Cluster-launcher YAMLs go through the same two steps `ray up` takes before it talks to a cloud: the
raw file against the JSON schema shipped inside the installed ray package (ray/autoscaler/
ray-schema.json), then Ray's prepare_config (merge with the provider's defaults) + validate_config.
Broken copies must fail the same path, so the check is known to bite. KubeRay manifests have no
schema in the ray package (their CRDs live in the operator), so they get a parse + structure check.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.runtime_env import RuntimeEnv

REPO = Path(__file__).parents[2]
CLUSTER = REPO / "cluster"
KUBERAY = CLUSTER / "kuberay"
SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())

# file -> (worker instance/machine type, EFA network cards; 0 where the cloud has no EFA)
LAUNCHER = {
    "aws-a100.yaml": ("p4d.24xlarge", 4),
    "aws-h100.yaml": ("p5.48xlarge", 32),
    "gcp-h100.yaml": ("a3-highgpu-8g", 0),
}
RUNTIME_ENV = CLUSTER / "runtime_env.yaml"


def load(path: Path):
    return yaml.safe_load(path.read_text())


def ray_validate(config: dict) -> dict:
    """What `ray up` checks before any cloud call; raises on an invalid config."""
    jsonschema.validate(config, SCHEMA)
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def worker_types(config: dict) -> dict:
    return {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}


def test_every_cluster_yaml_is_covered():
    # A new YAML dropped into cluster/ must be added to a check here, not silently skipped.
    known = {CLUSTER / f for f in LAUNCHER} | {RUNTIME_ENV} | {KUBERAY / "raycluster.yaml", KUBERAY / "rayjob.yaml"}
    found = set(CLUSTER.rglob("*.yaml")) | set(CLUSTER.rglob("*.yml"))
    assert found == known


@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_launcher_config_passes_rays_validation(name):
    prepared = ray_validate(load(CLUSTER / name))
    # The defaults merge must not have brought back Ray's example node types.
    assert set(prepared["available_node_types"]) == set(load(CLUSTER / name)["available_node_types"])


@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_launcher_cpu_head_and_gpu_workers_from_zero(name):
    config = load(CLUSTER / name)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] == 0
    assert head["max_workers"] == 0
    instance, _ = LAUNCHER[name]
    (worker,) = worker_types(config).values()
    node = worker["node_config"]
    assert node.get("InstanceType", node.get("machineType")) == instance
    assert worker["min_workers"] == 0
    assert worker["max_workers"] == config["max_workers"] > 0
    assert worker["resources"]["GPU"] == 8


@pytest.mark.parametrize("name", [n for n, (_, cards) in LAUNCHER.items() if cards])
def test_aws_workers_have_efa_on_every_network_card(name):
    config = load(CLUSTER / name)
    _, cards = LAUNCHER[name]
    (worker,) = worker_types(config).values()
    node = worker["node_config"]
    nics = node["NetworkInterfaces"]
    assert sorted(n["NetworkCardIndex"] for n in nics) == list(range(cards))
    primary = next(n for n in nics if n["NetworkCardIndex"] == 0)
    assert primary["DeviceIndex"] == 0 and primary["InterfaceType"] == "efa"
    assert all(n["InterfaceType"] in ("efa", "efa-only") for n in nics)
    # Ray's AWS bootstrap rejects subnets/groups at node level once interfaces are given.
    assert all(n["SubnetId"] and n["Groups"] for n in nics)
    assert not {"SubnetId", "SubnetIds", "SecurityGroupIds"} & set(node)
    assert node["Placement"]["GroupName"]


def test_gcp_gpu_nodes_terminate_on_host_maintenance():
    (worker,) = worker_types(load(CLUSTER / "gcp-h100.yaml")).values()
    assert worker["node_config"]["scheduling"]["onHostMaintenance"] == "TERMINATE"


@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_dashboard_bound_to_loopback(name):
    start = " ".join(load(CLUSTER / name)["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start


def test_no_config_listens_on_or_opens_to_every_address():
    # Not in a bind address, a CIDR or a comment: the README is the place that explains why.
    for path in CLUSTER.rglob("*"):
        if path.is_file() and path.suffix != ".md":
            assert "0.0.0.0" not in path.read_text(), path


def _typo_in_node_type(c):
    c["available_node_types"]["head"]["min_worker"] = 0


def _gpu_as_string(c):
    next(iter(worker_types(c).values()))["resources"]["GPU"] = "8"


def _unknown_top_level_key(c):
    c["max_worker"] = 4


def _head_type_missing(c):
    c["head_node_type"] = "no-such-type"


def _no_resources(c):
    del next(iter(worker_types(c).values()))["resources"]


@pytest.mark.parametrize(
    "breakage", [_typo_in_node_type, _gpu_as_string, _unknown_top_level_key, _head_type_missing, _no_resources]
)
@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_broken_copy_fails_validation(name, breakage):
    config = load(CLUSTER / name)
    ray_validate(config)  # the original passes, so the failure below is the breakage's doing
    broken = copy.deepcopy(config)
    breakage(broken)
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        ray_validate(broken)


def test_runtime_env_ships_the_project_without_reinstalling_torch():
    spec = load(RUNTIME_ENV)
    RuntimeEnv(**spec)  # Ray's own field checks
    # RuntimeEnv accepts unknown keys as plugins; a typo would silently do nothing.
    assert set(spec) <= {"working_dir", "py_modules", "excludes", "env_vars"}
    assert spec["working_dir"] == "."
    for module in spec["py_modules"]:
        assert (REPO / module).is_dir(), module  # uploaded as the package named by its basename
    assert {".git", ".venv", "results", "mlflow.db"} <= set(spec["excludes"])


def test_versions_agree_across_cluster_files():
    # Nodes, image and KubeRay must run one Ray, and the torch pin the Makefile uses locally.
    texts = {p.name: p.read_text() for p in [*(CLUSTER / f for f in LAUNCHER), KUBERAY / "Dockerfile"]}
    torch_pin = re.search(r"torch==([\d.]+)", (REPO / "Makefile").read_text()).group(1)
    ray_version = load(KUBERAY / "raycluster.yaml")["spec"]["rayVersion"]
    for name, text in texts.items():
        assert f"torch=={torch_pin}" in text, name
        assert re.findall(r"(?:ray\[default\]==|rayproject/ray:)([\d.]+)", text) == [ray_version], name


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def check_cluster_spec(spec: dict) -> None:
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert all("nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}) for c in _containers(head))
    groups = spec["workerGroupSpecs"]
    assert {g["groupName"] for g in groups} == {"gpu-a100", "gpu-h100"}
    for g in groups:
        assert g["minReplicas"] == 0 < g["maxReplicas"]
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        (container,) = _containers(g)
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert int(limits["nvidia.com/gpu"]) == 8
        assert requests == limits  # Guaranteed QoS: a GPU pod is never the first one evicted
        assert container["image"] == _containers(head)[0]["image"]


def test_raycluster_manifest():
    doc = load(KUBERAY / "raycluster.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayCluster")
    check_cluster_spec(doc["spec"])


def test_rayjob_manifest_runs_the_sweep_on_the_same_cluster_spec():
    doc = load(KUBERAY / "rayjob.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")
    spec = doc["spec"]
    assert re.search(r"(^|&& )scalestudy sweep \S+\.yaml$", spec["entrypoint"])
    assert spec["shutdownAfterJobFinishes"] is True
    yaml.safe_load(spec["runtimeEnvYAML"])
    check_cluster_spec(spec["rayClusterSpec"])
    assert spec["rayClusterSpec"] == load(KUBERAY / "raycluster.yaml")["spec"]
