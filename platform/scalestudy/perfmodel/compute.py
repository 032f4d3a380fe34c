"""Compute time of one micro-batch on one device (one tp rank of the slowest pipeline stage).

Algorithm (per transformer block, after the tensor-parallel split):
  * GEMMs: the block's matmuls with their real shapes, M = micro_batch * seq_len tokens, N or K
    divided by tp (Megatron column/row split). Each takes the larger of its compute time at
    peak * gemm_efficiency and its memory time (operands and result through HBM: the roofline), plus
    a fixed per-op cost. A profile with a measured GEMM curve (`gemm_tflops_<precision>`: pairs of
    [FLOPs of one GEMM, TFLOP/s], from `scalestudy calibrate`) replaces the compute term by the curve,
    interpolated in log space, so small shapes run at the rate measured for small shapes.
  * Attention scores (QK^T and AV): fused causal attention computes only the lower triangle, so the
    work is half of the 4*s*s*h/tp FLOPs per layer that MFU counts; it runs at gemm_efficiency *
    attention_efficiency. The fused backward recomputes QK^T: 5 matmuls against 2 in forward (2.5x).
    Unfused attention (params.fused_attention False) runs the full 4*s*s*h/tp FLOPs as batched GEMMs
    and moves the b*a*s*s/tp score tensor through HBM: SCORE_PASSES in forward (GEMM output, softmax
    read+write, dropout read+write+mask, read by the AV GEMM), twice that in backward.
  * Memory-bound ops (norms, rotary embedding, residual adds, the SwiGLU/GeLU product): bytes read and
    written / (HBM bandwidth * hbm_efficiency). Eager PyTorch runs each op as its own kernel, so every
    op reads and writes its whole tensor: the pass counts below follow HF Llama's eager code.
  * Backward = 2x the forward GEMMs (input and weight gradients have the forward's shapes) and 2x the
    memory-bound traffic. Full activation checkpointing runs the forward once more before backward.
  * LM head (T x h x V/tp GEMM) and the fp32 cross-entropy on the logits run on the last stage, which
    is therefore the slowest one and sets the pipeline's pace.
  * Optimizer: Adam streams every local fp32 state once per step (read master, m, v, grad; write them
    and the 16-bit copy): ~36 bytes per parameter held, memory-bound.
Assumptions: no kernel fusion beyond attention; dropout off (Llama); GEMMs do not overlap each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scalestudy.perfmodel.memory import params_per_device
from scalestudy.perfmodel.params import ModelParams
from scalestudy.spec.catalog import HardwareProfile, ModelDims, Precision
from scalestudy.spec.study import TrialConfig

# Framework ops per transformer block in forward besides the GEMMs (HF Llama eager decoder layer:
# 2 RMSNorms of ~6 ops, rotary ~10, reshapes/transposes ~8, residual adds 2, SiLU and product 2).
# Backward launches about twice as many. Only matters where per-op cost is large (CPU, tiny models).
ELEMENTWISE_OPS_PER_LAYER = 34
SCORE_PASSES = 7  # see the module doc (unfused attention)
HEAD_OPS = 12  # final norm, LM head, fp32 upcast, log-softmax, NLL, mean
ADAM_BYTES_PER_PARAM = {Precision.fp32: 28.0, Precision.bf16: 36.0, Precision.fp16: 36.0}


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds on one device; per micro-batch except optimizer_s (per optimizer step)."""

    forward_s: float
    backward_s: float
    recompute_s: float
    optimizer_s: float
    stage_layers: int

    @property
    def micro_batch_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s


def _curve_rate(curve: list[list[float]], flops: float) -> float:
    """Measured FLOP/s for a GEMM of `flops`, log-log interpolation, clamped at the ends."""
    xs = [math.log(c[0]) for c in curve]
    x = math.log(flops)
    if x <= xs[0]:
        return curve[0][1] * 1e12
    if x >= xs[-1]:
        return curve[-1][1] * 1e12
    for i in range(1, len(xs)):
        if x <= xs[i]:
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            ly = (1 - w) * math.log(curve[i - 1][1]) + w * math.log(curve[i][1])
            return math.exp(ly) * 1e12
    return curve[-1][1] * 1e12


class _Device:
    """Rates of one device at one precision, resolved once per prediction."""

    def __init__(self, hw: HardwareProfile, precision: Precision, p: ModelParams):
        self.peak = hw.peak_flops(precision) * p.gemm_efficiency
        self.hbm = hw.hbm_gbps * 1e9 * p.hbm_efficiency
        self.bytes = precision.bytes
        self.op = p.op_overhead_s
        self.attn = self.peak * p.attention_efficiency
        curve = hw.calibration.get(f"gemm_tflops_{precision.value}")
        self.curve = sorted(curve) if isinstance(curve, list) and curve else None
        if self.curve:
            # The measured curve already includes what efficiency factors stand for.
            best = max(c[1] for c in self.curve) * 1e12
            self.attn = best * p.attention_efficiency

    def gemm(self, m: float, k: float, n: float) -> float:
        flops = 2.0 * m * k * n
        rate = _curve_rate(self.curve, flops) if self.curve else self.peak
        mem = (m * k + k * n + m * n) * self.bytes / self.hbm
        return max(flops / rate, mem) + self.op

    def stream(self, elements: float, ops: int) -> float:
        return elements * self.bytes / self.hbm + ops * self.op


