"""A Ray instance started by the process itself has fixed resources and no autoscaler: a trial it can
never hold is turned away at once as a placement timeout (launch/placement.py), where it waited
placement_timeout_s (30 min by default) for nodes that could not come."""

from __future__ import annotations

import json
import os
import subprocess
import time

from scalestudy.metrics import Status
from scalestudy.spec.load import load_spec
from scalestudy.plan import plan_study
from scalestudy.sweep.driver import DONE_STATUSES, run_sweep
from tests.conftest import REPO
from tests.integration.local_cluster import BIN


def test_run_of_a_gpu_study_on_a_machine_without_gpus_returns_at_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["SCALESTUDY_RESULTS_ROOT"] = str(tmp_path / "results")
    t0 = time.time()
    proc = subprocess.run([str(BIN / "scalestudy"), "run", str(REPO / "experiments/gpu-check.yaml"),
                           "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(line)
    assert result["status"] == "timeout"
    assert result["reason"].startswith("placement: needs 1 x {'GPU': 1.0"), result["reason"]
    assert "no autoscaler" in result["reason"]
    assert time.time() - t0 < 120  # Ray's start-up, not placement_timeout_s (1,800 s)


def test_a_sweep_turns_away_a_trial_larger_than_its_ray(ray_session, tmp_path, monkeypatch):
    """The session's Ray has 4 logical CPUs: an 8-worker CPU trial can never be placed in it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    spec = load_spec(REPO / "experiments/quickstart.yaml",
                     ["name=toolarge", "world_size=8", "zero_stage=0", "tracking.mlflow_uri=null"])
    t0 = time.time()
    out = run_sweep(spec, plan_study(spec), "spec", results_root=tmp_path / "results",
                    show_progress=False)
    (result,) = out.results
    assert result.status is Status.timeout and result.status not in DONE_STATUSES  # --resume retries
    assert result.reason.startswith("placement: needs 8 x {'CPU': 1.0} (PACK)"), result.reason
    assert "'CPU': 4.0" in result.reason
    assert time.time() - t0 < 120
