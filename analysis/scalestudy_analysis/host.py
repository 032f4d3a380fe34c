"""The hardware of the machine that writes a report: CPU model and cores, memory, and GPU model
and driver where NVML answers. Read from /proc and NVML (nvidia-ml-py), never from torch, so a
report on a laptop needs no accelerator stack; anything that cannot be read says why."""

from __future__ import annotations

import os
import platform as _stdlib_platform  # the stdlib module; our `platform/` dir is no package
from pathlib import Path

CPUINFO, MEMINFO = Path("/proc/cpuinfo"), Path("/proc/meminfo")


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """'AMD EPYC' (the model name /proc/cpuinfo and lscpu report), else what platform knows."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model Name", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return _stdlib_platform.processor() or _stdlib_platform.machine() or "unknown"


def memory_gib(meminfo: Path = MEMINFO) -> float | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20  # kB -> GiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpus(nvml=None) -> tuple[list[str], str | None, str]:
    """(GPU model names, driver version, why there are none): via NVML, shut down after."""
    if nvml is None:
        try:
            import pynvml as nvml  # nvidia-ml-py
        except ImportError:
            return [], None, "no GPU found (nvidia-ml-py not installed)"
    try:
        nvml.nvmlInit()
    except Exception as err:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [], None, f"no GPU (NVML: {str(err) or type(err).__name__})"
    try:
        names = [_text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i)))
                 for i in range(nvml.nvmlDeviceGetCount())]
        driver = _text(nvml.nvmlSystemGetDriverVersion())
    finally:
        nvml.nvmlShutdown()
    return names, driver, "" if names else "no GPU (NVML sees no device)"


def host_hardware(nvml=None) -> dict[str, str]:
    """Rows of the report's Hardware table."""
    out = {"cpu": cpu_model(), "logical cpus": str(os.cpu_count() or "unknown")}
    mem = memory_gib()
    out["memory"] = f"{mem:.1f} GiB" if mem is not None else "unknown"
    names, driver, why = gpus(nvml)
    if names:
        counts = {n: names.count(n) for n in dict.fromkeys(names)}
        out["gpu"] = ", ".join(f"{c} x {n}" for n, c in counts.items())
        out["gpu driver"] = driver or "unknown"
    else:
        out["gpu"] = why
    return out


__all__ = ["cpu_model", "gpus", "host_hardware", "memory_gib"]
