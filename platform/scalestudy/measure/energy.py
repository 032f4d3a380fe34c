"""Energy meters for the timed window: one per node per trial, reading only the trial's devices.

Every rank of a node would read the same counters, so summing per-rank readings would multiply the
energy by the ranks per node. Only the node's meter owner (``NodeDevices.is_owner``: the lowest rank
of the trial on that machine, see ``measure.devices``) starts a real meter; the others use ``NoMeter``
and contribute zero energy to the cross-node sum.

Meters (``node_energy_meter(gpu, node)``; ``make_meter`` is the older per-local-rank entry point):
* ``NvmlMeter``: the trial's GPUs on this node, looked up by UUID (CUDA_VISIBLE_DEVICES renumbers
  devices, NVML does not). NVML's total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``,
  millijoules since driver load, Volta and newer) differenced per GPU; GPUs without the counter fall
  back to ``nvmlDeviceGetPowerUsage`` (milliwatts) sampled in a background thread and integrated with
  the trapezoid rule. GPU boards only: CPUs, host memory, NICs, fans and PSU losses are not in it.
* ``RaplMeter``: Intel/AMD RAPL under ``/sys/class/powercap``: every package domain (``intel-rapl:N``)
  and its dram subdomain, ``energy_uj`` differenced, adding ``max_energy_range_uj`` once when the
  counter wrapped (a window shorter than one wrap period, ~minutes at full load, is assumed). RAPL
  meters whole packages: other processes on the machine are in it.
* ``NoMeter``: energy NaN with the reason; ``source = "none"``.

Excluding intervals: every meter has ``start()``, ``stop() -> EnergyReading`` and, in between,
``pause()`` / ``resume()`` or ``with meter.excluded(): ...`` around work that is not part of the
measured steps (checkpoint saves). Excluded time is cut out of the window (energy, duration and so
power), never the token count: the timed steps' tokens are all inside the remaining window. The
reading says what was cut (``excluded_s``, ``excluded_intervals``).

Reading: ``EnergyReading(energy_j, duration_s, power_w_per_device, source, reason, ...)``; ``energy_j``
is the sum over the metered devices; ``power_w`` is the mean power per device over the active window.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from scalestudy import metrics as M
from scalestudy.measure.devices import NodeDevices, load_nvml, nvml_handles
from scalestudy.measure.pausable import Pausable
from scalestudy.measure.rapl import (  # noqa: F401  RaplDomain, counter_delta: re-exported
    POWERCAP_ROOT, RaplDomain, counter_delta, rapl_domains,
)

NAN = float("nan")
# What each source's energy covers; the body records it beside the figure.
SCOPE = {"nvml": "GPU boards of the trial's devices only (no CPU, host memory, network, cooling)",
         "rapl": "CPU packages and their DRAM of the whole machine",
         "none": "not measured"}


def is_meter_owner(local_rank: int) -> bool:
    """Older rule (one trial per node, local rank 0 meters it); ``NodeDevices.is_owner`` supersedes it."""
    return local_rank == 0


@dataclass
class EnergyReading:
    energy_j: float
    duration_s: float  # active window: excluded intervals are not in it
    power_w_per_device: dict[str, float] = field(default_factory=dict)
    source: str = "none"
    reason: str | None = None
    excluded_s: float = 0.0  # time cut out of the window (pause/resume)
    excluded_intervals: int = 0

    @property
    def power_w(self) -> float:
        """Mean power per device over the window (NaN without a measurement)."""
        vals = list(self.power_w_per_device.values())
        return sum(vals) / len(vals) if vals else NAN

    @property
    def scope(self) -> str:
        return SCOPE.get(self.source, self.source)


class WindowedMeter(Pausable):
    """start / pause / resume / stop bookkeeping; subclasses read their counters in ``_open`` (a
    segment of the window begins) and ``_close`` (it ends, adding its joules to ``self._joules``)."""

    source = "none"

    def __init__(self) -> None:
        self._joules: dict[str, float] = {}
        self._active_s = self._excluded_s = 0.0
        self._intervals = 0
        self._seg_t0 = NAN
        self._paused_at: float | None = None

    def _open(self) -> None:
        pass

    def _close(self) -> None:
        pass

    def start(self) -> None:
        self._joules, self._active_s, self._excluded_s, self._intervals = {}, 0.0, 0.0, 0
        self._paused_at = None
        self._open()
        self._seg_t0 = time.perf_counter()

    def pause(self) -> None:
        if self._paused_at is not None:
            raise RuntimeError("meter already paused")
        self._close()
        self._paused_at = time.perf_counter()
        self._active_s += self._paused_at - self._seg_t0

    def resume(self) -> None:
        if self._paused_at is None:
            raise RuntimeError("meter is not paused")
        self._open()
        self._seg_t0 = time.perf_counter()
        self._excluded_s += self._seg_t0 - self._paused_at
        self._intervals += 1
        self._paused_at = None

    def _finish(self) -> float:
        """Close the last segment; returns the active duration."""
        if self._paused_at is None:
            self._close()
            self._active_s += time.perf_counter() - self._seg_t0
        else:  # stopped while paused: the tail is excluded
            self._excluded_s += time.perf_counter() - self._paused_at
            self._intervals += 1
            self._paused_at = None
        return self._active_s

    def _reading(self, dt: float, per_device: dict[str, float], reason: str | None = None) -> EnergyReading:
        power = {n: j / dt for n, j in per_device.items()} if dt > 0 else {}
        return EnergyReading(sum(per_device.values()), dt, power, self.source, reason,
                             self._excluded_s, self._intervals)


class NoMeter(WindowedMeter):
    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def stop(self) -> EnergyReading:
        dt = self._finish()
        return EnergyReading(NAN, dt, {}, "none", self.reason, self._excluded_s, self._intervals)


# --- RAPL -------------------------------------------------------------------------------------------


class RaplMeter(WindowedMeter):
    source = "rapl"

    def __init__(self, root: str = POWERCAP_ROOT) -> None:
        super().__init__()
        self.domains = rapl_domains(root)
        if not self.domains:
            raise RuntimeError(f"no readable RAPL package domain under {root}")
        for d in self.domains:
            d.read_uj()  # energy_uj is root-only on many kernels: fail here, not at stop()
        self._start: dict[str, int] = {}

    def _open(self) -> None:
        self._start = {d.name: d.read_uj() for d in self.domains}

    def _close(self) -> None:
        for d in self.domains:
            j = counter_delta(self._start[d.name], d.read_uj(), d.max_range_uj) * 1e-6
            self._joules[d.name] = self._joules.get(d.name, 0.0) + j

    def stop(self) -> EnergyReading:
        dt = self._finish()
        # "Device" = CPU package; its dram domain's energy is added to the package's.
        per_pkg: dict[str, float] = {}
        for name, j in self._joules.items():
            pkg = name.split("/")[0]
            per_pkg[pkg] = per_pkg.get(pkg, 0.0) + j
        return self._reading(dt, per_pkg)


# --- NVML -------------------------------------------------------------------------------------------


class NvmlMeter(WindowedMeter):
    """Per-GPU energy from NVML for the given devices; ``nvml`` is the ``pynvml`` module (from
    nvidia-ml-py) or a stand-in with the same functions, which is how the unit tests drive it.

    ``device_uuids``: the trial's GPUs on this node (NVML spelling, see measure.devices); devices are
    then named by UUID. ``device_indices`` (NVML numbering) and neither (every GPU of the machine) are
    kept for callers that do not know their devices; names are then "gpu<i>"."""

    source = "nvml"

    def __init__(self, nvml: Any = None, device_indices: list[int] | None = None,
                 sample_interval_s: float = 0.05, device_uuids: list[str] | None = None) -> None:
        super().__init__()
        self.nvml = nvml = load_nvml(nvml)
        if device_uuids is not None:
            self.handles = nvml_handles(nvml, device_uuids)
        else:
            indices = list(range(nvml.nvmlDeviceGetCount())) if device_indices is None else device_indices
            self.handles = {f"gpu{i}": nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        if not self.handles:
            raise RuntimeError("no GPU to meter")
        self.has_counter = {name: self._counter_mj(h) is not None for name, h in self.handles.items()}
        self.sample_interval_s = sample_interval_s
        self._start_mj: dict[str, int] = {}
        self._segment: dict[str, list[tuple[float, float]]] = {}  # sampled devices, current segment
        self._lock = threading.Lock()
        self._sampling = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _counter_mj(self, handle: Any) -> int | None:
        try:
            return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        except Exception:  # noqa: BLE001  NVMLError_NotSupported on pre-Volta GPUs
            return None

    def _sampled(self) -> list[str]:
        return sorted(n for n, ok in self.has_counter.items() if not ok)

    def _take_sample(self) -> None:
        t = time.perf_counter()
        for name in self._segment:
            self._segment[name].append((t, self.nvml.nvmlDeviceGetPowerUsage(self.handles[name]) * 1e-3))

    def _sample(self) -> None:
        while not self._stop.wait(self.sample_interval_s):
            with self._lock:
                if self._sampling:
                    self._take_sample()

    def _open(self) -> None:
        self._start_mj = {n: self._counter_mj(h) for n, h in self.handles.items() if self.has_counter[n]}
        with self._lock:
            self._segment = {n: [] for n in self._sampled()}
            self._take_sample()  # at the segment's edges in this thread, so the integral spans it all
            self._sampling = True

    def _close(self) -> None:
        for n, h in self.handles.items():
            if self.has_counter[n]:
                j = (self._counter_mj(h) - self._start_mj[n]) * 1e-3
                self._joules[n] = self._joules.get(n, 0.0) + j
        with self._lock:
            self._take_sample()
            self._sampling = False
            for n, samples in self._segment.items():
                self._joules[n] = self._joules.get(n, 0.0) + integrate_power_j(samples)

    def start(self) -> None:
        super().start()
        if self._sampled():
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="nvml-power", daemon=True)
            self._thread.start()

    def stop(self) -> EnergyReading:
        dt = self._finish()
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        sampled = self._sampled()
        reason = f"sampled power on {', '.join(sampled)} (no energy counter)" if sampled else None
        return self._reading(dt, dict(self._joules), reason)


def integrate_power_j(samples: list[tuple[float, float]]) -> float:
    """Trapezoid integral of (time_s, power_w) samples; NaN with fewer than two samples."""
    if len(samples) < 2:
        return NAN
    return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(samples, samples[1:]))


# --- choice -----------------------------------------------------------------------------------------


def make_meter(source: str = "auto", *, local_rank: int = 0, nvml: Any = None,
               powercap_root: str = POWERCAP_ROOT, device_uuids: list[str] | None = None,
               owner: bool | None = None):
    """A startable meter of an energy source: "nvml", "rapl", "none" or "auto" (NVML, then RAPL).
    Ranks that do not own their node's meter get a NoMeter whatever the source; ``owner``
    overrides the older local-rank-0 rule. ``device_uuids`` limits NVML to those GPUs (without it
    NVML meters every GPU of the machine: use ``node_energy_meter``)."""
    owner = is_meter_owner(local_rank) if owner is None else owner
    if not owner:
        return NoMeter(f"local rank {local_rank} is not its node's meter owner")
    if source == "none":
        return NoMeter("energy metering disabled")
    reasons = []
    if source in ("nvml", "auto"):
        try:
            return NvmlMeter(nvml, device_uuids=device_uuids)
        except Exception as e:  # noqa: BLE001  no driver, no GPU, no library: all mean "no NVML"
            reasons.append(f"NVML unavailable ({type(e).__name__}: {e})")
    if source in ("rapl", "auto"):
        try:
            return RaplMeter(powercap_root)
        except Exception as e:  # noqa: BLE001
            reasons.append(f"RAPL unavailable ({type(e).__name__}: {e})")
    if not reasons:
        raise ValueError(f"unknown energy source {source!r}; use nvml, rapl, auto or none")
    return NoMeter("; ".join(reasons))


def node_energy_meter(gpu: bool, node: NodeDevices, *, nvml: Any = None,
                      powercap_root: str = POWERCAP_ROOT):
    """The meter this rank runs for its node: on the node's owner the real one, NVML over the
    trial's GPUs on the node (by UUID) for a GPU trial (``gpu``: HardwareProfile.is_gpu), RAPL for
    a CPU one; a NoMeter elsewhere."""
    if not node.is_owner:
        return NoMeter(f"rank {node.rank} is not its node's meter owner (rank {node.owner_rank} is)")
    if not gpu:
        return make_meter("rapl", powercap_root=powercap_root, owner=True)
    if not node.uuids:
        return NoMeter("no CUDA device on this node's ranks")
    return make_meter("nvml", nvml=nvml, device_uuids=node.uuids, owner=True)


def energy_metrics(reading: EnergyReading, tokens: float) -> dict[str, float]:
    """energy_j, power_w (per device), energy_per_token_j and tokens_per_j for ``tokens`` processed
    in the window (NaN-propagating)."""
    e = reading.energy_j
    ok = math.isfinite(e) and e > 0 and tokens > 0
    return {
        M.ENERGY_J: e,
        M.POWER_W: reading.power_w,
        M.ENERGY_PER_TOKEN_J: e / tokens if ok else NAN,
        M.TOKENS_PER_J: tokens / e if ok else NAN,
    }


def reduce_energy_across_ranks(reading: EnergyReading, local_rank: int = 0, device: Any = "cpu", *,
                               owner: bool | None = None) -> EnergyReading:
    """Whole-job reading, on every rank (collective call). Energy is summed over meter owners only
    (one per node; ``owner`` is ``NodeDevices.is_owner``, else the local-rank-0 rule); power per device
    = total energy / window / metered devices. One owner without a measurement makes the total NaN: a
    partial sum would understate the job's energy. Duration and excluded time are maxima over ranks."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return reading
    owner = is_meter_owner(local_rank) if owner is None else owner
    measured = owner and math.isfinite(reading.energy_j)
    vals = torch.tensor([reading.energy_j if measured else 0.0,
                         float(len(reading.power_w_per_device)) if measured else 0.0,
                         1.0 if owner and not measured else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(vals, op=dist.ReduceOp.SUM)
    # Non-owners report "none"; the max over ranks is the owners' source (one kind per job).
    src = torch.tensor([reading.duration_s, float(_SOURCES.index(reading.source)), reading.excluded_s,
                        float(reading.excluded_intervals)], dtype=torch.float64, device=device)
    dist.all_reduce(src, op=dist.ReduceOp.MAX)
    energy, n_dev, n_missing = vals.cpu().tolist()
    duration, source_i, excluded_s, intervals = src.cpu().tolist()
    source = _SOURCES[int(source_i)]
    if n_missing > 0 or n_dev == 0:
        why = f"{int(n_missing)} of the nodes' meters had no measurement"
        if owner and not measured:
            why = reading.reason or why  # this node's own reason is the informative one
        return EnergyReading(NAN, duration, {}, "none", why, excluded_s, int(intervals))
    per_device = energy / duration / n_dev if duration > 0 else NAN
    return EnergyReading(energy, duration, {"mean": per_device}, source, reading.reason, excluded_s,
                         int(intervals))


_SOURCES = ("none", "rapl", "nvml")
