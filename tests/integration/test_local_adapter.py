"""The trial body without Ray: `torchrun -m scalestudy.train.local` runs a world-2 ZeRO-3 trial in
processes where `import ray` fails, and trains exactly as the Ray Train path does."""

from __future__ import annotations

import os
import subprocess
import sys

from scalestudy.metrics import Status, TrialResult
from scalestudy.launch.ray_train import run_trial
from tests.conftest import QUICKSTART, REPO, trial

SETS = ["world_size=2", "zero_stage=3", "precision=fp32", "micro_batch=2",
        "steps={warmup: 2, measure: 4, profile: 2}"]


def _env_without_ray(tmp_path) -> dict[str, str]:
    """A sitecustomize that makes `import ray` fail in every process started with this env."""
    site = tmp_path / "noray"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def test_torchrun_trial_without_ray_matches_ray_train(ray_session, ray_storage, tmp_path):
    env = _env_without_ray(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert probe.returncode != 0 and "import of ray halted" in probe.stderr  # blocked indeed

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "scalestudy.train.local", str(QUICKSTART), *(f"--set={s}" for s in SETS), "--json"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    json_lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(json_lines) == 1, proc.stdout  # rank 0 only, nothing else on stdout
    local = TrialResult.model_validate_json(json_lines[0])

    ray = run_trial(trial(SETS), ray_storage)
    assert local.status is Status.completed and ray.status is Status.completed, (local.reason,
                                                                                   ray.reason)
    assert local.trial_id == ray.trial_id
    assert set(local.model_dump()) == set(ray.model_dump())  # the same TrialResult schema
    assert len(local.losses) == len(ray.losses) == 6 and len(local.step_times_s) == 4
    assert max(abs(a - b) for a, b in zip(local.losses, ray.losses)) <= 1e-6, (local.losses,
                                                                               ray.losses)
    assert local.loss_last < local.loss_first
    # the profiled window ran too: ZeRO-3 all_gathers its weights on both paths
    assert local.comm.keys() == ray.comm.keys() and "all_gather" in local.comm
