"""Build a randomly initialised Hugging Face causal LM from catalogue dimensions (no downloads)."""

from __future__ import annotations

from typing import Any

import torch

from scalestudy.spec.catalog import ModelDims
from scalestudy.spec.trial import RecomputeGranularity


def hf_config(dims: ModelDims):
    if dims.architecture == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=dims.hidden_size,
            intermediate_size=dims.ffn,
            num_hidden_layers=dims.num_layers,
            num_attention_heads=dims.num_heads,
            num_key_value_heads=dims.kv_heads,
            vocab_size=dims.vocab_size,
            max_position_embeddings=dims.max_seq_len,
            tie_word_embeddings=False,
        )
    from transformers import OPTConfig

    # The "gpt" blocks (learned positions, pre-LayerNorm, GeLU 4h MLP with biases, tied embeddings)
    # as Hugging Face's OPT implements them, not GPT2LMHeadModel: DeepSpeed's AutoTP refuses GPT-2 by
    # name (and its Conv1D layers), so a GPT-2 model could not run tp > 1. OPT keeps two position
    # rows more than max_seq_len (its offset); GPT-3's GeLU is the tanh form, gelu_new.
    # Dropout off: throughput runs need no regularisation, and it would make losses layout-dependent.
    return OPTConfig(
        hidden_size=dims.hidden_size,
        word_embed_proj_dim=dims.hidden_size,
        num_hidden_layers=dims.num_layers,
        num_attention_heads=dims.num_heads,
        ffn_dim=dims.ffn,
        max_position_embeddings=dims.max_seq_len,
        vocab_size=dims.vocab_size,
        do_layer_norm_before=True,
        activation_function="gelu_new",
        enable_bias=True,
        tie_word_embeddings=True,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        # No padding row (OPT's default is token 1): GPT-2 has none, and zeroing it at init indexes a
        # weight that zero.Init has already partitioned away.
        pad_token_id=None,
    )


def build_model(dims: ModelDims, seed: int, activation_checkpointing: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(dims))
    apply_recomputation(model, activation_checkpointing, selective=False)
    model.train()
    return model


# Selective recomputation (Korthikanti et al. 2022, Megatron's --recompute-granularity selective):
# only the attention core (softmax(QK^T/sqrt(d))V, what the model's SDPA call computes) is run
# again in the backward; the projections, norms and MLP keep their activations. Hugging Face
# models call their attention core through transformers' AttentionInterface, so the core is
# wrapped there, under a name of its own, in torch's non-reentrant checkpoint.
SELECTIVE_ATTENTION = "scalestudy_selective_sdpa"


def _register_selective_attention() -> None:
    from torch.utils.checkpoint import checkpoint
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if SELECTIVE_ATTENTION in AttentionInterface._global_mapping:
        return

    def recomputed(module, query, key, value, attention_mask, **kwargs):
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]  # looked up per call, as the model itself would

        def core(q, k, v, mask):
            return sdpa(module, q, k, v, mask, **kwargs)

        return checkpoint(core, query, key, value, attention_mask, use_reentrant=False)

    AttentionInterface.register(SELECTIVE_ATTENTION, recomputed)
    AttentionMaskInterface.register(SELECTIVE_ATTENTION, sdpa_mask)  # the masks SDPA takes


def selective_recompute(cfg: Any) -> bool:
    """Whether a trial (TrialConfig) recomputes the attention core only."""
    return cfg.recompute_granularity is RecomputeGranularity.selective


def apply_recomputation(model: torch.nn.Module, activation_checkpointing: bool,
                        selective: bool) -> None:
    """Full recomputation (every block's forward run again in the backward: Hugging Face's
    gradient checkpointing), selective (the attention core only), or none."""
    if not activation_checkpointing:
        return
    if not selective:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    if model.config._attn_implementation != "sdpa":
        raise ValueError("selective recomputation wraps the SDPA attention core; this model runs "
                         f"{model.config._attn_implementation!r} attention")
    _register_selective_attention()
    model.set_attn_implementation(SELECTIVE_ATTENTION)
