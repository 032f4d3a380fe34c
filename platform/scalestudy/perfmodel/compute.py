"""Compute time of one micro-batch on one device (one tp rank of the slowest pipeline stage).

Algorithm (per transformer block, after the tensor-parallel split):
  * GEMMs: the block's matmuls with their real shapes, M = micro_batch * seq_len tokens, N or K
    divided by tp (Megatron column/row split). Each takes the larger of its compute time at
    peak * gemm_efficiency and its memory time (operands and result through HBM: the roofline). A
    profile with a measured GEMM curve (`gemm_tflops_<precision>`: pairs of [FLOPs of one GEMM,
    TFLOP/s], from `scalestudy calibrate`) replaces the compute term by the curve, interpolated in
    log space, so small shapes run at the rate measured for small shapes.
  * Attention scores (QK^T and AV), where the profile carries measured kernel times
    (`attention_s_<precision>` rows from `scalestudy calibrate`: [batch*heads, seq, head_dim, forward s,
    backward s]): the nearest measured shape (log distance over the three), scaled by the FLOPs ratio.
    Otherwise: fused causal attention computes only the lower triangle, so the work is half of the
    4*s*s*h/tp FLOPs per layer that MFU counts; it runs at gemm_efficiency * attention_efficiency.
    The fused backward recomputes QK^T: 5 matmuls against 2 in forward (2.5x).
    Unfused attention (params.fused_attention False) runs the full 4*s*s*h/tp FLOPs as batched GEMMs
    and moves the b*a*s*s/tp score tensor through HBM: SCORE_PASSES in forward (GEMM output, softmax
    read+write, dropout read+write+mask, read by the AV GEMM), twice that in backward.
  * Memory-bound ops (norms, rotary embedding, residual adds, the SwiGLU/GeLU product): bytes read and
    written / (HBM bandwidth * hbm_efficiency). Eager PyTorch runs each op as its own kernel, so every
    op reads and writes its whole tensor: the pass counts below follow HF Llama's eager code.
  * Backward = 2x the forward GEMMs (input and weight gradients have the forward's shapes) and 2x the
    memory-bound traffic. Full activation checkpointing runs the forward once more before backward
    (a selective scheme a share of it, params.recompute_fraction).
  * LM head (T x h x V/tp GEMM) and the fp32 cross-entropy on the logits run on the last stage, which
    is therefore the slowest one and sets the pipeline's pace. The loss is memory-bound (three fp32
    passes forward, twice that backward) unless the profile measured it (`cross_entropy_s_<precision>`
    rows [tokens, vocab, forward s, backward s]: nearest row, scaled by the logits ratio).
  * Framework cost: op_overhead_s per dispatched op, with the op counts below (GEMMs, attention and
    loss included), on top of the kernel times above.
  * ZeRO-3 hooks: zero3_module_overhead_s per module run, in forward and in backward.
  * Optimizer: Adam streams every local fp32 state once per step (read master, m, v, grad; write them
    and the 16-bit copy): ~36 bytes per parameter held, memory-bound; or the measured
    optimizer_s_per_param. Plus step_overhead_s.
  * The kernel and op sums above are times in_step_slowdown (a real step against its parts benchmarked
    alone; the ZeRO-3 and optimizer figures were measured in an engine step and are not), and all of
    forward and backward times shared_node_slowdown when every device of the node trains at once
    (params.py says what each stands for and how calibrate measures it).
Assumptions: no kernel fusion beyond attention; dropout off (Llama); GEMMs do not overlap each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scalestudy.perfmodel import layouts
from scalestudy.perfmodel.memory import params_per_device
from scalestudy.perfmodel.params import ModelParams, precision_ratio
from scalestudy.spec.catalog import HardwareProfile, ModelDims, Precision
from scalestudy.spec.study import TrialConfig

# Framework ops: every non-view aten op that HF Llama's eager code dispatches (counted with a
# TorchDispatchMode on transformers 5, GEMMs and attention included; views launch no kernel). Each costs
# op_overhead_s on top of its kernel time: dispatch, autograd bookkeeping, allocation and the Python
# around it. Per transformer block in forward and in backward, and outside the blocks (embedding,
# final norm, LM head, fp32 upcast, loss). Dominant only where per-op cost is large (CPU, tiny models).
FORWARD_OPS_PER_LAYER, BACKWARD_OPS_PER_LAYER = 47, 84
FORWARD_OPS_OUTSIDE, BACKWARD_OPS_OUTSIDE = 28, 26
SCORE_PASSES = 7  # see the module doc (unfused attention)
# Modules whose forward runs (ZeRO-3 hooks every one of them, with parameters or not), counted on the
# HF models: per Llama block the block, attention, q, k, v, o, MLP, gate, up, down, SiLU and two
# RMSNorms; outside them the causal LM, the model, embedding, rotary embedding, final norm and LM head.
# Per GPT block (HF's OPT classes, model_factory.py) the block, attention, q, k, v, out, GeLU, two
# LayerNorms, fc1 and fc2; outside them the causal LM, the model, the decoder, two embeddings
# (tokens, positions), final norm and LM head.
MODULES_PER_LAYER = {"llama": 13, "gpt": 11}
MODULES_OUTSIDE_LAYERS = {"llama": 6, "gpt": 7}
ADAM_BYTES_PER_PARAM = {Precision.fp32: 28.0, Precision.bf16: 36.0, Precision.fp16: 36.0}


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds on one device; per micro-batch except optimizer_s (per optimizer step).

    The per-block figures split forward/backward for the ZeRO-3 schedule (zero3.py): forward_s =
    stage_layers * block_forward_s + the rest (embedding, final norm, LM head, loss); likewise
    backward. flops and hbm_bytes are what the device executes and streams per micro-batch (causal
    fused attention counted as the half it computes), the floors the invariants hold the step to."""

    forward_s: float
    backward_s: float
    recompute_s: float
    optimizer_s: float
    stage_layers: int
    block_forward_s: float = 0.0
    block_backward_s: float = 0.0
    flops: float = 0.0
    hbm_bytes: float = 0.0
    optimizer_hbm_bytes: float = 0.0
    peak_rate: float = 0.0  # the fastest FLOP/s any kernel of this device reaches
    # The attention core's forward and backward over the stage's blocks (context parallelism hides
    # its ring's point-to-point steps behind them, layouts.py), and the blocks' GEMMs in forward
    # (what overlapped TP collectives hide behind).
    attention_forward_s: float = 0.0
    attention_backward_s: float = 0.0
    gemm_forward_s: float = 0.0

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


