"""Cluster workflows against Ray heads these tests start themselves: the `ray job submit` round trip,
and a sweep on a fake autoscaling cluster (Ray's fake multi-node provider) that must add nodes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import mlflow
import pytest

from scalestudy.track.ledger import Ledger
from tests.conftest import REPO
from tests.integration.local_cluster import (BIN, alive_nodes, leftover_processes, local_head,
                                             set_node_types)

pytestmark = pytest.mark.slow

STUDY = """
name: {name}
model: llama2-tiny
hardware: cpu-local
world_size: {world_size}
zero_stage: [0, 1]
steps: {{warmup: 1, measure: 3, profile: 0}}
tracking: {{mlflow_uri: "sqlite:///{db}"}}
"""


def _check_results(root, name: str, db, n: int) -> None:
    rows = Ledger(root / name / "trials.parquet").rows()
    assert sorted(r["zero_stage"] for r in rows) == list(range(n))
    assert all(r["status"] == "completed" for r in rows), [r["reason"] for r in rows]
    client = mlflow.tracking.MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id])
    trials = [r for r in runs if r.data.tags.get("scalestudy.role") == "trial"]
    assert sorted(r.data.tags["trial_id"] for r in trials) == sorted(r["trial_id"] for r in rows)


def test_job_submit_sweep_round_trip(tmp_path):
    spec = tmp_path / "jobstudy.yaml"
    db = tmp_path / "mlflow.db"
    spec.write_text(STUDY.format(name="jobstudy", world_size=1, db=db))
    results = tmp_path / "results"
    t0 = time.time()
    with local_head(num_cpus=2, dashboard=True) as head:
        deadline = time.time() + 60  # the job agent registers a few seconds after the head is up
        while True:
            submit = subprocess.run(
                [str(BIN / "ray"), "job", "submit", "--address", head.dashboard_url,
                 "--runtime-env", "cluster/runtime_env.yaml", "--working-dir", ".",
                 "--submission-id", "scalestudy-test-job", "--",
                 "scalestudy", "sweep", str(spec), "--results-root", str(results),
                 "--max-concurrent", "1"],
                cwd=REPO, env=head.env, capture_output=True, text=True, timeout=600)
            if "No available agent" not in submit.stdout + submit.stderr or time.time() > deadline:
                break
            time.sleep(1)
        assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
        status = subprocess.run(
            [str(BIN / "ray"), "job", "status", "--address", head.dashboard_url,
             "scalestudy-test-job"], env=head.env, capture_output=True, text=True, timeout=60)
        text = re.sub(r"\x1b\[[0-9;]*m", "", status.stdout + status.stderr)
        assert re.search(r"scalestudy-test-job'? (succeeded|SUCCEEDED)", text), text
    wall = time.time() - t0
    assert leftover_processes(head) == []
    _check_results(results, "jobstudy", db, 2)
    print(f"\nray job submit round trip (head start, 2 trials, head stop): {wall:.1f} s")


# CPU-only fake nodes standing in for GPU nodes (two "devices" each).
FAKE_NODE_TYPES = {"fake-gpu-node": {"resources": {"CPU": 2}, "node_config": {},
                                     "min_workers": 0, "max_workers": 1}}


def test_autoscaling_sweep_adds_nodes(tmp_path):
    """The head holds no CPU for trials, so each 2-worker trial needs a node the autoscaler adds."""
    spec = tmp_path / "autoscale.yaml"
    db = tmp_path / "mlflow.db"
    spec.write_text(STUDY.format(name="autoscale", world_size=2, db=db))
    results = tmp_path / "results"
    with local_head(num_cpus=0, autoscaling=FAKE_NODE_TYPES) as head:
        assert alive_nodes(head) == 1
        t0 = time.time()
        sweep = subprocess.Popen(
            [str(BIN / "scalestudy"), "sweep", str(spec), "--results-root", str(results),
             "--max-concurrent", "1"], env=head.env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            node_added_s = None
            while sweep.poll() is None:
                if node_added_s is None and alive_nodes(head) > 1:
                    node_added_s = time.time() - t0
                time.sleep(1)
            out = sweep.stdout.read()
        finally:
            if sweep.poll() is None:
                sweep.kill()
                sweep.wait()
        assert sweep.returncode == 0, out[-3000:]
        assert node_added_s is not None, "the autoscaler never added a node"
    assert leftover_processes(head) == []
    _check_results(results, "autoscale", db, 2)
    print(f"\nfake autoscaler: node added {node_added_s:.1f} s after the sweep started; "
          f"sweep {json.dumps(out.splitlines()[-1])}")


def test_autoscaling_elastic_trial_grows_onto_a_new_node(tmp_path):
    """Elastic [1, 2] on a 1-CPU head: Ray Train starts the trial with the one worker that fits and
    asks the autoscaler for room for two. Only once the trial is running does the test let the
    autoscaler launch a node (before, it would race the trial's start); when the node arrives the
    group grows to two workers, resuming from its checkpoint at the same global batch."""
    spec = tmp_path / "elastic.yaml"
    db = tmp_path / "mlflow.db"
    spec.write_text(f"""
name: elastic
model: llama2-tiny
hardware: cpu-local
world_size: 2
micro_batch: 1
global_batch: 2
elastic: {{min_workers: 1, max_workers: 2, resize_check_s: 1}}
steps: {{warmup: 2, measure: 1500, profile: 0}}
fault_tolerance: {{max_failures: 1, checkpoint_every: 10}}
tracking: {{mlflow_uri: "sqlite:///{db}"}}
""")
    results = tmp_path / "results"

    def node_types(max_nodes: int) -> dict:
        return {"fake-gpu-node": {"resources": {"CPU": 1}, "node_config": {},
                                  "min_workers": 0, "max_workers": max_nodes}}

    with local_head(num_cpus=1, autoscaling=node_types(0)) as head:
        sweep = subprocess.Popen(
            [str(BIN / "scalestudy"), "sweep", str(spec), "--results-root", str(results),
             "--max-concurrent", "1"], env=head.env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.time() + 300
            while not list(results.rglob("loop_state.json")):  # running, with one worker
                assert sweep.poll() is None and time.time() < deadline, "trial never checkpointed"
                time.sleep(0.5)
            assert alive_nodes(head) == 1
            set_node_types(head, node_types(1), head_cpus=1)
            out, _ = sweep.communicate(timeout=900)
        finally:
            if sweep.poll() is None:
                sweep.kill()
                sweep.wait()
        assert sweep.returncode == 0, out[-3000:]
        nodes = alive_nodes(head)
    assert leftover_processes(head) == []
    (row,) = Ledger(results / "elastic" / "trials.parquet").rows()
    assert row["status"] == "completed", row["reason"]
    resizes = json.loads(row["resizes"])
    assert nodes == 2 and [r["world_size"] for r in resizes] == [1, 2], (nodes, resizes)
    assert len(row["step_times_s"]) == 1500 and sum(r["steps"] for r in resizes) == 1500
    assert row["tokens_per_s"] == resizes[-1]["tokens_per_s"]  # the final segment's, not a blend
    assert json.loads(row["extra"])["final_grad_accum"] == 1
    print(f"\nelastic trial grew {resizes}, time lost {row['time_lost_s']:.1f} s")