def _layer_gemms(d: _Device, dims: ModelDims, tokens: float, tp: int) -> float:
    h, f = dims.hidden_size, dims.ffn
    kv = dims.kv_heads * dims.head_dim
    t = d.gemm(tokens, h, h / tp) + 2 * d.gemm(tokens, h, kv / tp)  # q, k, v projections
    t += d.gemm(tokens, h / tp, h)  # output projection (row-parallel)
    if dims.architecture == "llama":
        t += 2 * d.gemm(tokens, h, f / tp) + d.gemm(tokens, f / tp, h)  # gate, up, down
    else:
        t += d.gemm(tokens, h, f / tp) + d.gemm(tokens, f / tp, h)  # fc1, fc2
    return t


# Element passes (one read or write of one element, 16-bit equivalents) per token per block in forward:
#   RMSNorm x2, replicated across tp: fp32 upcast, square, mean, rsqrt-scale, downcast, weight
#     multiply ~ 18 passes of h each (fp32 counts double);
#   residual adds x2: 3 passes of h each (two reads, one write);
#   rotary on q and k (split across tp): multiply, rotate (slice, negate, concatenate), multiply, add
#     ~ 9 passes each; head transposes/copies of q, k, v and the attention output: 2 passes each;
#   SwiGLU product (split across tp): SiLU (read, write) and multiply (two reads, one write) of f.
#   (GPT: LayerNorm ~ the same passes, bias + GeLU on 4h instead of the SwiGLU product.)
NORM_PASSES, RESIDUAL_PASSES, ROTARY_PASSES, COPY_PASSES, GATE_PASSES = 18, 3, 9, 2, 5


def _layer_stream(d: _Device, dims: ModelDims, tokens: float, tp: int) -> float:
    """Norms, residuals (replicated across tp), rotary/copies/activation product (split across tp)."""
    h, f = dims.hidden_size, dims.ffn
    kv = dims.kv_heads * dims.head_dim
    rotary = ROTARY_PASSES * (h + kv) if dims.architecture == "llama" else 0  # GPT: learned positions
    split = rotary + COPY_PASSES * (2 * h + 2 * kv) + GATE_PASSES * f
    elements = tokens * (2 * NORM_PASSES * h + 2 * RESIDUAL_PASSES * h + split / tp)
    return d.stream(elements, ELEMENTWISE_OPS_PER_LAYER)


def compute_times(cfg: TrialConfig, p: ModelParams) -> ComputeTimes:
    dims, tp = cfg.model_dims, cfg.tp
    d = _Device(cfg.hardware_profile, cfg.precision, p)
    s, tokens = cfg.seq_len, float(cfg.seq_len * cfg.micro_batch)
    layers = dims.num_layers // cfg.pp

    gemm_f = _layer_gemms(d, dims, tokens, tp)
    stream_f = _layer_stream(d, dims, tokens, tp)
    if p.fused_attention:
        causal_flops = 0.5 * 4.0 * tokens * s * dims.hidden_size / tp
        attn_f = causal_flops / d.attn + 2 * d.op
    else:
        full_flops = 4.0 * tokens * s * dims.hidden_size / tp
        scores = tokens * s * dims.num_heads / tp
        attn_f = full_flops / d.peak + d.stream(scores * SCORE_PASSES, 6)
    head_f = d.gemm(tokens, dims.hidden_size, dims.vocab_size / tp)
    head_f += d.stream(tokens * dims.vocab_size / tp * 4 * 3 / d.bytes, HEAD_OPS)  # fp32 loss

    fwd = layers * (gemm_f + stream_f + attn_f) + head_f
    attn_b = (2.5 if p.fused_attention else 2.0) * attn_f
    bwd = layers * (2 * gemm_f + 2 * stream_f + attn_b) + 2 * head_f
    recompute = layers * (gemm_f + stream_f + attn_f) if cfg.activation_checkpointing else 0.0

    if min(cfg.world_size, cfg.hardware_profile.gpus_per_node) > 1 and p.shared_node_slowdown > 1:
        k = p.shared_node_slowdown  # every device of the node busy at once (see params.py)
        fwd, bwd, recompute = fwd * k, bwd * k, recompute * k
    held = params_per_device(dims, tp, cfg.pp) / (cfg.dp if cfg.zero_stage >= 1 else 1)
    optimizer = held * ADAM_BYTES_PER_PARAM[cfg.precision] / d.hbm + p.step_overhead_s
    return ComputeTimes(fwd, bwd, recompute, optimizer, layers)