def _nearest_scaled(rows: list[list[float]], shape: tuple[float, ...], work,
                    batch_dims: int = 0) -> tuple[float, float]:
    """(forward, backward) seconds of the measured row nearest `shape` (log distance), scaled by the
    ratio of work(shape) to work(row). The first ``batch_dims`` dimensions count independent tiles
    (attention's batch x heads), whose time is linear in them: they do not choose the row, so a
    trial's micro-batch scales its time linearly instead of jumping to a row of another tile shape
    (the kernel's rate per unit of work is set by the tile, sequence x head dim: on a 2-core AMD
    EPYC the calibrated rows' rates differ 1.4x between head dims 16 and 32)."""
    def dist(r: list[float]) -> float:
        tile = sum(abs(math.log(x / y)) for x, y in zip(shape[batch_dims:], r[batch_dims:len(shape)]))
        return tile + 1e-3 * sum(abs(math.log(x / y)) for x, y in zip(shape[:batch_dims], r))

    row = min(rows, key=dist)
    k = work(*shape) / work(*row[:len(shape)])
    return row[-2] * k, row[-1] * k


class _Device:
    """Rates of one device at one precision, resolved once per prediction. Counts the FLOPs it is
    asked to execute and the bytes it streams through HBM (the floors of invariants)."""

    def __init__(self, hw: HardwareProfile, precision: Precision, p: ModelParams):
        self.peak = hw.peak_flops(precision) * p.gemm_efficiency
        self.hbm = hw.hbm_gbps * 1e9 * p.hbm_efficiency
        self.bytes = precision.bytes
        self.op = p.op_overhead_s
        self.attn = self.peak * p.attention_efficiency
        curve = hw.calibration.get(f"gemm_tflops_{precision.value}")
        self.curve = sorted(curve) if isinstance(curve, list) and curve else None
        self.attention_rows = _rows(hw, f"attention_s_{precision.value}")
        self.loss_rows = _rows(hw, f"cross_entropy_s_{precision.value}")
        self.best = self.peak
        if self.curve:
            # The measured curve already includes what efficiency factors stand for.
            self.best = max(self.peak, max(c[1] for c in self.curve) * 1e12)
            self.attn = max(c[1] for c in self.curve) * 1e12 * p.attention_efficiency
        self.flops = 0.0
        self.moved = 0.0
        self.fp8 = 0.0  # FP8 GEMM rate while the block's GEMMs run in FP8 (layouts.py), else 0

    def gemm(self, m: float, k: float, n: float) -> float:
        flops = 2.0 * m * k * n
        if self.fp8:  # FP8 operands (1 byte) after a cast of each from 16 bits (layouts.py)
            moved = (m * k + k * n) + m * n * self.bytes
            cast = (m * k + k * n) * layouts.FP8_CAST_BYTES
            self.flops += flops
            self.moved += moved + cast
            return max(flops / self.fp8, moved / self.hbm) + cast / self.hbm
        rate = _curve_rate(self.curve, flops) if self.curve else self.peak
        moved = (m * k + k * n + m * n) * self.bytes
        self.flops += flops
        self.moved += moved
        return max(flops / rate, moved / self.hbm)

    def stream(self, elements: float) -> float:
        self.moved += elements * self.bytes
        return elements * self.bytes / self.hbm

    def loss(self, tokens: float, vocab: float) -> tuple[float, float]:
        """(forward, backward) of the fp32 cross-entropy over tokens x vocab logits."""
        if self.loss_rows:
            return _nearest_scaled(self.loss_rows, (tokens, vocab), lambda t, v: t * v)
        fwd = self.stream(tokens * vocab * 4 * 3 / self.bytes)
        return fwd, 2 * fwd


