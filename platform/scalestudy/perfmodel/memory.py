"""Per-device memory of a training trial: model states under ZeRO and the TP/PP split, plus activations.

Pure Python (no torch, no ray): the sweep calls `check_memory` before launching anything, and the
performance model reports `total_gib` as the predicted peak.

Model states (Rajbhandari et al. 2020, ZeRO, section 3.1), bytes per parameter:
  mixed precision (bf16/fp16) Adam: 2 (16-bit weights) + 2 (16-bit grads) + 12 (fp32 master weights,
      Adam m and v), the "16 Psi" of the ZeRO paper;
  fp32 Adam: 4 (weights) + 4 (grads) + 8 (m, v). There is no separate master copy: the weights are
      already fp32, so the optimizer updates them in place (DeepSpeed and torch.optim alike).
  ZeRO-1 shards the optimizer states across the dp ranks, ZeRO-2 also the gradients, ZeRO-3 also the
  weights. TP splits every matrix across the tp ranks and PP gives each stage num_layers/pp blocks
  (the first stage also holds the embedding, the last one the LM head: we take the larger stage).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", eq. 2 and section 4.1, 16-bit activations), bytes per transformer layer:
  s*b*h*(10 + 24/t + 5*a*s/(h*t))   with tensor parallelism t and no sequence parallelism;
  (t = 1 gives the paper's s*b*h*(34 + 5*a*s/h)). The 5*a*s/(h*t) term is the a*s*s attention-score,
  softmax and dropout-mask tensors. Fused attention kernels (FlashAttention, and PyTorch SDPA that
  transformers uses by default) never store them: `fused_attention=True` (the default) drops the term,
  exactly as the paper's "selective recomputation" does. Full activation checkpointing keeps only each
  layer's input (2*s*b*h per layer, replicated across tp) plus one layer's full activations while it is
  recomputed. fp32 activations double every term.
  Pipeline 1F1B: the first stage holds min(pp, grad_accum) micro-batches in flight for its
  num_layers/pp layers, i.e. up to num_layers layers' worth (Korthikanti section 4.2.3).
  Output layer: the logits s*b*V/t in 16 bits plus their fp32 copy for the loss (4 bytes),
  the largest single tensors of small models with big vocabularies.

Fixed overhead: on a GPU, the CUDA context, cuBLAS workspaces and NCCL buffers take about 1 GiB before
any tensor exists (measured ~0.5-0.8 GiB context on A100/H100 plus NCCL's 4 MiB x channels x peers);
on CPU, the worker process itself (torch + DeepSpeed imported) is about 0.3 GiB of RSS. ZeRO-3 also
holds gathered weights: the module running plus what the prefetcher keeps in flight, at most
stage3_max_live_parameters beyond it (zero3.py), and never more than two blocks (16-bit, /tp).
The caching allocator's fragmentation is NOT modelled: it varies with the allocation pattern.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from scalestudy.perfmodel import zero3
from scalestudy.spec.catalog import ModelDims, Precision
from scalestudy.spec.errors import InfeasibleTrial
from scalestudy.spec.study import TrialConfig

GIB = float(1 << 30)
GPU_OVERHEAD_BYTES = 1.0 * GIB  # CUDA context + cuBLAS workspace + NCCL buffers (see module doc)
CPU_OVERHEAD_BYTES = 0.3 * GIB  # resident size of a worker process with torch and DeepSpeed loaded


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-device memory in GiB (2**30 bytes)."""

    params_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    overhead_gib: float
    total_gib: float


