"""`make gpu-check` on a machine without a CUDA device: exit 2 with one line, having imported neither
Ray nor MLflow; and the parts of the check that need no GPU (world sizes, the result table, the
trial command's overrides, `scalestudy calibrate` on a GPU profile); a trial that runs past its
limit leaves no rank of torchrun's running."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from scalestudy.calibrate import gpucheck
from scalestudy.calibrate.reference_step import IN_STEP_RANGE
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
    # MFU keeps the datasheet denominator; the best GEMM measured is an efficiency of it.
    assert profile.peak_tflops["bf16"] == base.peak_tflops["bf16"]
    assert profile.calibration["gemm_efficiency"] == pytest.approx(700.0 / base.peak_tflops["bf16"])
    # Inside the solve's range (calibrate/reference_step.py): the synthetic step is faster than the
    # parts, so the factor sits at its floor.
    assert profile.calibration["in_step_slowdown"] >= IN_STEP_RANGE[0]
    cfg = trial(["world_size=8", "zero_stage=3", "hardware=h100-80gb", "precision=bf16"])
    assert predict(cfg, profile).tokens_per_s > 0


def test_zero3_reference_step_prices_stage_3_hooks_at_world_1():
    """The H200 check (2026-12-04) ran TinyLlama at half stage 0's throughput under stage 3 on one
    GPU: calibrate measures the reference at stage 3 too, and the profile then predicts stage 3
    slower where the catalogue's (hooks hidden: 0) predicts both the same."""
    from scalestudy.calibrate.gpu import profile_from
    from scalestudy.calibrate.reference_step import reference_config
    from scalestudy.perfmodel.predict import predict, simulate
    from scalestudy.perfmodel.params import params_for
    from scalestudy.spec.catalog import get_hardware
    from tests.conftest import trial

    base = get_hardware("h200-141gb")
    alone = {"gemm": [[1e10, 500.0], [1.1e12, 770.0]], "hbm_gbps": 4200.0,
             "attention": [[128.0, 2048.0, 64.0, 2e-4, 6e-4]]}
    ref = reference_config("bf16", 1, hardware=base.name)
    model_s = simulate(ref, params_for(base))[0].step_s
    alone |= {"reference_step_s": 1.5 * model_s, "reference_step_zero3_s": 2.5 * model_s}
    profile = profile_from(base, alone, None, 1)
    assert 1.4 < profile.calibration["in_step_slowdown"] < 1.6
    assert profile.calibration["zero3_module_overhead_s"] > 0
    z0, z3 = (trial(["world_size=1", f"zero_stage={z}", "hardware=h200-141gb", "precision=bf16"])
              for z in (0, 3))
    assert predict(z3, profile).tokens_per_s < 0.9 * predict(z0, profile).tokens_per_s
    assert predict(z3, base).tokens_per_s == pytest.approx(predict(z0, base).tokens_per_s)


def test_gpu_reference_step_shares_no_model_sequence_or_tokens_with_the_gpu_check():
    from scalestudy.calibrate.gpucheck import SPEC
    from scalestudy.calibrate.reference_step import reference_config
    from scalestudy.spec.load import load_spec
    from scalestudy.plan import plan_study

    cfgs = [p.config for p in plan_study(load_spec(SPEC, ["world_size=1"]))]
    for zero in (0, 3):
        ref = reference_config("bf16", 1, hardware="h200-141gb", zero_stage=zero)
        assert ref.model not in {c.model for c in cfgs}
        assert ref.seq_len not in {c.seq_len for c in cfgs}
        assert ref.micro_batch * ref.seq_len not in {c.micro_batch * c.seq_len for c in cfgs}


# A rank as torchrun starts it (in a session of its own), with a child of its own (a compiler, a
# loader): it writes both pids, then waits far longer than any test.
RANK = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
path = os.path.join(sys.argv[1], "rank" + os.environ["RANK"])
with open(path + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(path + ".tmp", path)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Running or stopped; a zombie (killed, not yet reaped by its new parent) is not alive."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(predicate, what: str, limit_s: float = 120) -> None:
    deadline = time.time() + limit_s  # a guard against a hang, not a timing assertion
    while not predicate():
        assert time.time() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_kill_tree_leaves_none_of_torchruns_ranks_running(tmp_path):
    """torchrun's real process tree on CPU: two ranks, each with a child. kill_tree (what run_command
    does on timeout) leaves no process of it; killing torchrun alone left the ranks running."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    proc = gpucheck.start_session([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc_per_node", "2", str(script), str(tmp_path)])
    try:
        files = [tmp_path / "rank0", tmp_path / "rank1"]
        _wait_for(lambda: all(f.exists() for f in files), "both ranks to start")
        pids = [int(p) for f in files for p in f.read_text().split()]
        # the ranks really are outside torchrun's process group: killpg(torchrun) alone misses them
        assert {os.getpgid(p) for p in pids[::2]}.isdisjoint({proc.pid})
        assert all(_alive(p) for p in pids)
        gpucheck.kill_tree(proc)
        proc.communicate(timeout=gpucheck.KILL_WAIT_S)
        _wait_for(lambda: not any(_alive(p) for p in pids), "the killed processes to end", 10)
    finally:
        gpucheck.kill_tree(proc)


def test_run_command_kills_its_tree_on_timeout(tmp_path):
    """The timeout path: None for the exit code, and the session-of-its-own grandchild is gone."""
    pid_file = tmp_path / "pid"
    grandchild = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                  "'import time; time.sleep(600)'], start_new_session=True); "
                  f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    code, _, _ = gpucheck.run_command([sys.executable, "-c", grandchild], timeout_s=8)
    assert code is None
    assert pid_file.exists(), "the child did not start within the 8 s timeout"
    pid = int(pid_file.read_text())
    _wait_for(lambda: not _alive(pid), "the grandchild to end", 10)