def _rows(hw: HardwareProfile, key: str) -> list[list[float]] | None:
    rows = hw.calibration.get(key)
    return rows if isinstance(rows, list) and rows else None


def _layer_gemms(d: _Device, dims: ModelDims, tokens: float, tp: int) -> float:
    h, f = dims.hidden_size, dims.ffn
    kv = dims.kv_heads * dims.head_dim
    # One call per GEMM: each call also counts the FLOPs and bytes the invariants hold the step to.
    t = d.gemm(tokens, h, h / tp) + d.gemm(tokens, h, kv / tp) + d.gemm(tokens, h, kv / tp)  # q, k, v
    t += d.gemm(tokens, h / tp, h)  # output projection (row-parallel)
    if dims.architecture == "llama":
        t += d.gemm(tokens, h, f / tp) + d.gemm(tokens, h, f / tp) + d.gemm(tokens, f / tp, h)
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
# The same with fused kernels (params.fused_elementwise: Megatron-LM / Transformer Engine): a norm
# reads its input and writes its output once (fp32 math in registers), rotary reads and writes q
# and k once, the gated activation reads its two inputs and writes one.
FUSED_PASSES = (2, 3, 2, 2, 3)


def _layer_stream(d: _Device, dims: ModelDims, tokens: float, tp: int, sp: bool = False,
                  fused: bool = False) -> float:
    """Norms, residuals (replicated across tp; 1/tp each with sequence parallelism, layouts.py),
    rotary/copies/activation product (split across tp); fused kernels' pass counts when fused."""
    h, f = dims.hidden_size, dims.ffn
    kv = dims.kv_heads * dims.head_dim
    norm, residual, rope, copy, gate = FUSED_PASSES if fused else (
        NORM_PASSES, RESIDUAL_PASSES, ROTARY_PASSES, COPY_PASSES, GATE_PASSES)
    rotary = rope * (h + kv) if dims.architecture == "llama" else 0  # GPT: learned positions
    split = rotary + copy * (2 * h + 2 * kv) + gate * f
    replicated = (2 * norm * h + 2 * residual * h) / (tp if sp else 1)
    elements = tokens * (replicated + split / tp)
    return d.stream(elements)


def _attention(d: _Device, cfg: TrialConfig, p: ModelParams,
               tokens: float) -> tuple[float, float, float, float]:
    """(forward s, backward s, forward FLOPs executed, backward/forward FLOPs) of one block's
    attention scores and values (see the module doc)."""
    dims, tp, s = cfg.model_dims, cfg.tp, cfg.seq_len
    causal_flops = 0.5 * 4.0 * tokens * s * dims.hidden_size / tp
    if p.fused_attention and d.attention_rows:
        shape = (cfg.micro_batch * dims.num_heads / tp, s, dims.head_dim)
        fwd, bwd = _nearest_scaled(d.attention_rows, shape, lambda bh, q, hd: bh * q * q * hd,
                                   batch_dims=1)
        return fwd, bwd, causal_flops, 2.5
    if p.fused_attention:
        # The fused backward recomputes QK^T: 2.5x the forward. A fused kernel's fixed cost per tile
        # row amortises over the keys (FA2: 155 -> 189 TFLOP/s on A100 from 2k to 8k tokens); a
        # context-parallel rank runs it on chunks of s / cp keys.
        keys = s / cfg.cp
        rate = d.attn * keys / (keys + p.attention_half_seq)
        return causal_flops / rate, 2.5 * causal_flops / rate, causal_flops, 2.5
    full_flops = 2 * causal_flops
    scores = tokens * s * dims.num_heads / tp
    fwd = full_flops / d.peak + d.stream(scores * SCORE_PASSES)
    d.stream(scores * SCORE_PASSES)  # the backward's score traffic, counted for the HBM floor
    return fwd, 2.0 * fwd, full_flops, 2.0


