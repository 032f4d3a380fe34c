"""Build a randomly initialised Hugging Face causal LM from catalogue dimensions (no downloads)."""

from __future__ import annotations

import torch

from scalestudy.spec.catalog import ModelDims


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
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model
