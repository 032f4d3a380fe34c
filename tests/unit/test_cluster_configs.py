"""Every file under cluster/ is checked here, offline, in seconds.

Launcher YAMLs go through the two steps `ray up` takes before it calls a cloud: Ray's own JSON schema
(ray/autoscaler/ray-schema.json), then prepare_config + validate_config; broken copies must fail the
same path. Setup commands run in bash through Ray's own command wrapper. KubeRay manifests (no schema
in the ray package) get a parse + structure check; the studies they name are loaded and validated.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.command_runner import _with_interactive
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.runtime_env import RuntimeEnv
from typer.testing import CliRunner

from scalestudy.cli import app
from scalestudy.spec.load import load_spec
from tests.unit.cluster_files import (CLUSTER, EFA_CARDS, INSTANCES, KUBERAY, LAUNCHER, REPO, accelerator_labels,
                                      load, profile_for, worker_types)

SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())

RUNTIME_ENV = CLUSTER / "runtime_env.yaml"
OBJECT_STORE = re.compile(r"^(s3|gs)://[^/]+/\S*$")
IMAGE_ROOT = "/home/ray/scalestudy/"  # where kuberay/Dockerfile copies the repo
COMMAND_KEYS = ["setup_commands", "head_setup_commands", "head_start_ray_commands", "worker_start_ray_commands"]


def ray_validate(config: dict) -> dict:
    """What `ray up` checks before any cloud call; raises on an invalid config."""
    jsonschema.validate(config, SCHEMA)
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


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
def test_launcher_uses_internal_ips_and_nothing_listens_in_public(name):
    config = load(CLUSTER / name)
    assert config["provider"]["use_internal_ips"] is True
    for node_type in config["available_node_types"].values():
        node = node_type["node_config"]
        subnets = node.get("SubnetIds", []) + [n["SubnetId"] for n in node.get("NetworkInterfaces", [])]
        assert all("PUBLIC" not in s for s in subnets)
        assert not any(n.get("AssociatePublicIpAddress") for n in node.get("NetworkInterfaces", []))
        assert not any(n.get("accessConfigs") for n in node.get("networkInterfaces", []))
    # The dashboard's job API runs any command sent to it: the head's loopback only (SSH tunnel).
    assert "--dashboard-host=127.0.0.1" in " ".join(config["head_start_ray_commands"])


@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_gpu_nodes_can_write_the_object_store_root(name):
    # Ray gives its default instance profile / service account to the head only; workers write
    # checkpoints to the s3:// or gs:// root themselves.
    for worker in worker_types(load(CLUSTER / name)).values():
        node = worker["node_config"]
        if name.startswith("aws"):
            assert node["IamInstanceProfile"]["Arn"].startswith("arn:aws:iam::")
        else:
            (account,) = node["serviceAccounts"]
            assert account["email"] and "https://www.googleapis.com/auth/cloud-platform" in account["scopes"]


def test_gcp_gpu_nodes_terminate_on_host_maintenance():
    for worker in worker_types(load(CLUSTER / "gcp-h100.yaml")).values():
        assert worker["node_config"]["scheduling"]["onHostMaintenance"] == "TERMINATE"


def _shared_mount_command(config: dict) -> str:
    (cmd,) = [c for c in config["setup_commands"] if "/mnt/shared" in c]
    return cmd


def _run_as_ray_does(cmd: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, str]:
    """The command as Ray's SSH runner wraps it, in bash; sudo and mountpoint are recorders."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    calls = tmp_path / "calls"
    (stubs / "sudo").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (stubs / "mountpoint").write_text("#!/bin/sh\nexit 1\n")  # nothing mounted yet
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    (wrapped,) = shlex.split(_with_interactive(cmd)[-1])
    env = {"HOME": str(tmp_path), "PATH": f"{stubs}:/usr/bin:/bin"}
    proc = subprocess.run(["bash", "-c", wrapped], env=env, capture_output=True, text=True, timeout=30)
    return proc, calls.read_text() if calls.exists() else ""


