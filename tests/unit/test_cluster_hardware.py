"""The launchers' GPU node types against the instances they launch and the hardware catalogue: each
node type declares what its instance has (CPUs, GPUs, EFA cards, the accelerator type Ray detects),
and the accelerator type it offers names the one catalogue profile whose memory its GPUs have, so
that a trial of a profile (which asks Ray for that type, launch/placement.py) lands on its GPUs."""

from __future__ import annotations

import json
import re

import pytest

from scalestudy.spec.catalog import get_hardware, hardware_names
from scalestudy.spec.load import load_spec
from tests.unit.cluster_files import (CLUSTER, EFA_CARDS, INSTANCES, KUBERAY, LAUNCHER, REPO,
                                      accelerator_labels, instance_of, load, profile_for, worker_types)


@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_launcher_head_takes_no_trial_and_gpu_workers_declare_what_they_have(name):
    config = load(CLUSTER / name)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"] == {"CPU": 0, "GPU": 0} and head["max_workers"] == 0
    workers = worker_types(config)
    assert set(workers) == LAUNCHER[name]
    for worker in workers.values():
        gpus, _, vcpus, _, detected = INSTANCES[instance_of(worker)]
        assert worker["min_workers"] == 0
        assert 0 < worker["max_workers"] <= config["max_workers"]
        # What the autoscaler plans with must be what the node has: its CPUs and GPUs, the type Ray
        # detects, and any sized label a catalogue profile asks for (declared, never detected).
        res = worker["resources"]
        assert (res["CPU"], res["GPU"], res[f"accelerator_type:{detected}"]) == (vcpus, gpus, 1)
        assert set(res) == {"CPU", "GPU"} | {f"accelerator_type:{a}" for a in accelerator_labels(res)}


def _node_types_and_groups():
    """(where, instance, declared resources) of every GPU node type and KubeRay worker group."""
    for name in sorted(LAUNCHER):
        for type_name, worker in sorted(worker_types(load(CLUSTER / name)).items()):
            yield f"{name}:{type_name}", instance_of(worker), worker["resources"]
    for group in load(KUBERAY / "raycluster.yaml")["spec"]["workerGroupSpecs"]:
        declared = json.loads(json.loads(group["rayStartParams"]["resources"]))
        instance = group["template"]["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"]
        detected = INSTANCES[instance][4]  # Ray adds it on the pod from NVML
        yield f"raycluster.yaml:{group['groupName']}", instance, {**declared, f"accelerator_type:{detected}": 1}


@pytest.mark.parametrize("where,instance,resources", list(_node_types_and_groups()),
                         ids=lambda x: x if isinstance(x, str) and ":" in x else "")
def test_each_node_type_serves_catalogue_hardware_whose_memory_matches_the_instance(
        where, instance, resources):
    """A trial asks for its profile's accelerator type (launch/placement.py): the node types that
    offer it must hold GPUs of that profile's memory, or an 80 GB trial could land on a 40 GB node."""
    gpus, memory_gb, _, _, _ = INSTANCES[instance]
    hw = profile_for(accelerator_labels(resources))
    assert (hw.hbm_gib, hw.gpus_per_node) == (memory_gb, gpus), (where, hw.name)


def test_no_two_catalogue_profiles_ask_for_one_accelerator_type():
    types = [hw.accelerator_type for hw in map(get_hardware, hardware_names()) if hw.accelerator_type]
    assert len(types) == len(set(types)), types


def test_aws_a100_launcher_offers_both_a100_sizes_the_readme_calibrates():
    served = {profile_for(accelerator_labels(w["resources"])).name
              for w in worker_types(load(CLUSTER / "aws-a100.yaml")).values()}
    assert served == {"a100-40gb", "a100-80gb"}
    readme = (CLUSTER / "README.md").read_text()
    calibrated = re.search(r"scalestudy calibrate --hardware (\S+) [^\n]*--across-nodes", readme).group(1)
    assert calibrated in served


@pytest.mark.parametrize("name", [n for n in LAUNCHER if n.startswith("aws")])
def test_aws_workers_have_efa_on_every_network_card(name):
    config = load(CLUSTER / name)
    for worker in worker_types(config).values():
        node = worker["node_config"]
        nics = node["NetworkInterfaces"]
        assert sorted(n["NetworkCardIndex"] for n in nics) == list(range(EFA_CARDS[instance_of(worker)]))
        primary = next(n for n in nics if n["NetworkCardIndex"] == 0)
        assert primary["DeviceIndex"] == 0 and primary["InterfaceType"] == "efa"
        assert all(n["DeviceIndex"] == 1 and n["InterfaceType"] in ("efa", "efa-only")
                   for n in nics if n["NetworkCardIndex"])
        # Ray's AWS bootstrap rejects subnets/groups at node level once interfaces are given.
        assert all(n["SubnetId"] and n["Groups"] for n in nics)
        assert not {"SubnetId", "SubnetIds", "SecurityGroupIds"} & set(node)
        assert node["Placement"]["GroupName"]
    # The plugin NCCL loads must be on the raylet's library path.
    assert "/opt/amazon/ofi-nccl/lib" in " ".join(config["setup_commands"])


@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_smoke_study_runs_on_every_launcher_with_its_gpu_profile(name):
    # The README's `--set hardware=...` for each node type: the profile matches the node.
    for worker in worker_types(load(CLUSTER / name)).values():
        profile = profile_for(accelerator_labels(worker["resources"])).name
        study = load_spec(REPO / "experiments/cluster_smoke.yaml", [f"hardware={profile}"])
        (hardware,) = study.hardware
        assert hardware.gpus_per_node == worker["resources"]["GPU"]
        assert max(study.world_size) <= hardware.gpus_per_node * worker["max_workers"]
