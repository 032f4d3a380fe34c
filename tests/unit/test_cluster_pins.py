"""One place for every version a cluster node installs: cluster/constraints.txt (written by
cluster/pin.py from the tested environment). Every install a node runs (the launchers' setup
commands, the KubeRay image, `make gpu-check`) reads it with `-c` and names no version itself;
the runtime env installs nothing; the versions outside pip (Ray's image tag, KubeRay's rayVersion,
the nodes' Python) and pyproject.toml's exact pins agree with it; no image is a floating `latest`."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from ray.autoscaler._private.command_runner import _with_interactive

from tests.unit.cluster_files import CLUSTER, CONSTRAINTS, KUBERAY, LAUNCHER, REPO, load, worker_types

NODE_CONSTRAINTS = "~/scalestudy/cluster/constraints.txt"  # the repo as the launchers sync it
IMAGE_CONSTRAINTS = "/home/ray/scalestudy/cluster/constraints.txt"  # as the Dockerfile copies it
INSTALL = re.compile(r"\bpip install\b")


def pins() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            out[canonicalize_name(name)] = version
    return out


def pyproject_requirements() -> list[Requirement]:
    return [Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]


def launcher_installs(name: str) -> list[str]:
    config = load(CLUSTER / name)
    return [c for key in ("setup_commands", "head_setup_commands") for c in config.get(key, [])
            if INSTALL.search(c)]


def dockerfile_installs() -> list[str]:
    text = re.sub(r"\\\n", " ", (KUBERAY / "Dockerfile").read_text())
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ") and INSTALL.search(line)]


def makefile_installs() -> list[str]:
    recipe = re.search(r"^gpu-check:\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M).group(1)
    return [ln.strip() for ln in recipe.splitlines() if INSTALL.search(ln)]


def test_constraints_are_exact_unique_and_sorted():
    lines = [ln for ln in CONSTRAINTS.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9-]*==[0-9][0-9A-Za-z.+!-]*", ln) for ln in lines), lines
    names = [ln.split("==")[0] for ln in lines]
    assert names == sorted(set(names)) and all(canonicalize_name(n) == n for n in names)
    # what the trial body's internals come from, and the nodes' own tools
    assert {"torch", "ray", "deepspeed", "transformers", "mlflow", "pyarrow", "uv", "boto3",
            "google-api-python-client"} <= set(pins())


def test_pyproject_pins_appear_exactly_and_its_ranges_hold_the_pinned_version():
    constrained = pins()
    for req in pyproject_requirements():
        name = canonicalize_name(req.name)
        assert name in constrained, f"{req} is not in {CONSTRAINTS.name}: run python cluster/pin.py"
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            assert exact == [constrained[name]], (str(req), constrained[name])
        assert req.specifier.contains(constrained[name], prereleases=True), (str(req), constrained[name])


def test_the_exactly_pinned_packages_are_what_the_tests_run():
    """pyproject's exact pins are the packages whose internals the trial body relies on: the
    environment these tests run in has those versions, so the nodes run what was tested."""
    from importlib import metadata

    constrained = pins()
    for req in pyproject_requirements():
        if any(s.operator == "==" for s in req.specifier):
            installed = metadata.version(req.name).split("+")[0]  # 2.13.0+cpu here, CUDA on nodes
            assert installed == constrained[canonicalize_name(req.name)], req.name


def _check_install(cmd: str, constraints: str) -> None:
    """A pip/uv install: reads the constraints file and writes no version itself."""
    args = shlex.split(cmd)
    i = args.index("-c")
    assert args[i + 1] == constraints, cmd
    rest = args[args.index("install") + 1:]
    named = [a for j, a in enumerate(rest) if not a.startswith("-") and rest[j - 1] not in
             ("-c", "--python", "-e") and not a.startswith(("/", "~", "."))]
    assert named or "-e" in rest, cmd  # packages by name, or the project (its pins: pyproject)
    known = pins()
    for arg in named:
        req = Requirement(arg)
        assert not req.specifier and req.url is None, f"{arg}: the version belongs in {CONSTRAINTS.name}"
        assert canonicalize_name(req.name) in known, f"{arg} is not pinned in {CONSTRAINTS.name}"


@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_every_launcher_install_reads_the_constraints(name):
    installs = launcher_installs(name)
    assert len(installs) >= 2  # the project on every node, the autoscaler's client on the head
    for cmd in installs:
        _check_install(cmd, NODE_CONSTRAINTS)
    assert any("-e ~/scalestudy" in cmd for cmd in installs)


def test_image_and_gpu_check_installs_read_the_constraints():
    docker = dockerfile_installs()
    assert len(docker) == 2 and "torch" in docker[0].split() and "-e" in docker[1].split()
    for cmd in docker:
        _check_install(cmd, IMAGE_CONSTRAINTS)
    assert f"COPY --chown=ray:users cluster/constraints.txt {IMAGE_CONSTRAINTS}" in (
        KUBERAY / "Dockerfile").read_text()
    make = makefile_installs()
    assert len(make) == 2
    assert "--no-deps -e ." in make[0]  # the project alone; its small dependencies come next
    _check_install(make[1].split("-m ", 1)[1], "cluster/constraints.txt")
    readme = (CLUSTER / "README.md").read_text()
    launcher = re.search(r"^pip install .*$", readme, re.M).group(0)  # the launcher instance's Ray
    _check_install(launcher.split("#")[0], "cluster/constraints.txt")


def test_runtime_envs_install_nothing():
    """A job-level pip/uv/conda list would be a second list of versions (and a venv per job)."""
    rayjob = yaml.safe_load(load(KUBERAY / "rayjob.yaml")["spec"]["runtimeEnvYAML"])
    for env in (load(CLUSTER / "runtime_env.yaml"), rayjob):
        assert not {"pip", "uv", "conda", "container", "image_uri"} & set(env), env


def test_versions_outside_pip_agree_with_the_constraints():
    ray_version = pins()["ray"]
    docker = (KUBERAY / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", docker, re.M)
    assert base == f"rayproject/ray:{ray_version}-py{sys.version_info.major}{sys.version_info.minor}-gpu"
    for manifest in (load(KUBERAY / "raycluster.yaml")["spec"],
                     load(KUBERAY / "rayjob.yaml")["spec"]["rayClusterSpec"]):
        assert manifest["rayVersion"] == ray_version
    python = f"{sys.version_info.major}.{sys.version_info.minor}"  # the nodes' Python is the tests'
    for name in LAUNCHER:
        venvs = [c for c in load(CLUSTER / name)["setup_commands"] if " venv " in c]
        assert venvs and all(f"--python {python} " in c for c in venvs), venvs
        text = (CLUSTER / name).read_text()
        assert not re.search(r"==\d", text), f"{name} names a version: it belongs in {CONSTRAINTS.name}"


def test_no_node_boots_a_floating_image():
    """An exact AMI / VM image per launcher (one for all its nodes), the placeholder until filled;
    never `latest`, an SSM `.../latest/...` parameter or an image family."""
    for name in LAUNCHER:
        config = load(CLUSTER / name)
        images = set()
        for node_type in config["available_node_types"].values():
            node = node_type["node_config"]
            images |= {node["ImageId"]} if "ImageId" in node else {
                d["initializeParams"]["sourceImage"] for d in node["disks"] if d.get("boot")}
        (image,) = images
        assert not re.search(r"latest|/family/|resolve:ssm", image), (name, image)
        assert re.fullmatch(r"ami-[0-9a-f]{8,17}|ami-REPLACE_ME|projects/[\w-]+/global/images/[\w-]+",
                            image), (name, image)
    for path in (KUBERAY / "raycluster.yaml", KUBERAY / "rayjob.yaml", KUBERAY / "Dockerfile"):
        for image in re.findall(r"(?:image:|FROM)\s+(\S+)", path.read_text()):
            assert re.search(r":[\w.-]+$", image) and not image.endswith(":latest"), (path.name, image)


def test_uv_is_installed_at_its_pinned_version(tmp_path):
    """The launchers' uv step, run as Ray runs it (bash, login shell) with curl recorded: it installs
    the version the constraints pin, and leaves a uv of that version alone."""
    (cmd,) = {c for c in load(CLUSTER / "aws-a100.yaml")["setup_commands"] if "astral.sh" in c}
    assert all(cmd in load(CLUSTER / n)["setup_commands"] for n in LAUNCHER)  # one step everywhere
    (tmp_path / "scalestudy" / "cluster").mkdir(parents=True)
    (tmp_path / "scalestudy" / "cluster" / "constraints.txt").write_text(CONSTRAINTS.read_text())
    stubs, calls = tmp_path / "bin", tmp_path / "calls"
    stubs.mkdir()
    (stubs / "curl").write_text(f'#!/bin/sh\necho "$*" >> {calls}\necho true\n')
    (stubs / "curl").chmod(0o755)
    (wrapped,) = shlex.split(_with_interactive(cmd)[-1])
    env = {"HOME": str(tmp_path), "PATH": f"{stubs}:/usr/bin:/bin"}

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", wrapped], env=env, capture_output=True, text=True, timeout=30)

    assert run().returncode == 0
    assert calls.read_text().split()[-1] == f"https://astral.sh/uv/{pins()['uv']}/install.sh"
    calls.unlink()
    uv = tmp_path / ".local" / "bin" / "uv"
    uv.parent.mkdir(parents=True)
    uv.write_text(f"#!/bin/sh\necho 'uv {pins()['uv']} (0000000 2026-11-01)'\n")
    uv.chmod(0o755)
    assert run().returncode == 0 and not calls.exists()  # the pinned uv is there: nothing fetched
    (tmp_path / "scalestudy" / "cluster" / "constraints.txt").write_text("# no pins\n")
    proc = run()
    assert proc.returncode != 0 and "pins no uv" in proc.stderr


def test_pin_script_derives_its_pins_from_this_environment():
    """cluster/pin.py: the closure of pyproject's dependencies at their installed versions (torch's
    +cpu dropped), plus what nodes install beyond this environment."""
    from importlib import metadata

    sys.path.insert(0, str(CLUSTER))
    try:
        import pin
    finally:
        sys.path.remove(str(CLUSTER))
    derived = pin.node_pins()
    assert derived["torch"] == metadata.version("torch").split("+")[0]
    assert derived["click"] == metadata.version("click")  # through typer: requirements followed
    assert {"uv", "google-api-python-client"} <= set(derived) and "scalestudy" not in derived
    rendered = pin.render(derived)
    assert rendered.startswith("# Exact versions") and rendered.endswith(f"uv=={derived['uv']}\n" if
                                                                          max(derived) == "uv" else "\n")
    assert Path(pin.OUT) == CONSTRAINTS
