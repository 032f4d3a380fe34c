"""A trial's energy meter and utilization sampler together: one of each per node, on the trial's own
devices, started and stopped outside the timed loop's hot path.

How the trial body uses it (every rank runs the same calls)::

    node = gather_node_devices(device)                  # collective; before the timed window
    meters = TrialMeters(cfg.hardware_profile.is_gpu, node)
    ...warm-up steps...
    meters.start()                                      # once, just before the first timed step
    for step in timed_steps:
        ...one step (no meter call inside it)...
        if saving:
            with meters.excluded():                     # a checkpoint save is cut out of the window
                save()
    sync(device); meters.stop()                         # once, after the last timed step's sync
    result = meters.reduce(device)                      # collective; any time after stop()
                                                        # -> the trial summary (train/summary.py)

Only the node's owner (lowest rank on the machine) runs real meters; they sample in background threads
(power where the energy counter is missing, utilization always), so the training thread pays two
counter reads at start and stop and nothing per step. Energy covers the trial's GPU boards (NVML) or
the machine's CPU packages (RAPL); checkpoint saves are excluded from the window (not from the
tokens, since the timed steps' tokens are all inside what remains).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from scalestudy import metrics as M
from scalestudy.measure.devices import NodeDevices
from scalestudy.measure.energy import (
    NAN, EnergyReading, NoMeter, node_energy_meter, reduce_energy_across_ranks,
)
from scalestudy.measure.pausable import Pausable
from scalestudy.measure.rapl import POWERCAP_ROOT
from scalestudy.measure.utilization import node_utilization


@dataclass
class MeterResult:
    """Whole-trial figures, the same on every rank after ``TrialMeters.reduce``."""

    energy: EnergyReading
    utilization: float  # mean over the trial's GPUs (NVML %) or processes (CPU cores busy)
    utilization_metric: str  # M.DEVICE_UTILIZATION_PCT or M.CPU_UTILIZATION_CORES
    utilization_reason: str | None = None  # why utilization is NaN (nothing was sampled)
    devices_utilization: int = 0  # devices (GPU) or processes (CPU) in the mean


class TrialMeters(Pausable):
    """See the module docstring. ``gpu`` is HardwareProfile.is_gpu (NVML meters, GPU utilization;
    else RAPL and the processes' CPU use); ``energy=False`` leaves energy unmeasured (NaN, reason
    given) while utilization is still sampled."""

    def __init__(self, gpu: bool, node: NodeDevices, *, energy: bool = True, nvml: Any = None,
                 powercap_root: str = POWERCAP_ROOT, reason_off: str = "energy metering disabled") -> None:
        self.gpu = gpu
        self.node = node
        self.energy = (node_energy_meter(gpu, node, nvml=nvml, powercap_root=powercap_root) if energy
                       else NoMeter(reason_off))
        self.utilization = node_utilization(gpu, node, nvml=nvml)
        self._energy_reading: EnergyReading | None = None
        self._util: dict[str, float] = {}

    def start(self) -> None:
        self.energy.start()
        self.utilization.start()

    def pause(self) -> None:
        self.energy.pause()
        self.utilization.pause()

    def resume(self) -> None:
        self.energy.resume()
        self.utilization.resume()

    def stop(self) -> None:
        self._energy_reading = self.energy.stop()
        self._util = self.utilization.stop()

    def reduce(self, device: Any = "cpu") -> MeterResult:
        """Collective: every rank calls it after ``stop()`` and gets the same result."""
        if self._energy_reading is None:
            raise RuntimeError("TrialMeters.reduce before stop()")
        energy = reduce_energy_across_ranks(self._energy_reading, device=device, owner=self.node.is_owner)
        metric = M.DEVICE_UTILIZATION_PCT if self.gpu else M.CPU_UTILIZATION_CORES
        mean, n = _mean_over_devices(self._util, device)
        # Rank 0 owns its node, so its sampler's reason is the informative one where nothing was sampled.
        reason = None if n else (getattr(self.utilization, "reason", None) or "no device was sampled")
        return MeterResult(energy, mean, metric, reason, n)


def _mean_over_devices(values: dict[str, float], device: Any) -> tuple[float, int]:
    """Mean over every rank's finite per-device values, and how many there were (collective)."""
    import torch
    import torch.distributed as dist

    finite = [v for v in values.values() if math.isfinite(v)]
    if not dist.is_initialized():
        return (sum(finite) / len(finite), len(finite)) if finite else (NAN, 0)
    t = torch.tensor([sum(finite), float(len(finite))], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    total, n = t.cpu().tolist()
    return (total / n if n else NAN), int(n)