@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_shared_mount_is_skipped_until_its_placeholder_is_filled(name, tmp_path):
    proc, calls = _run_as_ray_does(_shared_mount_command(load(CLUSTER / name)), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "not set" in proc.stdout and calls == ""  # `ray up` goes on with the object-store root


@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_shared_mount_mounts_nfs_on_every_node_once_filled(name, tmp_path):
    cmd = _shared_mount_command(load(CLUSTER / name))
    placeholder = re.search(r"SHARED_NFS=(\S+);", cmd).group(1)
    target = "fs-0123456789abcdef0.efs.us-east-1.amazonaws.com:/" if name.startswith("aws") else "10.0.0.2:/share"
    proc, calls = _run_as_ray_does(cmd.replace(placeholder, target), tmp_path)
    assert proc.returncode == 0, proc.stderr
    mount = next(line for line in calls.splitlines() if line.startswith("mount "))
    assert mount.endswith(f"{target} /mnt/shared")
    assert "nfs-common" in calls and "/mnt/shared/results" in calls


@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_every_shell_command_parses_and_hides_no_placeholder(name):
    config = load(CLUSTER / name)
    for cmd in (c for k in COMMAND_KEYS for c in config.get(k, [])):
        (wrapped,) = shlex.split(_with_interactive(cmd)[-1])
        assert subprocess.run(["bash", "-n", "-c", wrapped]).returncode == 0, cmd
        # REPLACE_ME belongs in ids only you have; in a command, only behind the guard that skips it.
        assert "REPLACE_ME" not in cmd or "*REPLACE_ME*)" in cmd, cmd


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


def test_runtime_env_ships_the_project_and_wires_mlflow_and_the_results_root():
    spec = load(RUNTIME_ENV)
    RuntimeEnv(**spec)  # Ray's own field checks
    # RuntimeEnv accepts unknown keys as plugins; a typo would silently do nothing.
    assert set(spec) <= {"working_dir", "py_modules", "excludes", "env_vars"}
    assert spec["working_dir"] == "."
    for module in spec["py_modules"]:
        assert (REPO / module).is_dir(), module  # uploaded as the package named by its basename
    assert {".git", ".venv", "results", "mlflow.db"} <= set(spec["excludes"])
    env = spec["env_vars"]
    # A tracking server, never the SQLite default that lands in the job's deleted working dir.
    assert re.match(r"^https?://\S+:\d+$", env["MLFLOW_TRACKING_URI"])
    assert OBJECT_STORE.match(env["SCALESTUDY_RESULTS_ROOT"])


def test_documented_default_results_root_is_an_object_store():
    readme = (CLUSTER / "README.md").read_text()
    submit = re.search(r"ray job submit [^\n]*\\\n[^\n]*", readme).group(0)
    assert "--runtime-env cluster/runtime_env.yaml" in submit and "--working-dir ." in submit
    root = re.search(r"scalestudy sweep \S+\.yaml --results-root (\S+)", submit).group(1)
    assert OBJECT_STORE.match(root)


def _dockerfile_runs() -> list[str]:
    text = re.sub(r"\\\n", " ", (KUBERAY / "Dockerfile").read_text())
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


def test_image_installs_efa_libfabric_and_aws_ofi_nccl_and_fails_without_them():
    runs = _dockerfile_runs()
    for run in runs:
        assert subprocess.run(["bash", "-n", "-c", run]).returncode == 0, run
    install = next(r for r in runs if "efa_installer.sh" in r)
    assert "https://efa-installer.amazonaws.com/aws-efa-installer-" in install
    assert all(flag in install.split() for flag in ("--skip-kmod", "--skip-limit-conf", "--no-verify"))
    check = next(r for r in runs if "fi_info" in r)  # libfabric's EFA build answers
    assert "libnccl-net" in check and "exit 1" in check and "ldconfig" in check
    # The torch wheel (and its NCCL) comes after EFA; forced settings NCCL no longer needs stay out.
    torch = next(r for r in runs if r.split()[-1] == "torch" and "pip install" in r)
    assert runs.index(install) < runs.index(torch)
    text = (KUBERAY / "Dockerfile").read_text()
    assert not re.search(r"^ENV .*(FI_EFA_USE_DEVICE_RDMA|NCCL_PROTO)", text, re.M)


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def _volume_mounts(group: dict) -> dict[str, dict]:
    """mountPath -> volume, over all containers of a pod template."""
    volumes = {v["name"]: v for v in group["template"]["spec"].get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for c in _containers(group) for m in c.get("volumeMounts", [])}


def _group_profile(group: dict) -> str:
    """The catalogue profile whose trials the group's declared accelerator type takes."""
    return profile_for(accelerator_labels(json.loads(json.loads(group["rayStartParams"]["resources"])))).name


def check_cluster_spec(spec: dict) -> None:
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert head["rayStartParams"]["num-cpus"] == "0" and head["rayStartParams"]["num-gpus"] == "0"
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
        pod = g["template"]["spec"]
        instance = pod["nodeSelector"]["node.kubernetes.io/instance-type"]
        assert int(limits["vpc.amazonaws.com/efa"]) == EFA_CARDS[instance]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert _volume_mounts(g)["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        # gpu-a100 / gpu-h100: the group's name says which GPUs its nodes hold
        assert g["groupName"] == f"gpu-{INSTANCES[instance][4].lower()}"


def test_raycluster_manifest():
    doc = load(KUBERAY / "raycluster.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayCluster")
    check_cluster_spec(doc["spec"])


def test_mlflow_uri_and_results_root_reach_the_kuberay_driver():
    spec = load(KUBERAY / "raycluster.yaml")["spec"]
    head = spec["headGroupSpec"]
    env = {e["name"]: e for e in _containers(head)[0]["env"]}
    assert env["MLFLOW_TRACKING_URI"]["valueFrom"]["secretKeyRef"] == {"name": "scalestudy-mlflow", "key": "uri"}
    root = env["SCALESTUDY_RESULTS_ROOT"]["value"]
    # A local root must be a volume every pod mounts: checkpoints are written from the GPU pods.
    for group in [head, *spec["workerGroupSpecs"]]:
        assert any(root.startswith(path + "/") and "persistentVolumeClaim" in vol
                   for path, vol in _volume_mounts(group).items()), group.get("groupName", "head")


def test_rayjob_runs_a_measured_study_on_gpus_the_cluster_provides():
    doc = load(KUBERAY / "rayjob.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")
    spec = doc["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    RuntimeEnv(**yaml.safe_load(spec["runtimeEnvYAML"]))
    check_cluster_spec(spec["rayClusterSpec"])
    assert spec["rayClusterSpec"] == load(KUBERAY / "raycluster.yaml")["spec"]
    match = re.fullmatch(r"scalestudy sweep (\S+\.yaml) --results-root (\S+)( --verbose)?", spec["entrypoint"])
    assert match, spec["entrypoint"]
    study_path, root, _ = match.groups()
    assert study_path.startswith(IMAGE_ROOT)
    study = load_spec(REPO / study_path.removeprefix(IMAGE_ROOT), [])
    assert study.backend.value == "measure"  # a simulate study would start no GPU pod
    (hardware,) = study.hardware
    assert hardware.kind == "gpu"
    provided = {_group_profile(g) for g in spec["rayClusterSpec"]["workerGroupSpecs"]}
    assert hardware.name in provided
    assert max(study.world_size) > hardware.gpus_per_node  # NCCL must cross nodes at least once
    head = spec["rayClusterSpec"]["headGroupSpec"]
    assert OBJECT_STORE.match(root) or any(root.startswith(p + "/") for p in _volume_mounts(head))


def _referenced_specs() -> set[str]:
    refs = set()
    for path in CLUSTER.rglob("*"):
        if path.is_file():
            for ref in re.findall(r"(?:/home/ray/scalestudy/)?experiments/[\w./-]+?\.yaml", path.read_text()):
                refs.add(ref.removeprefix(IMAGE_ROOT))
    assert "experiments/cluster_smoke.yaml" in refs  # the RayJob's and the README's study
    return refs


@pytest.mark.parametrize("ref", sorted(_referenced_specs()))
def test_every_study_named_by_a_cluster_file_exists_and_validates(ref, monkeypatch):
    monkeypatch.chdir(REPO)
    assert (REPO / ref).is_file(), ref
    res = CliRunner().invoke(app, ["validate", ref], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert re.search(r": \d+ trials \((\d+) runnable", res.output).group(1) != "0"

