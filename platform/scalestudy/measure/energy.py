"""Energy meters for the timed window: one per node, never one per rank.

Every rank of a node would read the same counters, so summing per-rank readings would multiply the
energy by the ranks per node. Only the node's meter owner (``is_meter_owner(local_rank)``: local rank 0)
starts a real meter; the others use ``NoMeter`` and contribute zero energy to the cross-node sum.

Meters (``make_meter(kind)``):
* ``NvmlMeter``: NVML's total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``, millijoules
  since driver load, Volta and newer) read at start and stop per GPU and differenced. GPUs without the
  counter fall back to ``nvmlDeviceGetPowerUsage`` (milliwatts) sampled in a background thread and
  integrated with the trapezoid rule.
* ``RaplMeter``: Intel/AMD RAPL under ``/sys/class/powercap``: every package domain (``intel-rapl:N``)
  and its dram subdomain, ``energy_uj`` differenced, adding ``max_energy_range_uj`` once when the
  counter wrapped (a window shorter than one wrap period, ~minutes at full load, is assumed).
* ``NoMeter``: energy NaN with the reason; ``source = "none"``.

Reading: ``EnergyReading(energy_j, duration_s, power_w_per_device, source, reason)``; ``energy_j`` is the
sum over the node's devices; ``power_w`` is the mean power per device.
"""

from __future__ import annotations

import glob
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

NAN = float("nan")
POWERCAP_ROOT = "/sys/class/powercap"


def is_meter_owner(local_rank: int) -> bool:
    """Whether this rank meters its node (exactly one rank per node does)."""
    return local_rank == 0


@dataclass
class EnergyReading:
    energy_j: float
    duration_s: float
    power_w_per_device: dict[str, float] = field(default_factory=dict)
    source: str = "none"
    reason: str | None = None

    @property
    def power_w(self) -> float:
        """Mean power per device over the window (NaN without a measurement)."""
        vals = list(self.power_w_per_device.values())
        return sum(vals) / len(vals) if vals else NAN


class NoMeter:
    source = "none"

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self._t0 = NAN

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> EnergyReading:
        return EnergyReading(NAN, time.perf_counter() - self._t0, {}, "none", self.reason)


# --- RAPL -------------------------------------------------------------------------------------------


def counter_delta(start: int, end: int, max_range: int) -> int:
    """Difference of a wrapping counter that runs 0..max_range (inclusive), assuming <= one wrap."""
    return end - start if end >= start else end + max_range + 1 - start


@dataclass
class RaplDomain:
    name: str  # e.g. "package-0", "package-0/dram"
    path: str
    max_range_uj: int

    def read_uj(self) -> int:
        with open(os.path.join(self.path, "energy_uj")) as f:
            return int(f.read())


def rapl_domains(root: str = POWERCAP_ROOT) -> list[RaplDomain]:
    """Package domains and their dram subdomains. Core/uncore subdomains are inside the package and
    psys (platform) overlaps it, so they are skipped to avoid counting energy twice."""
    out = []
    for pkg in sorted(glob.glob(os.path.join(root, "intel-rapl:[0-9]*"))):
        if os.path.basename(pkg).count(":") != 1:
            continue  # subdomain listed at top level as a symlink
        name = _read(pkg, "name")
        if name is None or not name.startswith("package"):
            continue
        out.append(RaplDomain(name, pkg, int(_read(pkg, "max_energy_range_uj") or 0)))
        for sub in sorted(glob.glob(os.path.join(pkg, os.path.basename(pkg) + ":*"))):
            if _read(sub, "name") == "dram":
                out.append(RaplDomain(f"{name}/dram", sub, int(_read(sub, "max_energy_range_uj") or 0)))
    return out


def _read(path: str, leaf: str) -> str | None:
    try:
        with open(os.path.join(path, leaf)) as f:
            return f.read().strip()
    except OSError:
        return None


class RaplMeter:
    source = "rapl"

    def __init__(self, root: str = POWERCAP_ROOT) -> None:
        self.domains = rapl_domains(root)
        if not self.domains:
            raise RuntimeError(f"no readable RAPL package domain under {root}")
        for d in self.domains:
            d.read_uj()  # energy_uj is root-only on many kernels: fail here, not at stop()
        self._start: dict[str, int] = {}
        self._t0 = NAN

    def start(self) -> None:
        self._start = {d.name: d.read_uj() for d in self.domains}
        self._t0 = time.perf_counter()

    def stop(self) -> EnergyReading:
        end = {d.name: d.read_uj() for d in self.domains}
        dt = time.perf_counter() - self._t0
        joules = {d.name: counter_delta(self._start[d.name], end[d.name], d.max_range_uj) * 1e-6
                  for d in self.domains}
        # "Device" = CPU package; its dram domain's energy is added to the package's power.
        per_pkg: dict[str, float] = {}
        for name, j in joules.items():
            pkg = name.split("/")[0]
            per_pkg[pkg] = per_pkg.get(pkg, 0.0) + j
        power = {pkg: j / dt for pkg, j in per_pkg.items()} if dt > 0 else {}
        return EnergyReading(sum(joules.values()), dt, power, "rapl", None)


# --- NVML -------------------------------------------------------------------------------------------


