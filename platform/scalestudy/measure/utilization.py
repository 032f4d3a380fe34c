"""Device utilization over a window: process CPU time on CPU, NVML's utilization rate on GPU.

* ``CpuUtilization``: (user + system CPU seconds of this process, all its threads including gloo's)
  / wall seconds, from ``resource.getrusage(RUSAGE_SELF)``. 1.0 = one core fully busy; it can exceed 1
  with several threads. Children are not counted (a worker has none that compute).
* ``NvmlUtilization``: NVML's GPU utilization, the percentage of each sample period (1/6 s to 1 s, by
  product) during which at least one kernel was running: a busy-ness figure, not an occupancy or FLOP
  figure (MFU is that). Read so that it does not perturb the window it describes: the driver keeps
  its own samples in a buffer (``nvmlDeviceGetSamples``, type GPU utilization), read at the window's
  edges (start, stop, pause, resume: outside the timed steps) and, for a long window, drained every
  DRAIN_S by a thread that wakes that rarely; the mean is over every driver sample of the window.
  Where the driver keeps no buffer for the device (NVML answers NotSupported), a thread polls
  ``nvmlDeviceGetUtilizationRates`` every POLL_S (NVML's own period is at most 1 s, so a faster poll
  reads the same sample again) and once more at stop, so a window shorter than POLL_S has a figure.

Both: ``start()`` then ``stop() -> dict[str, float]`` (``{"cpu": fraction}`` or
``{uuid: percent, ...}``), and ``pause()`` / ``resume()`` or ``with u.excluded():`` to leave work that is
not a measured step (a checkpoint save) out of the figure, like the energy meter.

Which devices: ``node_utilization(gpu, node)`` gives the node's meter owner one NVML sampler over the
trial's GPUs on that node (by UUID, see ``measure.devices``) and the other ranks ``NoUtilization``; on
CPU every rank measures its own process (``CpuUtilization`` costs two getrusage calls, no thread).
``make_utilization(gpu, nvml=None)`` is the older entry point (every GPU of the machine).
"""

from __future__ import annotations

import resource
import threading
import time
from typing import Any

from scalestudy.measure.devices import NodeDevices, load_nvml, nvml_handles
from scalestudy.measure.pausable import Pausable

NAN = float("nan")
GPU_UTILIZATION_SAMPLES = 1  # pynvml.NVML_GPU_UTILIZATION_SAMPLES
NVML_ERROR_NOT_FOUND = 6  # nvmlDeviceGetSamples: no sample newer than the timestamp given
# The driver's buffer holds the last ~16-20 s of samples (nvidia-smi -q -d UTILIZATION, "Duration"):
# drained every 5 s, none is lost; one NVML call per GPU every 5 s does not perturb the steps.
DRAIN_S = 5.0
POLL_S = 1.0


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_utilization(cpu_s: float, wall_s: float) -> float:
    """CPU seconds per wall second (cores busy on average); NaN for an empty window."""
    return cpu_s / wall_s if wall_s > 0 else NAN


