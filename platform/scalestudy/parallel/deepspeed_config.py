"""DeepSpeed config for a trial: ZeRO stage, precision, batch layout, tensor parallelism."""

from __future__ import annotations

from typing import Any

from scalestudy.spec.catalog import Precision
from scalestudy.spec.study import TrialConfig


def deepspeed_config(cfg: TrialConfig) -> dict[str, Any]:
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
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
    if cfg.precision is Precision.bf16:
        ds["bf16"] = {"enabled": True}
    elif cfg.precision is Precision.fp16:
        ds["fp16"] = {"enabled": True, "initial_scale_power": 16}
    if cfg.tp > 1:
        ds["tensor_parallel"] = {"autotp_size": cfg.tp}
    else:
        # DeepSpeed checks this against micro x accumulation x its data-parallel size; under AutoTP
        # its config check counts the whole world as data parallel, so it is only set without TP.
        ds["train_batch_size"] = cfg.global_batch
    return ds