class NvmlMeter:
    """Per-GPU energy from NVML; ``nvml`` is the ``pynvml`` module (from nvidia-ml-py) or a stand-in
    with the same functions, which is how the unit tests drive it without a GPU."""

    source = "nvml"

    def __init__(self, nvml: Any = None, device_indices: list[int] | None = None,
                 sample_interval_s: float = 0.05) -> None:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py
        self.nvml = nvml
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
        indices = list(range(count)) if device_indices is None else device_indices
        if not indices:
            raise RuntimeError("NVML sees no GPU")
        self.handles = {f"gpu{i}": nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        self.has_counter = {name: self._counter_mj(h) is not None for name, h in self.handles.items()}
        self.sample_interval_s = sample_interval_s
        self._start_mj: dict[str, int] = {}
        self._samples: dict[str, list[tuple[float, float]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = NAN

    def _counter_mj(self, handle: Any) -> int | None:
        try:
            return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        except Exception:  # noqa: BLE001  NVMLError_NotSupported on pre-Volta GPUs
            return None

    def _take_sample(self) -> None:
        t = time.perf_counter()
        for name in self._samples:
            self._samples[name].append((t, self.nvml.nvmlDeviceGetPowerUsage(self.handles[name]) * 1e-3))

    def _sample(self) -> None:
        while not self._stop.wait(self.sample_interval_s):
            self._take_sample()

    def start(self) -> None:
        self._samples = {n: [] for n, ok in self.has_counter.items() if not ok}
        self._start_mj = {n: self._counter_mj(h) for n, h in self.handles.items() if self.has_counter[n]}
        self._t0 = time.perf_counter()
        if self._samples:
            self._take_sample()  # at the window's edges in this thread, so the integral spans it all
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="nvml-power", daemon=True)
            self._thread.start()

    def stop(self) -> EnergyReading:
        end_mj = {n: self._counter_mj(h) for n, h in self.handles.items() if self.has_counter[n]}
        dt = time.perf_counter() - self._t0
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._take_sample()
        joules = {n: (end_mj[n] - self._start_mj[n]) * 1e-3 for n in end_mj}
        for name, samples in self._samples.items():
            joules[name] = integrate_power_j(samples)
        power = {n: j / dt for n, j in joules.items()} if dt > 0 else {}
        sampled = sorted(self._samples)
        reason = f"sampled power on {', '.join(sampled)} (no energy counter)" if sampled else None
        return EnergyReading(sum(joules.values()), dt, power, "nvml", reason)


def integrate_power_j(samples: list[tuple[float, float]]) -> float:
    """Trapezoid integral of (time_s, power_w) samples; NaN with fewer than two samples."""
    if len(samples) < 2:
        return NAN
    return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(samples, samples[1:]))


# --- choice -----------------------------------------------------------------------------------------


def make_meter(kind: str = "auto", *, local_rank: int = 0, nvml: Any = None,
               powercap_root: str = POWERCAP_ROOT):
    """A started-able meter: ``kind`` is "gpu" (NVML), "cpu" (RAPL), "none" or "auto" (NVML, then
    RAPL). Ranks that do not own their node's meter get a NoMeter whatever the kind."""
    if not is_meter_owner(local_rank):
        return NoMeter(f"local rank {local_rank} is not its node's meter owner")
    if kind == "none":
        return NoMeter("energy metering disabled")
    reasons = []
    if kind in ("gpu", "auto"):
        try:
            return NvmlMeter(nvml)
        except Exception as e:  # noqa: BLE001  no driver, no GPU, no library: all mean "no NVML"
            reasons.append(f"NVML unavailable ({type(e).__name__}: {e})")
    if kind in ("cpu", "auto"):
        try:
            return RaplMeter(powercap_root)
        except Exception as e:  # noqa: BLE001
            reasons.append(f"RAPL unavailable ({type(e).__name__}: {e})")
    if not reasons:
        raise ValueError(f"unknown meter kind {kind!r}; use gpu, cpu, auto or none")
    return NoMeter("; ".join(reasons))


def energy_metrics(reading: EnergyReading, tokens: float) -> dict[str, float]:
    """energy_per_token_j and tokens_per_j for ``tokens`` processed in the window (NaN-propagating)."""
    e = reading.energy_j
    ok = math.isfinite(e) and e > 0 and tokens > 0
    return {
        "energy_j": e,
        "power_w": reading.power_w,
        "energy_per_token_j": e / tokens if ok else NAN,
        "tokens_per_j": tokens / e if ok else NAN,
    }


def reduce_energy_across_ranks(reading: EnergyReading, local_rank: int, device: Any = "cpu") -> EnergyReading:
    """Whole-job reading, on every rank (collective call). Energy is summed over meter owners only
    (one per node); power per device = total energy / window / metered devices. One owner without a
    measurement makes the total NaN: a partial sum would understate the job's energy."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return reading
    owner = is_meter_owner(local_rank)
    measured = owner and math.isfinite(reading.energy_j)
    vals = torch.tensor([reading.energy_j if measured else 0.0,
                         float(len(reading.power_w_per_device)) if measured else 0.0,
                         1.0 if owner and not measured else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(vals, op=dist.ReduceOp.SUM)
    # Non-owners report "none"; the max over ranks is the owners' source (one kind per job).
    src = torch.tensor([reading.duration_s, float(_SOURCES.index(reading.source))],
                       dtype=torch.float64, device=device)
    dist.all_reduce(src, op=dist.ReduceOp.MAX)
    energy, n_dev, n_missing = vals.cpu().tolist()
    duration, source = src.cpu().tolist()[0], _SOURCES[int(src[1].item())]
    if n_missing > 0 or n_dev == 0:
        why = f"{int(n_missing)} of the nodes' meters had no measurement"
        if owner and not measured:
            why = reading.reason or why  # this node's own reason is the informative one
        return EnergyReading(NAN, duration, {}, "none", why)
    per_device = energy / duration / n_dev if duration > 0 else NAN
    return EnergyReading(energy, duration, {"mean": per_device}, source, reading.reason)


_SOURCES = ("none", "rapl", "nvml")
