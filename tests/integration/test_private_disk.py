"""A cluster whose nodes have their own disks: the head (0 CPUs, where the sweep driver runs) and a
worker node started in its own mount namespace with a tmpfs over the results root, so the worker
node cannot see the head's results folder (what a cloud node without a shared mount is).

A study that does not checkpoint completes there, swept or run from the head (the summary returns
through Ray, not storage); the same study with fault tolerance is refused before any trial with the
one-line fix.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import mlflow
import pytest

from scalestudy.track.ledger import Ledger, ledger_path
from tests.conftest import REPO
from tests.integration.local_cluster import BIN, TEARDOWN_GRACE_S, _kill_group, alive_nodes, local_head

pytestmark = pytest.mark.slow

STUDY = """
name: {name}
model: llama2-tiny
hardware: cpu-local
world_size: 1
zero_stage: [0, 1]
steps: {{warmup: 1, measure: 3, profile: 0}}
tracking: {{mlflow_uri: "sqlite:///{db}"}}
"""
FAULT_TOLERANCE = ["fault_tolerance.max_failures=1", "fault_tolerance.checkpoint_every=2"]


def _unshare_refusal() -> str | None:
    """Why a private mount namespace cannot be made here, or None when it can."""
    try:
        probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                               capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "unshare is not installed"
    if probe.returncode != 0:
        return f"unshare --mount is not permitted here: {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def private_disk_cluster(tmp_path_factory):
    """(head, results root, tmp dir): two nodes; the worker node sees a tmpfs at the results root."""
    why = _unshare_refusal()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("privdisk")
    root = tmp / "results"
    root.mkdir()
    with local_head(num_cpus=0) as head:
        # The worker node's raylet and every worker it forks live in the new namespace, where the
        # head's results folder is hidden under an empty tmpfs.
        script = (f'mount -t tmpfs -o size=256m tmpfs "{root}" && exec "{BIN / "ray"}" start '
                  f'--address={head.gcs_address} --num-cpus=2 --object-store-memory=200000000 '
                  f'--disable-usage-stats --block')
        log = open(tmp / "worker-node.log", "w")
        node = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                 script], env=head.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.time() + 120
            while alive_nodes(head) < 2:
                if node.poll() is not None or time.time() > deadline:
                    pytest.fail("worker node did not join: "
                                + (tmp / "worker-node.log").read_text()[-2000:])
                time.sleep(1)
            yield head, root, tmp
        finally:
            _kill_group(node, TEARDOWN_GRACE_S)
            log.close()


def _sweep(head, tmp: Path, root: Path, name: str, extra: list[str]) -> subprocess.CompletedProcess:
    spec = tmp / f"{name}.yaml"
    spec.write_text(STUDY.format(name=name, db=tmp / "mlflow.db"))
    sets = [a for s in extra for a in ("--set", s)]
    return subprocess.run(
        [str(BIN / "scalestudy"), "sweep", str(spec), "--results-root", str(root), *sets],
        cwd=REPO, env=head.env, capture_output=True, text=True, timeout=900)


def test_private_disk_sweep_completes_without_shared_storage(private_disk_cluster):
    head, root, tmp = private_disk_cluster
    t0 = time.time()
    out = _sweep(head, tmp, root, "privdisk", [])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = Ledger(ledger_path("privdisk", root)).rows()
    assert sorted(r["zero_stage"] for r in rows) == [0, 1]
    assert all(r["status"] == "completed" for r in rows), [r["reason"] for r in rows]
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name("privdisk")
    trials = [r for r in client.search_runs([exp.experiment_id])
              if r.data.tags.get("scalestudy.role") == "trial"]
    assert sorted(r.data.tags["trial_id"] for r in trials) == sorted(r["trial_id"] for r in rows)
    print(f"\nprivate-disk sweep, 2 trials on the worker node: {time.time() - t0:.1f} s")


def test_private_disk_run_launched_on_the_head_completes(private_disk_cluster):
    """`scalestudy run` launches its trial from the head (the driver's node), so Ray Train's
    controller is there while the worker runs on the worker node: the case where a summary sent
    through storage failed ("Check that all nodes in the cluster have read/write access")."""
    head, root, tmp = private_disk_cluster
    spec = tmp / "privrun.yaml"
    spec.write_text(STUDY.format(name="privrun", db=tmp / "mlflow.db"))
    t0 = time.time()
    out = subprocess.run(
        [str(BIN / "scalestudy"), "run", str(spec), "--set", "zero_stage=0", "--json",
         "--results-root", str(root)],
        cwd=REPO, env=head.env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == "completed" and result["tokens_per_s"] > 0
    print(f"\nprivate-disk run from the head: {time.time() - t0:.1f} s")


def test_private_disk_fault_tolerance_refused_up_front(private_disk_cluster):
    head, root, tmp = private_disk_cluster
    t0 = time.time()
    out = _sweep(head, tmp, root, "privdiskft", FAULT_TOLERANCE)
    wall = time.time() - t0
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    (line,) = errors
    assert line.startswith(f"error: --results-root: invalid value '{root}'")
    assert "cannot see this local folder" in line
    assert "shared mount" in line and "s3://" in line
    # Refused before any trial and before MLflow: no ledger, no experiment.
    assert not Ledger(ledger_path("privdiskft", root)).exists()
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    assert client.get_experiment_by_name("privdiskft") is None
    print(f"\nrefused in {wall:.1f} s (CLI start included): {line}")
