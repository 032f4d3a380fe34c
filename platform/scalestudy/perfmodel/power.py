"""Estimated power and energy of a trial (never a measurement: results carry them as *_estimated).

Algorithm: a device draws its idle power plus (TDP - idle) scaled by how busy it is. Computing counts
fully; time spent only communicating or waiting (exposed communication, pipeline bubble) counts as
comm_power_fraction (NCCL kernels keep a few SMs and the links busy, the rest idles). Each node adds
its fixed overhead (CPUs, NICs, switches' share, fans, PSU loss) from the hardware profile, shared by
the devices in it. Energy per step = total power * step time; per token = that / tokens per step.
Assumption: a device computing at any MFU draws close to TDP (large GEMMs are power-limited on
A100/H100), so power does not scale with MFU itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from scalestudy.perfmodel.overlap import StepTime
from scalestudy.perfmodel.params import ModelParams
from scalestudy.spec.study import TrialConfig


@dataclass(frozen=True)
class PowerEstimate:
    power_w_per_device: float  # including the device's share of its node's overhead
    total_power_w: float
    energy_per_step_j: float
    energy_per_token_j: float
    tokens_per_j: float


def estimate_power(cfg: TrialConfig, st: StepTime, p: ModelParams) -> PowerEstimate:
    hw = cfg.hardware_profile
    busy = min(1.0, st.compute_s / st.step_s) if st.step_s > 0 else 0.0
    waiting = max(0.0, 1.0 - busy)
    device = hw.idle_w + (hw.tdp_w - hw.idle_w) * (busy + p.comm_power_fraction * waiting)
    devices_per_node = min(cfg.world_size, hw.gpus_per_node)
    per_device = device + hw.node_overhead_w / devices_per_node
    total = per_device * cfg.world_size
    energy_step = total * st.step_s
    per_token = energy_step / cfg.tokens_per_step
    return PowerEstimate(per_device, total, energy_step, per_token, 1.0 / per_token)
