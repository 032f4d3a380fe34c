"""A whole trial on NVIDIA GPUs through the torchrun adapter (NCCL, no Ray): built under zero.Init on
the GPUs, metered by NVML on the trial's own devices, peak reserved memory beside allocated, NCCL
collectives classified in the profiled window. Marked ``gpu``: skipped where no CUDA device is visible
(tests/conftest.py); world 2 needs two GPUs, world 1 runs on one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import QUICKSTART, REPO

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("zero", [0, 3])
def test_nccl_trial_is_metered_on_its_own_gpus(tmp_path, zero):
    import torch

    world = min(2, torch.cuda.device_count())
    sets = [f"world_size={world}", f"zero_stage={zero}", "hardware=h100-80gb", "precision=bf16",
            "micro_batch=4", "steps={warmup: 3, measure: 10, profile: 1}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           "-m", "scalestudy.train.local", str(QUICKSTART), *(f"--set={s}" for s in sets), "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    r = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert r["status"] == "completed" and r["loss_last"] < r["loss_first"], r.get("reason")
    assert r["energy_source"] == "nvml" and r["energy_j"] > 0 and 5.0 < r["power_w"] < 2000.0
    assert "GPU boards" in r["extra"]["energy_scope"]
    assert r["peak_memory_reserved_gib"] >= r["peak_memory_gib"] > 0
    assert r["device_memory_used_gib"] >= r["peak_memory_reserved_gib"]
    assert r["memory_source"] == "cuda_allocator"
    ds = r["extra"]["deepspeed_config"]
    assert ds["optimizer"]["params"]["fused"] is True
    if zero:
        assert ds["zero_optimization"]["overlap_comm"] is True
    if zero and world > 1:  # ZeRO-3 gathers its weights over NCCL inside the profiled window
        assert r["comm"]["all_gather"]["count"] > 0, r["comm"]
