"""`scalestudy calibrate` on a Ray cluster (the session's local one): real Ray Train workers run the
benchmarks at world 1 and 2 (the pipeline ones at 2), their progress lines reach the driver as each benchmark ends (Ray does
not forward workers' output: calibrate/run.py relays them), and the profile it writes predicts."""

from __future__ import annotations

import os
import subprocess

import pytest

from scalestudy.metrics import Status
from scalestudy.perfmodel.predict import predict
from scalestudy.spec.catalog import load_hardware_file
from tests.conftest import trial
from tests.integration.local_cluster import BIN

pytestmark = pytest.mark.slow


def test_calibrate_on_ray_relays_progress_and_writes_a_profile(ray_session, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    out = tmp_path / "calibrated.yaml"
    proc = subprocess.run([str(BIN / "scalestudy"), "calibrate", "--quick", "--out", str(out)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("calibrate [")]
    for what in ("[ws1] gemm", "[ws1] reference step", "[ws2] collectives", "[ws2] reference step",
                 "[ws2] send/recv", "[ws2] pipeline reference step"):
        assert sum(what in ln for ln in progress) >= 1, (what, proc.stderr[-3000:])
    assert len(progress) == len(set(progress))  # each once: relayed, not also forwarded
    hw = load_hardware_file(out)
    cal = hw.calibration
    assert cal["calibration_world_size"] == 2.0 and cal["in_step_slowdown"] >= 0.5
    assert any(k.startswith("gemm_tflops_") for k in cal) and "busbw_gbps_all_reduce" in cal
    # The pipeline terms come through the same path as calibrate --local's (issue 33).
    assert "busbw_gbps_send_recv" in cal and any(k.endswith("_ws2_pp2") for k in cal)
    predicted = predict(trial(["world_size=2", "zero_stage=0"]), hardware=hw)
    assert predicted.status is Status.completed and predicted.tokens_per_s > 0
    print("\n" + "\n".join(progress))
