"""An object-store results root: an S3-compatible server on 127.0.0.1 (moto in server mode) as
`--results-root s3://...`. A fault-tolerant sweep loses a worker mid-window and restarts from the
checkpoint Ray Train persisted in the bucket; the ledger lives in the bucket and `scalestudy
report` reads it from the same URI."""

from __future__ import annotations

import html
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from scalestudy.track.ledger import Ledger, ledger_path
from tests.conftest import REPO
from tests.integration.local_cluster import BIN, local_head
from tests.s3_server import s3_server

pytestmark = pytest.mark.slow

BUCKET = "scalestudy-results"
ROOT = f"s3://{BUCKET}/team/studies"
STUDY = """
name: s3study
model: llama2-tiny
hardware: cpu-local
world_size: 2
steps: {{warmup: 2, measure: 24, profile: 0}}
fault_tolerance: {{max_failures: 2, checkpoint_every: 4}}
tracking: {{mlflow_uri: "sqlite:///{db}"}}
"""


def _train_worker_pids() -> set[int]:
    """Ray Train worker processes on this machine (Ray titles them `ray::RayTrainWorker...`)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def _checkpoints_in_bucket(endpoint: str) -> int:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="team/studies/")
    return sum(obj["Key"].endswith("loop_state.json") for p in pages for obj in p.get("Contents", []))


def _wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"sweep ended (rc {proc.returncode}) while waiting for {what}: "
                                 + proc.stdout.read()[-3000:])
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


@pytest.fixture(scope="module")
def killed_sweep(tmp_path_factory):
    """Run the sweep into the bucket, kill one of its workers after two checkpoints; yield what
    happened. The server, the cluster (started after the endpoint is in the environment, so every
    Ray process reaches the server) and the sweep all belong to this module."""
    tmp = tmp_path_factory.mktemp("s3study")
    spec = tmp / "s3study.yaml"
    spec.write_text(STUDY.format(db=tmp / "mlflow.db"))
    with s3_server(BUCKET) as endpoint, local_head(num_cpus=2) as head:
        before = _train_worker_pids()
        t0 = time.time()
        proc = subprocess.Popen(
            [str(BIN / "scalestudy"), "sweep", str(spec), "--results-root", ROOT,
             "--max-concurrent", "1"], cwd=REPO, env=head.env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            # A rank writes its second checkpoint only after Ray Train registered the first, so
            # with two in the bucket a restart has one to resume from.
            _wait_for(lambda: _checkpoints_in_bucket(endpoint) >= 2, 400, "two checkpoints", proc)
            victims = _wait_for(lambda: sorted(_train_worker_pids() - before), 30,
                                "the trial's workers", proc)
            killed_at = time.time()
            os.kill(victims[-1], signal.SIGKILL)
            output, _ = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        yield {"rc": proc.returncode, "output": output, "killed_at": killed_at,
               "done_at": time.time(), "t0": t0, "head": head, "tmp": tmp,
               "endpoint": endpoint, "checkpoints": _checkpoints_in_bucket(endpoint)}


def test_object_store_sweep_survives_a_killed_worker(killed_sweep):
    k = killed_sweep
    assert k["rc"] == 0, k["output"][-4000:]
    (row,) = Ledger(ledger_path("s3study", ROOT)).rows()  # read back from the bucket
    assert row["status"] == "completed", row["reason"]
    assert row["restarts"] == 1  # resumed from the bucket's checkpoint, not from scratch
    assert 0 < row["time_lost_s"] < k["done_at"] - k["killed_at"] + 60
    assert not (REPO / "s3:").exists()  # the URI never became a local folder
    print(f"\nsweep into {ROOT}: {k['done_at'] - k['t0']:.1f} s; worker killed after "
          f"{k['killed_at'] - k['t0']:.1f} s, trial done {k['done_at'] - k['killed_at']:.1f} s "
          f"later, time lost {row['time_lost_s']:.1f} s, {k['checkpoints']} loop states in the bucket")


def test_object_store_report_reads_the_ledger_from_the_uri(killed_sweep):
    k = killed_sweep
    out_dir = k["tmp"] / "report"
    # The report alone: an MLflow store without the study, so only the bucket's ledger can feed it.
    env = {**k["head"].env, "AWS_ENDPOINT_URL": k["endpoint"]}
    rep = subprocess.run(
        [str(BIN / "scalestudy"), "report", "s3study", "--results-root", ROOT, "--out",
         str(out_dir), "--tracking-uri", f"sqlite:///{k['tmp'] / 'empty.db'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stdout[-3000:] + rep.stderr[-3000:]
    page = Path(rep.stdout.strip().splitlines()[-1])
    assert page.is_file()
    assert html.escape(f"the ledger {ROOT}/s3study/trials.parquet") in page.read_text()
