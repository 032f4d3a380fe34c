"""The start-up check of every GPU trial process: the node's NVIDIA driver must run the CUDA that
torch was built with (train/cuda_driver.py). The decision is pure; the NVML reading is driven with a
stand-in; the call sits in prepare_process, which every adapter runs first."""

from __future__ import annotations

import pytest

from scalestudy.train import cuda_driver as cd
from tests.conftest import trial


class Nvml:
    def __init__(self, cuda: int = 12080, driver: str = "570.133.20", fail: bool = False):
        self.cuda, self.driver, self.fail = cuda, driver, fail

    def nvmlInit(self):
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlSystemGetCudaDriverVersion(self):
        return self.cuda

    def nvmlSystemGetDriverVersion(self):
        return self.driver


def test_versions_decode_as_nvidia_smi_prints_them():
    assert cd.driver_cuda_of(12080) == (12, 8) and cd.driver_cuda_of(13000) == (13, 0)
    assert cd.cuda_of("12.8") == (12, 8) and cd.cuda_of("12.10") == (12, 10)


@pytest.mark.parametrize("wheel,driver", [("12.8", 12080), ("12.6", 12080), ("12.8", 13000),
                                          ("12.4", 12100)])
def test_a_driver_at_or_past_the_wheels_cuda_passes(wheel, driver):
    assert cd.driver_problem("2.13.0", wheel, driver, "580.0") is None


def test_an_older_driver_fails_with_both_versions_and_the_fix():
    why = cd.driver_problem("2.13.0+cu128", "12.8", 12020, "535.104.05")
    assert why is not None and "\n" not in why
    assert "535.104.05" in why and "up to 12.2" in why and "CUDA 12.8" in why
    assert "fix:" in why and "CUDA >= 12.8" in why and "torch 2.13.0's build for CUDA <= 12.2" in why
    # a major behind (a CUDA 13 wheel on a 12.x driver) and a minor behind both fail
    assert cd.driver_problem("2.13.0", "13.0", 12090, "575.0") is not None
    assert cd.driver_problem("2.13.0", "12.10", 12090, "575.0") is not None  # 10 > 9, not "1" < "9"


def test_a_cpu_wheel_on_a_gpu_node_and_a_silent_nvml_fail():
    assert "CPU-only build" in cd.driver_problem("2.13.0+cpu", None, 12080, "570.0")
    why = cd.driver_problem("2.13.0", "12.8", None, None, "RuntimeError: no driver")
    assert "RuntimeError: no driver" in why and "nvidia-smi" in why


def test_reading_the_driver_through_nvml():
    assert cd.read_driver(Nvml(12080, "570.1")) == (12080, "570.1", None)
    cuda, version, error = cd.read_driver(Nvml(fail=True))
    assert cuda is None and version is None and "Shared Library Not Found" in error


def test_check_raises_the_reason_here(monkeypatch):
    """On this (CPU) machine torch has no CUDA: a GPU trial would stop at the check, before any
    kernel, with the reason as its failure (failure_reason takes the first line)."""
    import torch

    from scalestudy.train.result import failure_reason

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(cd.CudaDriverMismatch) as err:
        cd.check_cuda_driver(Nvml(cuda=12040, driver="550.54.15"))
    assert failure_reason(err.value).startswith("cuda driver: this node's NVIDIA driver 550.54.15")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    cd.check_cuda_driver(Nvml(cuda=12040))  # the same node, a wheel it runs


def test_every_gpu_trial_process_checks_at_start(monkeypatch):
    from scalestudy.train import process

    calls = []
    monkeypatch.setattr(cd, "check_cuda_driver", lambda: calls.append(1))
    monkeypatch.setattr(process, "retain_freed_memory", lambda: None)  # not in this test process
    process.prepare_process(trial(["hardware=h100-80gb", "world_size=1", "zero_stage=0", "micro_batch=1"]))
    assert calls == [1]
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    process.prepare_process(trial(["world_size=1", "zero_stage=0", "micro_batch=1"]))  # cpu-local: nothing to check
    assert calls == [1]
