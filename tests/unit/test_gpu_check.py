"""`make gpu-check` on a machine without a CUDA device: exit 2 with one line, having imported neither
Ray nor MLflow; and the parts of the check that need no GPU (world sizes, the result table, the
trial command's overrides, `scalestudy calibrate` on a GPU profile)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from scalestudy.calibrate import gpucheck
from tests.conftest import REPO

BLOCK = "import sys\nsys.modules['ray'] = None\nsys.modules['mlflow'] = None\n"


def _env_without_ray_and_mlflow(tmp_path) -> dict[str, str]:
    site = tmp_path / "blocked"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    # An empty CUDA_VISIBLE_DEVICES hides any GPU, so the test holds on a GPU machine too.
    return {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}


def test_module_exits_2_with_one_line_without_cuda(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "scalestudy.calibrate.gpucheck"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=_env_without_ray_and_mlflow(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [gpucheck.NO_GPU]


def test_make_target_exits_2_with_one_line_without_cuda(tmp_path):
    python = os.path.join(os.path.dirname(sys.executable), "python")
    proc = subprocess.run(["make", "-s", "gpu-check", f"GPU_PYTHON={python}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=_env_without_ray_and_mlflow(tmp_path))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("make")]
    assert lines == [gpucheck.NO_GPU], proc.stderr


def test_world_sizes_cover_one_to_the_local_gpus():
    assert gpucheck.world_sizes(1) == [1]
    assert gpucheck.world_sizes(2) == [1, 2]
    assert gpucheck.world_sizes(6) == [1, 2, 4, 6]
    assert gpucheck.world_sizes(8) == [1, 2, 4, 8]


def test_prediction_of_a_check_trial_and_the_table(tmp_path):
    from scalestudy.spec.catalog import get_hardware, write_profile

    profile = tmp_path / "profile.yaml"
    write_profile(get_hardware("h100-80gb"), profile)
    overrides = gpucheck.trial_overrides(2, 3, profile)
    predicted = gpucheck.predicted_tokens_per_s(overrides)
    assert predicted > 0
    measured = {"status": "completed", "tokens_per_s": predicted / 1.25, "mfu": 0.4,
                "energy_per_token_j": 0.01, "comm_exposed_fraction": 0.1,
                "peak_memory_reserved_gib": 20.0}
    r = gpucheck.row(2, 3, measured, predicted)
    assert math.isclose(r["error_pct"], 25.0)
    text = gpucheck.table([r, gpucheck.row(1, 0, {"status": "failed", "reason": "oom: x"}, predicted)])
    assert text.splitlines()[0].split() == list(gpucheck.COLUMNS)
    assert "world 1 zero 0: oom: x" in text


def test_calibrate_on_a_gpu_profile_is_no_longer_refused_as_unimplemented(monkeypatch):
    import torch

    from scalestudy.calibrate import gpu, run
    from scalestudy.spec.catalog import get_hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(gpu.NoCudaDevice):
        run.calibrate(get_hardware("h100-80gb"))


def test_profile_from_measured_figures_is_one_the_model_reads():
    from scalestudy.calibrate.gpu import profile_from
    from scalestudy.perfmodel.predict import predict
    from scalestudy.spec.catalog import get_hardware
    from tests.conftest import trial

    base = get_hardware("h100-80gb")
    alone = {"gemm": [[1e10, 300.0], [1.1e12, 700.0]], "hbm_gbps": 2900.0,
             "attention": [[128.0, 2048.0, 64.0, 1e-3, 2.5e-3]], "reference_step_s": 0.02}
    curve = [[2.0**20, 40.0], [2.0**30, 360.0]]
    shared = {"comm": {op: curve for op in ("all_reduce", "all_gather", "reduce_scatter")},
              "reference_step_s": 0.025}
    profile = profile_from(base, alone, shared, 8)
    assert profile.kind == "gpu" and profile.hbm_gbps == 2900.0 and profile.nvlink_gbps_per_gpu == 360.0
    assert profile.calibration["gemm_tflops_bf16"] == alone["gemm"]
    assert profile.calibration["in_step_slowdown"] >= 1.0
    cfg = trial(["world_size=8", "zero_stage=3", "hardware=h100-80gb", "precision=bf16"])
    assert predict(cfg, profile).tokens_per_s > 0
