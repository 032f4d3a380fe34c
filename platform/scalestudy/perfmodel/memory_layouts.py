"""Activation memory of the layouts published runs use (issue 35): sequence and context parallelism,
selective recomputation, FP8 GEMM inputs and the interleaved pipeline's extra micro-batches in
flight, uneven first/last stages included. memory.py (the one memory rule) takes its activation
term from here for a trial that sets any of them (memory._published_layout):

    acts = memory_layouts.activation_bytes(cfg, fused_attention)

and keeps its own measured terms for this platform's default layouts.

Per transformer layer and micro-batch, 16-bit activations (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", Table 2; s sequence, b micro-batch, h hidden,
a heads, t tensor-parallel degree):
    no recomputation              s*b*h*(10 + 24/t + 5*a*s/(h*t))
    sequence parallelism          s*b*h*(34/t + 5*a*s/(h*t))      (norm/dropout regions sharded)
    selective recomputation       drops 5*a*s/(h*t), the attention core's scores, softmax and mask
    full recomputation            2*s*b*h per layer kept (2*s*b*h/t with sequence parallelism), plus
                                  one layer's activations while it is recomputed
A fused attention kernel never stores the scores (memory.py), so selective recomputation on top of
it saves nothing more. Context parallelism (cp) splits the sequence: s -> s/cp everywhere (the
score term's keys stay whole per chunk pair, but flash keeps none of them). FP8 (Transformer Engine)
saves each GEMM's input for the backward as its FP8 copy: the QKV and fc1 inputs (2*s*b*h each,
/t with sequence parallelism), the attention projection's (2*s*b*h/t) and fc2's (8*s*b*h/t) at one
byte instead of two. Pipelines: the first stage holds min(pp, m) micro-batches of its layers under
1F1B; the interleaved schedule with v chunks per rank holds 1 + (pp - 1)/(pp * v) times as much
(Korthikanti et al. 2022, Sec. 4.2.3), counted over the first rank's layers (uneven stages: the
layers its chunks actually hold).
"""

from __future__ import annotations

from scalestudy.spec.study import TrialConfig
from scalestudy.spec.trial import RecomputeGranularity


def _coefficient(cfg: TrialConfig, fused_attention: bool) -> float:
    """Bytes per s*b*h of one layer's stored activations at 16 bits (module doc), FP8 included."""
    dims, t = cfg.model_dims, cfg.tp
    s = cfg.seq_len / cfg.cp
    scores = 0.0 if fused_attention else 5.0 * dims.num_heads * s / (dims.hidden_size * t)
    selective = (cfg.activation_checkpointing
                 and cfg.recompute_granularity is RecomputeGranularity.selective)
    if selective:
        scores = 0.0
    coeff = (34.0 / t if cfg.sequence_parallel else 10.0 + 24.0 / t) + scores
    if getattr(cfg, "fp8", False):  # GEMM inputs kept as FP8 copies: half their bytes
        replicated = 1.0 / t if cfg.sequence_parallel else 1.0
        coeff -= 0.5 * (4.0 * replicated + 10.0 / t)
    return coeff


def _first_rank_layers(cfg: TrialConfig) -> int:
    """Blocks the first pipeline rank holds (all its chunks; uneven stages as the spec sets them)."""
    layers = cfg.model_dims.num_layers
    if cfg.pp == 1:
        return layers
    counts = getattr(cfg, "stage_layers", None)
    try:
        chunks = list(counts) if counts is not None else None
    except Exception:  # noqa: BLE001 - a config the spec check would refuse: even split
        chunks = None
    if not chunks:
        return layers // cfg.pp
    return sum(chunks[0::cfg.pp])


def _in_flight(cfg: TrialConfig) -> float:
    """Micro-batches' worth of the first rank's layers alive at once (module doc)."""
    if cfg.pp == 1:
        return 1.0
    v = max(1, int(getattr(cfg, "virtual_stages", 1) or 1))
    base = float(min(cfg.pp, cfg.grad_accum))
    if v == 1:
        return base
    return min(float(cfg.grad_accum), base * (1.0 + (cfg.pp - 1) / (cfg.pp * v)))


def activation_bytes(cfg: TrialConfig, fused_attention: bool = True) -> float:
    """Per-device activation bytes of the first pipeline rank (the fullest), logits included."""
    dims = cfg.model_dims
    s, b, h = cfg.seq_len / cfg.cp, cfg.micro_batch, dims.hidden_size
    unit = s * b * h * cfg.precision.bytes / 2.0  # s*b*h at this precision's width, in bytes / 2
    per_layer = _coefficient(cfg, fused_attention) * unit
    layers = _first_rank_layers(cfg) * _in_flight(cfg)
    if cfg.activation_checkpointing and not (
            cfg.recompute_granularity is RecomputeGranularity.selective):
        kept = 2.0 * unit / (cfg.tp if cfg.sequence_parallel else 1)
        body = layers * kept + per_layer
    else:
        body = layers * per_layer
    logits = s * b * dims.vocab_size / cfg.tp * (cfg.precision.bytes + 4)
    return body + logits
