"""What a prediction leans on that its hardware profile did not calibrate (issue 34, item 0).

`scalestudy calibrate` measures some paths of the model and not others: one precision or both,
collectives at the world sizes it ran, the tp and pp reference steps only where it ran more than
one rank, GEMMs and attention tiles at the shapes it benchmarked. A prediction outside that falls
back to catalogue figures, defaults or extrapolation, and says so: predict() writes the list into
TrialResult.uncalibrated, which predict, plan and the report show. An empty list means every figure
the prediction used was calibrated; a catalogue profile (nothing calibrated) says that once.

Pure Python, like the rest of perfmodel/.
"""

from __future__ import annotations

import math

from scalestudy.spec.trial import TrialConfig

# A shape counts as benchmarked within this factor of the calibrated range (GEMM FLOPs) or of the
# nearest calibrated attention tile (each of sequence length and head dim): the model interpolates
# between benchmarked shapes and extrapolates this far at most before it says so.
SHAPE_FACTOR = 4.0
NOT_CALIBRATED = "profile not calibrated (scalestudy calibrate): catalogue figures"
# What only a calibration writes (calibrate/run.py, gpu.py): a profile with none of these is the
# catalogue's, whatever efficiencies it carries from published runs.
MEASURED_PREFIXES = ("gemm_tflops_", "reference_step_s_")


def uncalibrated(cfg: TrialConfig) -> list[str]:
    """One short line per figure the prediction of ``cfg`` takes from outside its calibration."""
    cal = cfg.hardware_profile.calibration or {}
    if not any(k.startswith(MEASURED_PREFIXES) for k in cal):
        return [NOT_CALIBRATED]  # the catalogue's figures (published efficiencies at most)
    prec = cfg.precision.value
    out = []
    curve = cal.get(f"gemm_tflops_{prec}")
    if not curve:
        out.append(f"{prec} not calibrated (no gemm_tflops_{prec}: the catalogue's peak)")
    else:
        out += _gemm_range(cfg, curve)
    if cfg.dp > 1 and not cal.get("busbw_gbps_all_reduce"):
        out.append("data-parallel collectives not calibrated (catalogue network figures)")
    if cfg.tp > 1 and "tp_collective_overhead_s" not in cal:
        out.append("tp path not calibrated (no tp reference step)")
    if cfg.pp > 1 and ("busbw_gbps_send_recv" not in cal or "pipeline_compute_factor" not in cal):
        out.append("pp path not calibrated (no send/recv curve or pipeline reference step)")
    rows = cal.get(f"attention_s_{prec}")
    if curve and rows:
        out += _attention_tile(cfg, rows)
    return out


def _gemm_range(cfg: TrialConfig, curve: list[list[float]]) -> list[str]:
    """The blocks' largest and smallest GEMMs against the benchmarked FLOPs."""
    d = cfg.model_dims
    tokens = cfg.micro_batch * cfg.seq_len / max(1, cfg.cp)
    sizes = (2 * tokens * d.hidden_size * d.hidden_size / cfg.tp,
             2 * tokens * d.hidden_size * d.ffn / cfg.tp)
    low, high = min(c[0] for c in curve), max(c[0] for c in curve)
    if min(sizes) < low / SHAPE_FACTOR or max(sizes) > high * SHAPE_FACTOR:
        return [f"GEMMs of {min(sizes):.2g}-{max(sizes):.2g} FLOPs outside the benchmarked "
                f"{low:.2g}-{high:.2g}"]
    return []


def _attention_tile(cfg: TrialConfig, rows: list[list[float]]) -> list[str]:
    """The attention tile (sequence, head dim) against the nearest benchmarked one."""
    seq, hd = cfg.seq_len / max(1, cfg.cp), cfg.model_dims.head_dim
    limit = math.log(SHAPE_FACTOR)
    if any(abs(math.log(seq / r[1])) <= limit and abs(math.log(hd / r[2])) <= limit for r in rows):
        return []
    return [f"attention tile (sequence {seq:g}, head dim {hd}) far from the benchmarked ones"]


def summary(lines_per_result: list[list[str]]) -> str | None:
    """One note for a table of predictions: how many lean on what, or None when none does."""
    counts: dict[str, int] = {}
    for lines in lines_per_result:
        for line in lines:
            counts[line] = counts.get(line, 0) + 1
    if not counts:
        return None
    n = sum(1 for lines in lines_per_result if lines)
    parts = "; ".join(f"{line} ({k})" for line, k in sorted(counts.items(), key=lambda kv: -kv[1]))
    return (f"{n} of {len(lines_per_result)} predictions lean on figures the profile did not "
            f"calibrate: {parts}")
