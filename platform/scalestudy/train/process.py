"""Setting up one trial process, the same under every adapter (Ray Train, torchrun): no Ray here."""

from __future__ import annotations

import os

from scalestudy.spec.trial import TrialConfig
from scalestudy.train.host_memory import retain_freed_memory


def prepare_process(cfg: TrialConfig) -> None:
    """Before DeepSpeed is imported: its CPU accelerator, and the allocator behaviour a GPU's
    caching allocator has (train/host_memory.py), for CPU trials; on GPU, that the node's driver
    runs torch's CUDA (train/cuda_driver.py: else the trial fails here with the fix)."""
    if cfg.hardware_profile.is_gpu:
        from scalestudy.train.cuda_driver import check_cuda_driver

        check_cuda_driver()
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        retain_freed_memory()


def device_for(cfg: TrialConfig, local_rank: int):
    import torch

    if cfg.hardware_profile.is_gpu:
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group(cfg: TrialConfig, local_rank: int):
    """deepspeed.comm over torch.distributed: reuses a process group the launcher already started
    (Ray Train), else starts one from the launcher's environment (torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR, ...). Returns this rank's device."""
    import deepspeed
    import torch

    from scalestudy.train import timing

    timing.mark("imported")  # torch and DeepSpeed: seconds in a fresh process, nothing in a warm one
    deepspeed.init_distributed(dist_backend=cfg.hardware_profile.process_group_backend)
    timing.mark("process_group")
    device = device_for(cfg, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # one core per worker: the cpu-local "device"
    return device


def sync(device) -> None:
    """Wait for the device (a no-op on CPU, where every op is synchronous)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
