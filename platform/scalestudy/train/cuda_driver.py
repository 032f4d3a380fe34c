"""Does this node's NVIDIA driver run the CUDA that torch was built with? Checked once at the start
of every GPU trial process (train/process.py), before the first kernel: a driver older than the
wheel's CUDA otherwise fails only there, with an error that names neither the driver nor the wheel.

The rule is the strict one: the driver's CUDA version (NVML's nvmlSystemGetCudaDriverVersion, as
nvidia-smi prints it) must be at least torch.version.cuda, major and minor. CUDA's minor-version
compatibility runs most of a newer 12.x runtime on an older 12.x driver, but not PTX compiled for
the newer one (Triton's kernels, DeepSpeed's JIT-built ops), so a measured trial refuses it too.
"""

from __future__ import annotations

from typing import Any

from scalestudy.measure.devices import load_nvml


class CudaDriverMismatch(RuntimeError):
    """The node cannot run this torch build's CUDA; the message is the one-line reason and fix."""


def cuda_of(text: str) -> tuple[int, int]:
    """'12.8' -> (12, 8)."""
    major, minor, *_ = (int(p) for p in text.split("."))
    return major, minor


def driver_cuda_of(nvml_value: int) -> tuple[int, int]:
    """NVML's encoding (1000 * major + 10 * minor: 12080) -> (12, 8)."""
    return nvml_value // 1000, (nvml_value % 1000) // 10


def driver_problem(torch_version: str, wheel_cuda: str | None, driver_cuda: int | None,
                   driver_version: str | None, nvml_error: str | None = None) -> str | None:
    """Why a GPU trial cannot run with this torch on this driver, with the fix; None when it can."""
    if wheel_cuda is None:
        return (f"cuda driver: torch {torch_version} is a CPU-only build (torch.version.cuda is None) on "
                "a GPU node; fix: install PyPI's Linux x86-64 torch wheel, the CUDA build "
                "(uv pip install -c cluster/constraints.txt torch, as the cluster's setup does)")
    need = cuda_of(wheel_cuda)
    if driver_cuda is None:
        return (f"cuda driver: NVML did not answer ({nvml_error}), so the driver cannot be checked "
                f"against torch {torch_version}'s CUDA {wheel_cuda}; fix: check the node's NVIDIA "
                "driver is loaded (nvidia-smi) and nvidia-ml-py is installed")
    have = driver_cuda_of(driver_cuda)
    if have >= need:
        return None
    return (f"cuda driver: this node's NVIDIA driver {driver_version} supports CUDA up to "
            f"{have[0]}.{have[1]}, older than the CUDA {wheel_cuda} torch {torch_version} was built "
            f"with; fix: boot the node from an image (AMI, VM image, container host) whose driver "
            f"supports CUDA >= {wheel_cuda}, or install torch {torch_version.split('+')[0]}'s build for "
            f"CUDA <= {have[0]}.{have[1]} from PyTorch's own wheel index")


def read_driver(nvml: Any = None) -> tuple[int | None, str | None, str | None]:
    """(NVML's CUDA driver version, the driver's version string, None), or (None, None, error)."""
    try:
        nvml = load_nvml(nvml)
        version = nvml.nvmlSystemGetDriverVersion()
        return int(nvml.nvmlSystemGetCudaDriverVersion()), str(version), None
    except Exception as e:  # noqa: BLE001  no library, no driver: the reason says which
        return None, None, f"{type(e).__name__}: {e}"


def check_cuda_driver(nvml: Any = None) -> None:
    """Raise CudaDriverMismatch (its message the reason and fix) when this GPU node cannot run
    torch's CUDA build; `nvml` is a stand-in for tests."""
    import torch

    problem = driver_problem(torch.__version__, torch.version.cuda, *read_driver(nvml))
    if problem:
        raise CudaDriverMismatch(problem)
