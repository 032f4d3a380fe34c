"""Device utilization over a window: process CPU time on CPU, NVML's utilization rate on GPU.

* ``CpuUtilization``: (user + system CPU seconds of this process, all its threads including gloo's)
  / wall seconds, from ``resource.getrusage(RUSAGE_SELF)``. 1.0 = one core fully busy; it can exceed 1
  with several threads. Children are not counted (a worker has none that compute).
* ``NvmlUtilization``: ``nvmlDeviceGetUtilizationRates(h).gpu`` sampled in a background thread. NVML
  defines it as the percentage of the last sample period (1/6 s to 1 s, by product) during which at
  least one kernel was running: a busy-ness figure, not an occupancy or FLOP figure (MFU is that).

Both: ``start()`` then ``stop() -> dict[str, float]`` (``{"cpu": fraction}`` or
``{"gpu0": percent, ...}``); ``make_utilization(kind, nvml=None)`` picks.
"""

from __future__ import annotations

import resource
import threading
import time
from typing import Any

NAN = float("nan")


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_utilization(cpu_s: float, wall_s: float) -> float:
    """CPU seconds per wall second (cores busy on average); NaN for an empty window."""
    return cpu_s / wall_s if wall_s > 0 else NAN


class CpuUtilization:
    def __init__(self) -> None:
        self._cpu0 = self._t0 = NAN

    def start(self) -> None:
        self._cpu0, self._t0 = cpu_seconds(), time.perf_counter()

    def stop(self) -> dict[str, float]:
        return {"cpu": cpu_utilization(cpu_seconds() - self._cpu0, time.perf_counter() - self._t0)}


class NvmlUtilization:
    """Mean of NVML utilization samples per GPU. ``nvml`` is pynvml or a stand-in for tests."""

    def __init__(self, nvml: Any = None, device_indices: list[int] | None = None,
                 interval_s: float = 0.1) -> None:
        if nvml is None:
            import pynvml as nvml
        self.nvml = nvml
        nvml.nvmlInit()
        indices = list(range(nvml.nvmlDeviceGetCount())) if device_indices is None else device_indices
        self.handles = {f"gpu{i}": nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        self.interval_s = interval_s
        self._samples: dict[str, list[float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            for name, h in self.handles.items():
                self._samples[name].append(float(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu))
            if self._stop.wait(self.interval_s):
                break

    def start(self) -> None:
        self._samples = {n: [] for n in self.handles}
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nvml-util", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return {n: sum(s) / len(s) if s else NAN for n, s in self._samples.items()}


def make_utilization(kind: str, nvml: Any = None):
    """"gpu" -> NvmlUtilization (CpuUtilization if NVML is unavailable), "cpu" -> CpuUtilization."""
    if kind == "gpu":
        try:
            return NvmlUtilization(nvml)
        except Exception:  # noqa: BLE001  no NVML: report the process's CPU use rather than nothing
            return CpuUtilization()
    if kind == "cpu":
        return CpuUtilization()
    raise ValueError(f"unknown utilization kind {kind!r}; use gpu or cpu")
