"""Pipeline stages of a Hugging Face Llama: the model split by transformer blocks, as torchtitan does.

    chunks = build_stages(cfg, device, pp_rank, tp_mesh)   # this rank's stage modules, in order

The split (parallel/layout.py stage_layer_counts): pp * virtual_stages stages of consecutive blocks,
stage s on pipeline rank s % pp; the first stage also embeds the tokens, the last one runs the final
norm and the LM head (the loss is the schedule's, train/schedules.py), and either may take fewer
blocks than the others (first/last_stage_fewer_layers).

Each stage module keeps the full model's parameter names (``model.embed_tokens.weight``,
``model.layers.5.mlp.up_proj.weight``, ``lm_head.weight``): a stage's initial weights are the ones
the whole model would draw under the same seed (train/construct.py draws each from the seed and its
name), so any split trains the same model as pp = 1, and a checkpoint of any split names each tensor
as the unsplit model does.

A stage runs Hugging Face's own LlamaDecoderLayer. What LlamaModel.forward computes once for all
blocks, each stage computes again for its own: the positions and their rotary embeddings (the same
values: a function of the sequence length alone). The attention mask is None, so SDPA takes its
causal path (is_causal), as the unsplit model does for an unpadded batch.

Tensor parallelism inside a stage: torch's parallelize_module on the tp mesh (column-parallel q, k,
v, gate, up; row-parallel o and down, which all-reduce their output), Megatron's split of a block,
the same plan as Llama's ``base_model_tp_plan``. The embedding, norms and LM head stay replicated on
the tp ranks: their gradients are the same on every tp rank (their inputs are), so they need no
reduction. Why not DeepSpeed's AutoTP: it shards a whole Hugging Face model inside
deepspeed.initialize, and the stage modules train outside a DeepSpeed engine (train/schedules.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scalestudy.parallel.layout import stage_ranges
from scalestudy.train.construct import (init_weights, materialise, model_class,
                                        parameters_on_meta, training_dtype)
from scalestudy.train.model_factory import apply_recomputation, hf_config, selective_recompute

# Megatron's block split (and transformers' LlamaConfig.base_model_tp_plan).
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
           "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
           "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


class LlamaStage(nn.Module):
    """Blocks ``layer_ids`` of a LlamaForCausalLM, with the embedding when first and the final norm
    and LM head when last; parameters named as in the whole model (module docstring)."""

    def __init__(self, full: nn.Module, layer_ids: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.layer_ids = layer_ids
        body = full.model
        self.model = nn.Module()  # the same attribute path as LlamaForCausalLM: names match
        if first:
            self.model.embed_tokens = body.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): body.layers[i] for i in layer_ids})
        if last:
            self.model.norm = body.norm
            self.lm_head = full.lm_head
        self.model.rotary_emb = body.rotary_emb  # buffers only (inv_freq)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(x) if self.first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.model.rotary_emb(hidden, position_ids=positions)
        for layer in self.model.layers.values():
            hidden = layer(hidden, attention_mask=None, position_ids=positions,
                           position_embeddings=rotary)
        if self.last:
            hidden = self.lm_head(self.model.norm(hidden))
        return hidden


@dataclass
class StageChunk:
    """One stage this rank runs: its index among all stages and its module."""

    index: int
    module: LlamaStage


def stage_indices(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Stages of pipeline rank ``pp_rank`` (the loop placement torch's interleaved schedules use)."""
    return [pp_rank + k * pp for k in range(virtual_stages)]


def build_stages(cfg: Any, device: torch.device, pp_rank: int, tp_mesh: Any = None) -> list[StageChunk]:
    """This pipeline rank's stage modules (``cfg``: TrialConfig), initialised as the whole model
    would be and, with a tp mesh of more than one rank, tensor-parallel inside."""
    dims = cfg.model_dims
    if dims.architecture != "llama":
        raise ValueError(f"pipeline stages split Llama models only, not {dims.architecture}")
    config = hf_config(dims)
    torch.manual_seed(cfg.seed)
    with parameters_on_meta():  # nothing of the whole model is ever allocated
        full = model_class(dims)._from_config(config)
    apply_recomputation(full, cfg.activation_checkpointing, selective_recompute(cfg))
    ranges = stage_ranges(cfg.stage_layers)
    n_stages = len(ranges)
    std = float(getattr(config, "initializer_range", 0.02))
    chunks = []
    for s in stage_indices(pp_rank, cfg.pp, cfg.virtual_stages):
        stage = LlamaStage(full, ranges[s], first=s == 0, last=s == n_stages - 1)
        materialise(stage, device, training_dtype(cfg.precision))
        init_weights(stage, cfg.seed, std, zero3=False)
        if tp_mesh is not None and tp_mesh.size() > 1:
            shard_blocks(stage, tp_mesh)
        stage.train()
        chunks.append(StageChunk(s, stage))
    return chunks


def shard_blocks(stage: LlamaStage, tp_mesh: Any) -> None:
    """Megatron's split of every block of the stage over ``tp_mesh`` (module docstring)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[kind]() for name, kind in TP_PLAN.items()}
    for layer in stage.model.layers.values():
        parallelize_module(layer, tp_mesh, plan)


def local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's or gradient's local tensor: a tensor-parallel shard's own part, else itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def causal_lm_loss(vocab_size: int):
    """The loss of the last stage's logits against the micro-batch's token ids: Hugging Face's own
    ForCausalLMLoss (shifted labels, mean over tokens), so pp > 1 minimises what pp = 1 does. Pass
    it to the schedule unscaled: the schedule divides the gradients by the micro-batch count."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ForCausalLMLoss(logits, labels, vocab_size)

    return loss_fn
