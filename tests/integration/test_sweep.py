"""Sweeps end to end: Ray Tune trials of real Ray Train x DeepSpeed runs, ledger first, MLflow second."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import yaml

from scalestudy.metrics import Status
from scalestudy.spec import catalog
from scalestudy.spec.load import load_spec
from scalestudy.plan import plan_study
from scalestudy.sweep.driver import FAULT_ENV, run_sweep
from scalestudy.track.ledger import Ledger
from scalestudy.track.sync import sync_mlflow
from tests.conftest import REPO

STEPS = "{warmup: 1, measure: 3, profile: 0}"


def _small_cpu_profile(tmp_path: Path) -> Path:
    """cpu-local with 1 GiB per device, so a huge micro-batch is infeasible by memory."""
    data = catalog.get_hardware("cpu-local").model_dump(mode="json", exclude={"name"})
    data["hbm_gib"] = 1
    path = tmp_path / "cpu-1gib.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _spec_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(text)
    return path


def _children(uri: str, experiment: str):
    client = mlflow.tracking.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("scalestudy.role") == "sweep"]
    children = [r for r in runs if r.data.tags.get("scalestudy.role") == "trial"]
    return parents, children


def test_sweep_statuses_ledger_mlflow_and_resume(ray_session, tmp_path, monkeypatch):
    profile = _small_cpu_profile(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec_path = _spec_file(tmp_path, f"""
name: sweep4
model: llama2-tiny
hardware: {profile}
world_size: 2
precision: fp32
micro_batch: [1, 2, 4, 4096]
steps: {STEPS}
tracking: {{mlflow_uri: "{uri}"}}
""")
    spec = load_spec(spec_path)
    monkeypatch.setenv(FAULT_ENV, "ws2-tp1-z0-mb2@1")
    root = tmp_path / "results"
    outcome = run_sweep(spec, plan_study(spec), spec_path.read_text(), max_concurrent=1,
                        results_root=root, show_progress=False)
    by_mb = {r.micro_batch: r for r in outcome.results}
    assert by_mb[1].status is Status.completed and by_mb[4].status is Status.completed
    assert by_mb[2].status is Status.failed and "injected fault" in by_mb[2].reason
    assert by_mb[4096].status is Status.infeasible and "GiB per device" in by_mb[4096].reason

    rows = Ledger(outcome.ledger).rows()
    assert sorted(r["micro_batch"] for r in rows) == [1, 2, 4, 4096]
    assert all(r["mlflow_run_id"] for r in rows)

    parents, children = _children(uri, "sweep4")
    assert len(parents) == 1 and len(children) == 4
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    status_by_mb = {int(c.data.params["micro_batch"]): c.data.tags["status"] for c in children}
    assert status_by_mb == {1: "completed", 2: "failed", 4: "completed", 4096: "infeasible"}
    done = next(c for c in children if c.data.params["micro_batch"] == "4")
    assert done.data.metrics["tokens_per_s"] > 0 and 0 < done.data.metrics["mfu"] < 1
    assert done.data.params["zero_stage"] == "0" and done.data.tags["backend"] == "measure"

    # --resume: everything is already recorded, nothing launches, no run is added.
    again = run_sweep(spec, plan_study(spec), spec_path.read_text(), resume=True,
                      results_root=root, show_progress=False)
    assert again.results == [] and again.skipped == 4
    assert len(_children(uri, "sweep4")[1]) == 4
    assert len(Ledger(outcome.ledger).rows()) == 4


@pytest.mark.slow
def test_unreachable_mlflow_then_sync(ray_session, tmp_path):
    spec_path = _spec_file(tmp_path, f"""
name: offline
model: llama2-tiny
hardware: cpu-local
world_size: 1
tp: [1, 2, 4]
steps: {STEPS}
tracking: {{mlflow_uri: "http://127.0.0.1:9"}}
""")
    spec = load_spec(spec_path)
    root = tmp_path / "results"
    started = time.time()
    outcome = run_sweep(spec, plan_study(spec), spec_path.read_text(), results_root=root,
                        show_progress=False)
    assert outcome.mlflow_error and "127.0.0.1:9" in outcome.mlflow_error
    rows = Ledger(outcome.ledger).rows()
    assert len(rows) == 3 and all(r["mlflow_run_id"] is None for r in rows)
    assert sum(r["status"] == "completed" for r in rows) == 1
    assert time.time() - started < 240  # no minutes of HTTP retries

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logged, error = sync_mlflow("offline", uri, results_root=root)
    assert (logged, error) == (3, None)
    assert len(_children(uri, "offline")[1]) == 3
    assert sync_mlflow("offline", uri, results_root=root) == (0, None)  # idempotent


@pytest.mark.slow
def test_kill_driver_then_resume_adds_no_duplicate_runs(ray_session, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec_path = _spec_file(tmp_path, f"""
name: interrupted
model: llama2-tiny
hardware: cpu-local
world_size: 1
zero_stage: [0, 1, 2]
steps: {STEPS}
tracking: {{mlflow_uri: "{uri}"}}
""")
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    env.pop(FAULT_ENV, None)
    cmd = [sys.executable, "-m", "scalestudy.cli", "sweep", str(spec_path), "--max-concurrent", "1"]
    ledger = Ledger(tmp_path / "results" / "interrupted" / "trials.parquet")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not ledger.rows():
            time.sleep(0.5)
        assert ledger.rows(), "first trial never reached the ledger"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver dies mid-sweep, as under preemption
        proc.wait()
    first = {r["trial_id"] for r in ledger.rows()}
    assert 1 <= len(first) < 3

    # --json: stdout holds the results alone, one object per line (Ray Tune's banner, which Ray
    # 2.60 prints to stdout at every verbosity, goes to stderr: sweep/tune_runner.run_tune)
    done = subprocess.run(cmd + ["--resume", "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [json.loads(line) for line in done.stdout.splitlines()]
    assert printed and {r["trial_id"] for r in printed} <= {r["trial_id"] for r in ledger.rows()}
    rows = ledger.rows()
    assert sorted(r["zero_stage"] for r in rows) == [0, 1, 2]
    assert all(r["status"] == "completed" for r in rows)
    children = _children(uri, "interrupted")[1]
    assert len(children) == 3
    assert len({c.data.tags["trial_id"] for c in children}) == 3