def state_bytes_per_param(precision: Precision) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) bytes per parameter for Adam."""
    if precision is Precision.fp32:
        return 4, 4, 8
    return 2, 2, 12


@functools.lru_cache(maxsize=4096)
def params_per_device(dims: ModelDims, tp: int, pp: int) -> float:
    """Parameters held by the largest pipeline stage on one tp rank (before ZeRO sharding)."""
    if pp == 1:
        return dims.num_params() / tp
    blocks = dims.num_layers // pp * dims.layer_params()
    ends = max(dims.embedding_params(), dims.lm_head_params() + dims.hidden_size)
    return (blocks + ends) / tp


def activation_bytes_per_layer(
    dims: ModelDims, seq_len: int, micro_batch: int, tp: int, act_bytes: int,
    fused_attention: bool = True,
) -> float:
    """Korthikanti et al. 2022, eq. 2 with TP and no sequence parallelism, scaled to act_bytes."""
    s, b, h, a = seq_len, micro_batch, dims.hidden_size, dims.num_heads
    coeff = 10.0 + 24.0 / tp
    if not fused_attention:
        coeff += 5.0 * a * s / (h * tp)
    return s * b * h * coeff * act_bytes / 2.0


def activation_bytes(cfg: TrialConfig, fused_attention: bool = True) -> float:
    dims = cfg.model_dims
    s, b, h = cfg.seq_len, cfg.micro_batch, dims.hidden_size
    act_bytes = cfg.precision.bytes
    per_layer = activation_bytes_per_layer(dims, s, b, cfg.tp, act_bytes, fused_attention)
    layers_per_stage = dims.num_layers // cfg.pp
    # 1F1B keeps up to pp micro-batches alive on the first stage (fewer if there are fewer).
    in_flight = min(cfg.pp, cfg.grad_accum) if cfg.pp > 1 else 1
    if cfg.activation_checkpointing:
        # Layer inputs are kept; one layer's full activations exist while it is recomputed.
        kept = in_flight * layers_per_stage * s * b * h * act_bytes
        layers = kept + per_layer
    else:
        layers = in_flight * layers_per_stage * per_layer
    # Logits (16-bit, split over tp with the vocabulary) + their fp32 copy for the cross-entropy.
    logits = s * b * dims.vocab_size / cfg.tp * (act_bytes + 4)
    return layers + logits


def memory_breakdown(cfg: TrialConfig, fused_attention: bool = True) -> MemoryBreakdown:
    """Per-device memory of one trial (see the module doc for every term)."""
    n = params_per_device(cfg.model_dims, cfg.tp, cfg.pp)
    w_b, g_b, o_b = state_bytes_per_param(cfg.precision)
    dp, z = cfg.dp, cfg.zero_stage
    optimizer = n * o_b / (dp if z >= 1 else 1)
    grads = n * g_b / (dp if z >= 2 else 1)
    params = n * w_b / (dp if z >= 3 else 1)
    overhead = GPU_OVERHEAD_BYTES if cfg.hardware_profile.kind == "gpu" else CPU_OVERHEAD_BYTES
    if z >= 3:
        block = cfg.model_dims.layer_params() / cfg.tp
        biggest = max(zero3.block_weights(cfg.model_dims, cfg.tp), default=0.0)
        overhead += min(2 * block, biggest + zero3.MAX_LIVE) * w_b  # gathered, in flight
    acts = activation_bytes(cfg, fused_attention)
    parts = [x / GIB for x in (params, grads, optimizer, acts, overhead)]
    return MemoryBreakdown(*parts, total_gib=sum(parts))


# Share of device memory a trial must leave free. The model omits the caching allocator's
# fragmentation and the allocator's block rounding, and a device with 0 bytes to spare fails on the
# first unlucky allocation order; 5% (4 GiB of an 80 GiB H100) is the margin the sweep keeps.
DEVICE_MEMORY_FREE_FRACTION = 0.05


def usable_memory_gib(hbm_gib: float) -> float:
    """Device memory a trial may plan to use: all but DEVICE_MEMORY_FREE_FRACTION of it."""
    return hbm_gib * (1.0 - DEVICE_MEMORY_FREE_FRACTION)


def check_memory(cfg: TrialConfig) -> None:
    """Raise InfeasibleTrial when the predicted per-device memory exceeds the device's usable share."""
    need = memory_breakdown(cfg).total_gib
    have = cfg.hardware_profile.hbm_gib
    usable = usable_memory_gib(have)
    if need > usable:
        raise InfeasibleTrial(
            f"needs {need:.1f} GiB per device, has {have:.0f} GiB of which "
            f"{DEVICE_MEMORY_FREE_FRACTION:.0%} is kept free ({usable:.1f} GiB usable)")
