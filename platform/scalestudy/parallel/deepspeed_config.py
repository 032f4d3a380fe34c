"""DeepSpeed config for a trial: ZeRO stage, precision, batch layout, tensor parallelism."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scalestudy.parallel.layout import Layout

if TYPE_CHECKING:  # parallel/ sits below spec/: the trial is only an annotation here
    from scalestudy.spec.trial import TrialConfig


def deepspeed_config(cfg: TrialConfig, layout: Layout | None = None) -> dict[str, Any]:
    """The engine config of `cfg` at `layout` (default: the trial's own; an elastic attempt passes
    its resized one). The batch figures are the layout's."""
    lay = layout or cfg.layout
    precision = getattr(cfg.precision, "value", cfg.precision)
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": lay.micro_batch,
        "gradient_accumulation_steps": lay.grad_accum,
        "optimizer": optimizer_config(cfg),
        "zero_optimization": zero_config(cfg),
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        # No DeepSpeed timer in the timed window: the step times are ours (train/body.py), one device
        # sync at each step's edges. The engine's breakdown timers stay off, and so does its
        # throughput timer, which is on by default and synchronizes the device at every forward and
        # every optimizer step (deepspeed/utils/timer.py ThroughputTimer, DeepSpeed 0.19).
        "wall_clock_breakdown": False,
        "timers": THROUGHPUT_TIMER_OFF,
    }
    if precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif precision == "fp16":
        ds["fp16"] = {"enabled": True, "initial_scale_power": 16}
    if lay.tp > 1:
        ds["tensor_parallel"] = {"autotp_size": lay.tp}
    else:
        # DeepSpeed checks this against micro x accumulation x its data-parallel size; under AutoTP
        # its config check counts the whole world as data parallel, so it is only set without TP.
        ds["train_batch_size"] = lay.global_batch
    return ds


THROUGHPUT_TIMER_OFF = {"throughput": {"enabled": False, "synchronized": False}}

# DeepSpeed's own defaults for the bucket sizes, written out so that every trial records them and a
# change of DeepSpeed's defaults cannot change what a trial measured.
REDUCE_BUCKET_ELEMENTS = 500_000_000
ALLGATHER_BUCKET_ELEMENTS = 500_000_000
STAGE3_PREFETCH_BUCKET_ELEMENTS = 50_000_000
STAGE3_PARAM_PERSISTENCE_THRESHOLD = 100_000


def _on_gpu(cfg: TrialConfig) -> bool:
    return cfg.hardware_profile.is_gpu


def optimizer_config(cfg: TrialConfig) -> dict[str, Any]:
    """AdamW, its implementation chosen explicitly: torch's fused CUDA kernel on GPU (no JIT build,
    unlike DeepSpeed's FusedAdam), torch's plain one on CPU (DeepSpeed's FusedAdam would JIT-compile
    a CPU kernel on first use, ~50 s). DeepSpeed passes the remaining params to torch.optim.AdamW."""
    params: dict[str, Any] = {"lr": cfg.learning_rate, "weight_decay": 0.0, "torch_adam": True,
                              "fused": _on_gpu(cfg)}
    return {"type": "AdamW", "params": params}


def zero_config(cfg: TrialConfig) -> dict[str, Any]:
    """ZeRO settings that bias comparisons between stages, set explicitly (DeepSpeed turns
    overlap_comm on by default for stage 3 only, leaving ZeRO-1/2's gradient reduction exposed).
    On GPU every stage overlaps its communication with compute. On CPU DeepSpeed's defaults are
    written out unchanged (stage 3 overlaps, 1 and 2 do not): its CPU accelerator has no side
    streams and gloo runs on the compute cores, so there is nothing to overlap, and the CPU
    calibration and validation measured these settings. Stage 0 has no ZeRO communication."""
    z: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.zero_stage == 0:
        return z
    z.update({"overlap_comm": _on_gpu(cfg) or cfg.zero_stage == 3, "contiguous_gradients": True,
              "reduce_bucket_size": REDUCE_BUCKET_ELEMENTS})
    if cfg.zero_stage in (1, 2):
        z["allgather_bucket_size"] = ALLGATHER_BUCKET_ELEMENTS
    else:
        z["stage3_prefetch_bucket_size"] = STAGE3_PREFETCH_BUCKET_ELEMENTS
        z["stage3_param_persistence_threshold"] = STAGE3_PARAM_PERSISTENCE_THRESHOLD
    return z
