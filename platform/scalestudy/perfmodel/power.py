"""Estimated power and energy of a trial (never a measurement: results carry them as *_estimated).
Modelled, not validated: no measured trial has yet been compared with these figures.

Algorithm: a device draws its idle power plus (TDP - idle) scaled by how busy it is. Computing counts
fully; time spent only communicating or waiting (exposed communication, pipeline bubble) counts as
comm_power_fraction (NCCL kernels keep a few SMs and the links busy, the rest idles). That is the
GPU's own power, what NVML reports for the device: `power_w_estimated` is GPU-only, so it compares
with measured NVML power like for like. The rest of each node (CPUs, NICs, switches' share, fans,
PSU loss: the profile's node_overhead_w) is a separate estimate, `node_overhead_power_w_estimated`,
shared by the devices of the node; facility energy = GPU energy + that.
Energy per step = GPU power * step time; per token = that / tokens per step (GPU-only likewise).
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
    power_w_per_device: float        # the GPU alone (what NVML measures)
    total_power_w: float             # all the trial's GPUs
    energy_per_step_j: float         # GPUs only
    energy_per_token_j: float
    tokens_per_j: float
    node_overhead_w_per_device: float  # the device's share of its node's non-GPU power


def estimate_power(cfg: TrialConfig, st: StepTime, p: ModelParams) -> PowerEstimate:
    hw = cfg.hardware_profile
    busy = min(1.0, st.compute_s / st.step_s) if st.step_s > 0 else 0.0
    waiting = max(0.0, 1.0 - busy)
    device = hw.idle_w + (hw.tdp_w - hw.idle_w) * (busy + p.comm_power_fraction * waiting)
    devices_per_node = min(cfg.world_size, hw.gpus_per_node)
    total = device * cfg.world_size
    energy_step = total * st.step_s
    per_token = energy_step / cfg.tokens_per_step
    return PowerEstimate(device, total, energy_step, per_token, 1.0 / per_token,
                         hw.node_overhead_w / devices_per_node)
