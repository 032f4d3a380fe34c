"""Throughput and utilization from the timed window's step times (pure: no torch)."""

from __future__ import annotations

import statistics

from scalestudy import metrics as M
from scalestudy.perfmodel.flops import hardware_flops_per_token, model_flops_per_token, utilization
from scalestudy.spec.study import TrialConfig


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def throughput_metrics(cfg: TrialConfig, step_times_s: list[float]) -> dict[str, float]:
    """tokens/s = global tokens per optimizer step / median step time; every device counts in the
    per-device figure (tp and pp ranks too), as in the paper's per-GPU throughput."""
    median = statistics.median(step_times_s)
    tokens_per_s = cfg.tokens_per_step / median
    per_device = tokens_per_s / cfg.world_size
    peak = cfg.hardware_profile.peak_flops(cfg.precision)
    mflops = model_flops_per_token(cfg.model_dims, cfg.seq_len)
    hflops = hardware_flops_per_token(cfg.model_dims, cfg.seq_len, cfg.activation_checkpointing)
    return {
        M.STEP_TIME_S: median,
        M.STEP_TIME_P90_S: percentile(step_times_s, 90),
        M.TOKENS_PER_S: tokens_per_s,
        M.TOKENS_PER_S_PER_DEVICE: per_device,
        M.MODEL_TFLOPS_PER_DEVICE: mflops * per_device / 1e12,
        M.MFU: utilization(mflops, per_device, peak),
        M.HFU: utilization(hflops, per_device, peak),
    }
