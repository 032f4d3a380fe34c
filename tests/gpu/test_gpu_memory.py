"""The memory estimate against a real GPU trial (issue 30): the check tests/validation/
test_memory_measured.py makes on CPU, on the trials `make gpu-check` runs (experiments/gpu-check.yaml:
TinyLlama-1.1B, bf16, 4 x 2,048 tokens), ZeRO 0 and 3, through the torchrun adapter (no Ray).

Two comparisons per trial, both within calibrate.gpucheck.MEMORY_BOUND (15%):
  * the caching allocator's peak (torch.cuda.max_memory_allocated, the trial's peak_memory_gib)
    against the estimate less the terms the allocator does not see (its fragmentation, NCCL's
    buffers, the CUDA context);
  * NVML's used memory of the device after the timed window (the reserved pool, which the allocator
    keeps, plus the context and NCCL) against the whole estimate.

Marked ``gpu``: tests/conftest.py skips it where torch sees no CUDA device.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("zero", [0, 3])
def test_memory_estimate_within_bound_of_the_gpu_trial(zero):
    import torch

    from scalestudy.calibrate import gpucheck

    world = min(2, torch.cuda.device_count())
    overrides = [f"world_size={world}", f"zero_stage={zero}", "steps={warmup: 2, measure: 2, profile: 0}"]
    measured = gpucheck.run_trial(overrides, world)
    assert measured["status"] == "completed", measured.get("reason")
    row = gpucheck.memory_row(world, zero, overrides, measured)
    print("\n" + gpucheck.memory_table([row]))
    print({k: round(v, 2) for k, v in row["terms_gib"].items()})
    assert row["allocated_gib"] > 1.0  # a real measurement: TinyLlama's weights alone are 2 GiB
    assert not gpucheck.memory_failures([row])