class NoUtilization(Pausable):
    """A rank that does not sample its node: contributes no device to the cross-rank mean."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def start(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def stop(self) -> dict[str, float]:
        return {}


class CpuUtilization(Pausable):
    def __init__(self) -> None:
        self._cpu0 = self._t0 = NAN
        self._cpu_s = self._wall_s = 0.0

    def start(self) -> None:
        self._cpu_s = self._wall_s = 0.0
        self.resume()

    def pause(self) -> None:
        self._cpu_s += cpu_seconds() - self._cpu0
        self._wall_s += time.perf_counter() - self._t0

    def resume(self) -> None:
        self._cpu0, self._t0 = cpu_seconds(), time.perf_counter()

    def stop(self) -> dict[str, float]:
        self.pause()
        return {"cpu": cpu_utilization(self._cpu_s, self._wall_s)}


class NvmlUtilization(Pausable):
    """Mean of NVML utilization samples per GPU (see the module docstring). ``nvml`` is pynvml or a
    stand-in for tests; ``device_uuids`` the GPUs to sample (else ``device_indices`` in NVML
    numbering, else all). ``buffered`` says whether the driver's sample buffer is read (else polled)."""

    def __init__(self, nvml: Any = None, device_indices: list[int] | None = None,
                 interval_s: float = POLL_S, device_uuids: list[str] | None = None,
                 drain_s: float = DRAIN_S) -> None:
        self.nvml = nvml = load_nvml(nvml)
        if device_uuids is not None:
            self.handles = nvml_handles(nvml, device_uuids)
        else:
            indices = list(range(nvml.nvmlDeviceGetCount())) if device_indices is None else device_indices
            self.handles = {f"gpu{i}": nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        self.buffered = all(self._has_buffer(h) for h in self.handles.values())
        self.interval_s = drain_s if self.buffered else interval_s
        self._samples: dict[str, list[float]] = {}
        self._seen: dict[str, int] = {}  # per GPU: the newest driver timestamp read (buffered)
        self._active = threading.Event()
        self._lock = threading.Lock()  # pause() waits for a round in progress: none straddles it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _buffer_since(self, handle: Any, seen: int) -> list[tuple[int, float]]:
        """The driver's samples newer than timestamp `seen`: (timestamp in us, percent)."""
        try:
            _, samples = self.nvml.nvmlDeviceGetSamples(handle, GPU_UTILIZATION_SAMPLES, seen)
        except Exception as e:  # noqa: BLE001  pynvml raises NVMLError subclasses carrying .value
            if getattr(e, "value", None) == NVML_ERROR_NOT_FOUND:
                return []
            raise
        return [(int(x.timeStamp), float(x.sampleValue.uiVal)) for x in samples if x.timeStamp > seen]

    def _has_buffer(self, handle: Any) -> bool:
        try:
            self._buffer_since(handle, 0)
            return True
        except Exception:  # noqa: BLE001  NotSupported, or a stand-in without the call: poll instead
            return False

    def _read(self, keep: bool) -> None:
        """Under the lock: one round; `keep` False reads the buffer only to move past its samples."""
        for name, h in self.handles.items():
            if not self.buffered:
                if keep:
                    self._samples[name].append(float(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu))
                continue
            new = self._buffer_since(h, self._seen.get(name, 0))
            if new:
                self._seen[name] = max(t for t, _ in new)
                if keep:
                    self._samples[name] += [v for _, v in new]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                if self._active.is_set():
                    self._read(keep=True)

    def start(self) -> None:
        self._samples = {n: [] for n in self.handles}
        with self._lock:
            if self.buffered:
                self._read(keep=False)  # what the driver holds from before the window
        self._stop.clear()
        self._active.set()
        self._thread = threading.Thread(target=self._run, name="nvml-util", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        with self._lock:
            if self.buffered and self._active.is_set():
                self._read(keep=True)  # the segment that ends here
            self._active.clear()

    def resume(self) -> None:
        with self._lock:
            if self.buffered:
                self._read(keep=False)  # the paused time's samples
            self._active.set()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self._active.is_set():
                self._read(keep=True)  # buffered: the window's tail; polled: its last period
            self._active.clear()
        return {n: sum(s) / len(s) if s else NAN for n, s in self._samples.items()}


def make_utilization(gpu: bool, nvml: Any = None, device_uuids: list[str] | None = None):
    """On a GPU profile NvmlUtilization (CpuUtilization if NVML is unavailable), else CpuUtilization."""
    if gpu:
        try:
            return NvmlUtilization(nvml, device_uuids=device_uuids)
        except Exception:  # noqa: BLE001  no NVML: report the process's CPU use rather than nothing
            return CpuUtilization()
    return CpuUtilization()


def node_utilization(gpu: bool, node: NodeDevices, nvml: Any = None):
    """This rank's sampler (see the module docstring). On GPU without NVML (or without a CUDA device
    on the node's ranks) the owner gets a NoUtilization whose reason says why: the figure is then NaN,
    not the CPU use of one process standing in for a GPU figure."""
    if not gpu:
        return CpuUtilization()
    if not node.is_owner:
        return NoUtilization(f"rank {node.rank} is not its node's sampler (rank {node.owner_rank} is)")
    if not node.uuids:
        return NoUtilization("no CUDA device on this node's ranks")
    try:
        return NvmlUtilization(nvml, device_uuids=node.uuids)
    except Exception as e:  # noqa: BLE001  no driver, no library, unknown UUID
        return NoUtilization(f"NVML unavailable ({type(e).__name__}: {e})")
