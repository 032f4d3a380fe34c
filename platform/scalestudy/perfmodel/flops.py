"""Model FLOPs per token: the one formula behind MFU, HFU and the compute model.

Counts multiply-adds as 2 FLOPs; training = forward (2 FLOPs per matmul parameter per token) +
backward (twice the forward), hence 6 per parameter. Only parameters that take part in a matmul
count: the token (and learned position) embeddings are table lookups, while the LM head is a real
GEMM even when tied to the embedding.
"""

from __future__ import annotations

from scalestudy.spec.catalog import ModelDims


def matmul_params(model: ModelDims) -> int:
    tied_head = model.vocab_size * model.hidden_size if model.lm_head_params() == 0 else 0
    return model.num_params() - model.embedding_params() + tied_head


def model_flops_per_token(model: ModelDims, seq_len: int) -> float:
    """6N for the weights + 12 * layers * hidden * seq_len for attention scores and values
    (QK^T and AV: 2 matmuls x 2 FLOPs x seq_len x hidden each in forward, x3 with backward; causal
    masking is not subtracted, following PaLM/torchtitan)."""
    return 6.0 * matmul_params(model) + 12.0 * model.num_layers * model.hidden_size * seq_len


def hardware_flops_per_token(model: ModelDims, seq_len: int, recompute: bool,
                             recompute_fraction: float = 1.0) -> float:
    """What the device executes: with full activation checkpointing the forward runs twice, so
    8N + 16*l*h*s instead of 6N + 12*l*h*s (a selective scheme reruns `recompute_fraction` of it).
    Attention counts the full s x s scores, as MFU does (PaLM): a causal kernel computes about half
    of them, so at long sequences this HFU can exceed what the kernels execute (see
    tests/validation/test_invariants.py, which holds the executed FLOPs to the GEMM rate)."""
    base = model_flops_per_token(model, seq_len)
    return base * (1.0 + recompute_fraction / 3.0) if recompute else base


def utilization(flops_per_token: float, tokens_per_s_per_device: float, peak_flops: float) -> float:
    """Fraction of the device's peak that the given FLOPs-per-token rate represents (MFU or HFU)."""
    return flops_per_token * tokens_per_s_per_device / peak_flops
