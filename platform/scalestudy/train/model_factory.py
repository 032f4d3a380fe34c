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
    from transformers import GPT2Config

    # Dropout off: throughput runs need no regularisation, and it would make losses layout-dependent.
    return GPT2Config(
        n_embd=dims.hidden_size,
        n_layer=dims.num_layers,
        n_head=dims.num_heads,
        n_inner=dims.ffn,
        n_positions=dims.max_seq_len,
        vocab_size=dims.vocab_size,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def build_model(dims: ModelDims, seed: int, activation_checkpointing: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(dims))
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model
