"""Peak memory of a training process: the CUDA caching allocator and NVML on GPU, peak RSS on CPU.

Three GPU figures, because only the last two predict an out-of-memory error:
* allocated (``torch.cuda.max_memory_allocated``): bytes in live tensors at the peak;
* reserved (``torch.cuda.max_memory_reserved``): bytes the caching allocator held from the driver at
  its peak, allocated plus cached blocks and fragmentation: what an allocation fails against;
* device used (NVML ``nvmlDeviceGetMemoryInfo(h).used`` of this rank's device, found by UUID): all
  memory in use on the device when read: the reserved pool plus the CUDA context, cuBLAS workspaces,
  NCCL buffers, and any other process on the same GPU. NVML keeps no peak: it is read once, after the
  timed window, when the allocator still holds its pool (it never returns memory unless asked to).

API: ``reset_peak(device)`` before the timed window; ``memory_reading(device) -> MemoryReading`` after it
(per rank; the body takes the max over ranks). ``peak_memory_gib()`` is the older single figure.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

GIB = 1024**3
NAN = float("nan")


def reset_peak(device: Any = None) -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def reset_process_peak() -> bool:
    """Restart the process's RSS high-water mark at its current RSS (Linux: /proc/self/clear_refs),
    so a trial in a process that ran others (a warm worker) reports its own peak; False where the
    kernel does not allow it, and the peak stays the process's since start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _vm_hwm_kib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def peak_rss_gib() -> float:
    """The whole process's high-water mark (Python, libraries and the model together), which is
    what bounds a CPU trial: since the process started, or since reset_process_peak (Linux's
    VmHWM, which getrusage's ru_maxrss never resets)."""
    hwm = _vm_hwm_kib()
    if hwm is not None:
        return hwm * 1024 / GIB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return rss * scale / GIB


def peak_memory_gib() -> tuple[float, str]:
    """(peak GiB, source): allocated bytes on GPU, peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / GIB, "cuda_allocator"
    return peak_rss_gib(), "process_peak_rss"


@dataclass
class MemoryReading:
    allocated_gib: float  # GPU: peak allocated; CPU: peak RSS
    reserved_gib: float = NAN
    device_used_gib: float = NAN
    source: str = "process_peak_rss"
    missing: dict[str, str] = field(default_factory=dict)  # metric name -> why it is NaN

    def as_list(self) -> list[float]:
        return [self.allocated_gib, self.reserved_gib, self.device_used_gib]


def nvml_used_gib(device: Any, nvml: Any = None) -> float:
    """NVML's used memory of a CUDA device, looked up by UUID (CUDA_VISIBLE_DEVICES-proof)."""
    from scalestudy.measure.devices import cuda_device_uuid, load_nvml, nvml_handles

    uuid = cuda_device_uuid(device)
    if uuid is None:
        raise ValueError(f"{device} is not a CUDA device")
    nvml = load_nvml(nvml)
    return nvml.nvmlDeviceGetMemoryInfo(nvml_handles(nvml, [uuid])[uuid]).used / GIB


def memory_reading(device: Any = None, nvml: Any = None) -> MemoryReading:
    """This rank's figures (see the module docstring); NaN with a reason for what cannot be read."""
    from scalestudy import metrics as M

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        why = "CPU trial: no CUDA caching allocator"
        return MemoryReading(peak_rss_gib(), source="process_peak_rss",
                             missing={M.PEAK_MEMORY_RESERVED_GIB: why,
                                      M.DEVICE_MEMORY_USED_GIB: "CPU trial: no NVML device"})
    out = MemoryReading(torch.cuda.max_memory_allocated(dev) / GIB,
                        torch.cuda.max_memory_reserved(dev) / GIB, source="cuda_allocator")
    try:
        out.device_used_gib = nvml_used_gib(dev, nvml)
    except Exception as e:  # noqa: BLE001  no NVML library or driver access: say so, keep the rest
        out.missing[M.DEVICE_MEMORY_USED_GIB] = f"NVML unavailable ({type(e).__name__}: {e})"
    return out


def reduce_memory_across_ranks(reading: MemoryReading, device: Any = "cpu") -> MemoryReading:
    """Max over ranks of each figure (collective): the fullest device decides whether a trial fits.
    A figure any rank could not read is NaN (a max over the others could understate it); the reasons
    are this rank's."""
    import math

    import torch.distributed as dist

    if not dist.is_initialized():
        return reading
    vals = reading.as_list()
    t = torch.tensor([v if math.isfinite(v) else -math.inf for v in vals], dtype=torch.float64,
                     device=device)
    # MAX of a NaN is backend-defined (gloo and NCCL differ), so missing values travel as a count.
    nan = torch.tensor([0.0 if math.isfinite(v) else 1.0 for v in vals], dtype=torch.float64,
                       device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(nan, op=dist.ReduceOp.SUM)
    a, r, u = (NAN if k else v for v, k in zip(t.cpu().tolist(), nan.cpu().tolist()))
    return MemoryReading(a, r, u, reading.source, dict(reading.missing))