def compute_times(cfg: TrialConfig, p: ModelParams) -> ComputeTimes:
    dims, tp = cfg.model_dims, cfg.tp
    d = _Device(cfg.hardware_profile, cfg.precision, p)
    tokens = layouts.local_tokens(cfg)
    layers = dims.num_layers // cfg.pp

    d.fp8 = layouts.fp8_peak_flops(cfg.hardware_profile) * p.gemm_efficiency if cfg.fp8 else 0.0
    d.best = max(d.best, d.fp8)
    gemm_f = _layer_gemms(d, dims, tokens, tp)
    d.fp8 = 0.0  # attention, norms and the LM head stay in 16 bits
    stream_f = _layer_stream(d, dims, tokens, tp, cfg.sequence_parallel, p.fused_elementwise)
    block_flops, block_moved = d.flops, d.moved  # one block's forward
    attn_f, attn_b, attn_flops, attn_bwd = _attention(d, cfg, p, tokens)
    attn_moved = d.moved - block_moved
    d.flops = d.moved = 0.0
    head_ranks, loss_vocab = layouts.lm_head_split(cfg, p)
    head_gemm = d.gemm(tokens, dims.hidden_size, dims.vocab_size / head_ranks)
    loss_f, loss_b = d.loss(tokens, loss_vocab)
    redo = p.recompute_fraction if cfg.activation_checkpointing else 0.0
    attn_redo = 0.0
    if layouts.selective(cfg):  # the attention core only (layouts.py)
        redo, attn_redo = 0.0, 1.0
    fwds = 1 + redo  # the recompute runs (that share of) the forward again
    flops = (layers * ((fwds + 2) * block_flops + (fwds + attn_redo + attn_bwd) * attn_flops)
             + 3 * d.flops)  # LM head: forward + its two backward GEMMs
    moved = layers * ((fwds + 2) * block_moved + (1 + attn_redo) * attn_moved) + 3 * d.moved

    layer_f = gemm_f + stream_f + attn_f + FORWARD_OPS_PER_LAYER * d.op
    layer_b = 2 * gemm_f + 2 * stream_f + attn_b + BACKWARD_OPS_PER_LAYER * d.op
    fwd = layers * layer_f + head_gemm + loss_f + FORWARD_OPS_OUTSIDE * d.op
    bwd = layers * layer_b + 2 * head_gemm + loss_b + BACKWARD_OPS_OUTSIDE * d.op
    recompute = layers * (layer_f * redo + attn_f * attn_redo)
    # The parts above inside a real step (see params.py). The ZeRO-3 hook and optimizer figures below
    # were measured inside an engine step already, so in_step_slowdown does not apply to them.
    hw, prec = cfg.hardware_profile, cfg.precision.value
    k = (p.in_step_slowdown * precision_ratio(hw, "in_step_slowdown", prec)
         / p.software_efficiency)  # (software_efficiency: params.py, item 8)
    fwd, bwd, recompute, layer_f, layer_b = (x * k for x in (fwd, bwd, recompute, layer_f, layer_b))
    if cfg.zero_stage == 3 and p.zero3_module_overhead_s:
        hooks = layers * MODULES_PER_LAYER[dims.architecture] + MODULES_OUTSIDE_LAYERS[dims.architecture]
        fwd += hooks * p.zero3_module_overhead_s
        bwd += hooks * p.zero3_module_overhead_s
        layer_f += MODULES_PER_LAYER[dims.architecture] * p.zero3_module_overhead_s
        layer_b += MODULES_PER_LAYER[dims.architecture] * p.zero3_module_overhead_s
    if cfg.pp > 1:  # a stage under torch pipelining, not a whole-model engine step (params.py)
        stage = p.pipeline_compute_factor * precision_ratio(hw, "pipeline_compute_factor", prec)
        fwd, bwd, recompute, layer_f, layer_b = (
            x * stage for x in (fwd, bwd, recompute, layer_f, layer_b))
    if min(cfg.world_size, cfg.hardware_profile.gpus_per_node) > 1:
        # every device of the node busy at once
        shared = p.shared_node_slowdown * precision_ratio(hw, "shared_node_slowdown", prec)
        fwd, bwd, recompute, layer_f, layer_b = (
            x * shared for x in (fwd, bwd, recompute, layer_f, layer_b))
    held = params_per_device(dims, tp, cfg.pp) / (cfg.dp if cfg.zero_stage >= 1 else 1)
    per_param = (ADAM_BYTES_PER_PARAM[cfg.precision] / d.hbm if p.optimizer_s_per_param is None
                 else p.optimizer_s_per_param)
    optimizer = held * per_param + p.step_overhead_s
    return ComputeTimes(fwd, bwd, recompute, optimizer, layers, block_forward_s=layer_f,
                        block_backward_s=layer_b, flops=flops, hbm_bytes=moved,
                        optimizer_hbm_bytes=held * ADAM_BYTES_PER_PARAM[cfg.precision],
                        peak_rate=d.best, attention_forward_s=layers * attn_f * k,
                        attention_backward_s=layers * attn_b * k, gemm_forward_s=layers * gemm_f * k)
