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
        # torch_adam: DeepSpeed's default FusedAdam JIT-compiles a kernel on first use (~50 s on CPU).
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": cfg.learning_rate, "weight_decay": 0.0, "torch_adam": True},
        },
        "zero_optimization": {"stage": cfg.zero_stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
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
