"""Per-device memory of a training trial, term by term, as this platform allocates it: a Hugging Face
model trained by DeepSpeed (ZeRO 0-3, AutoTP) under PyTorch, on a GPU or on a CPU core.

Pure Python (no torch, no ray): the plan applies `memory_refusal` to `memory_breakdown` once per trial,
and the performance model reports `total_gib` as the predicted peak.

The peak. Memory rises and falls within a step, so the estimate is the highest of three moments, each
the sum of what is alive then (`Phase`): the start of the backward (saved activations, the logits'
backward buffers, ZeRO-3's gathered weights), the end of the backward (every gradient and the copies
its reduction makes) and the optimizer step (fp32 gradients and Adam's temporaries). The breakdown
lists the terms alive at the highest one, so its terms sum to total_gib; `model_states_bytes` gives
the ZeRO paper's accounting of weights, gradients and optimizer states for comparisons.

Model states (Rajbhandari et al. 2020, ZeRO, sec. 3.1), bytes per parameter, as DeepSpeed 0.19 holds
them (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py; engine.py picks the optimizer wrapper):
  weights in the training dtype w (2 or 4); Adam's m and v, 8; an fp32 master copy, 4, except for
  fp32 without ZeRO, where torch's AdamW updates the weights in place. ZeRO clones the master copy
  even in fp32 (`single_partition_of_fp32_groups`, `fp32_partitioned_groups_flat`: .clone()).
  ZeRO-1/2 shard master and Adam over dp; both keep only their own partition's gradients
  (`grads_in_partition`); ZeRO-3 also shards the weights and keeps a gradient partition buffer
  (`grad_partitions_flat_buffer`, allocated once). AutoTP shards the nn.Linear layers over tp
  (an untied lm_head included; one tied to the embedding stays whole, as the embedding does on
  every tp rank: module_inject/auto_tp.py, layouts.lm_head_split).
DeepSpeed's buffers (parallel/deepspeed_config.py sets the sizes; DeepSpeed's defaults otherwise):
  reduce buckets: ZeRO-1/2 allocate reduce_bucket_size (5e8) elements per backward, twice with
  overlap_comm (`setup_buckets`); ZeRO-3 one bucket at start-up. ZeRO-0 flattens gradients into
  buckets of 5e8 elements to all-reduce them (engine.allreduce_gradients, MEMORY_OPT_ALLREDUCE_SIZE).
  The optimizer step makes an fp32 gradient of the partition (ZeRO-1/2) or of one sub-group of
  sub_group_size (1e9) elements at a time (ZeRO-3, `_prepare_fp32_grad_for_sub_group`); fp16/bf16
  without ZeRO (FP16_Optimizer) an fp32 copy of every gradient. ZeRO-3 gathers weights before each
  module: the blocks the backward reuses within stage3_max_reuse_distance stay gathered from the
  forward (zero3.retained_blocks), plus the running block, the LM head and the prefetch bucket (5e7).
  On a GPU the caching allocator holds a bucket whole; on a CPU only the pages written are resident
  (torch.empty maps memory; RSS counts touched pages), so a CPU bucket costs what it holds.
  torch's AdamW on a CPU (not fused, not foreach) makes two temporaries the size of the tensor it
  steps (sqrt of v, then its quotient); the fused CUDA kernel a GPU trial uses makes none.

Activations, per layer and token, as autograd saves them for backward in Hugging Face's Llama
(modeling_llama.py) with fused attention (SDPA), act bytes a, tp degree t, kv width k:
  each RMSNorm: the fp32 input (pow, mul), the normalised input in a bytes, its weighted output
      (the projections' input): (4 + 2a) h, twice per layer, not split by tp;
  attention: rotated q and k, v (SDPA's inputs), SDPA's output and o_proj's contiguous input:
      a (3h + 2k) / t;  unfused attention adds the fp32 softmax (and its a-byte copy), heads*s/t;
  MLP: gate, up, SiLU(gate) and the product: 4 a f / t.
  Logits (AutoTP's LM head all-reduces them, so each rank has all V columns): the a-byte logits stay
  alive through the backward while log-softmax's output, its incoming gradient and its result are
  fp32: (a + 12) V per token (in fp32, 16 V: what glibc's live bytes rose by when a CPU trial's
  backward began, measured with mallinfo2 while preparing tests/validation/test_memory_measured.py).
  Full checkpointing keeps each layer's input (a h) plus one layer's activations being recomputed;
  selective recomputation (the attention core under checkpoint) keeps all but the core's own
  tensors: SDPA's output, a h / t (and eager attention's softmax).
  GPT-style blocks (HF OPT) keep Korthikanti et al. 2022's 10 + 24/t coefficient. Layouts that only
  published runs use (sequence/context parallelism, FP8, interleaving) are memory_layouts.py's,
  which follows Korthikanti throughout (selective recomputation too, when combined with them).
  Pipeline 1F1B keeps min(pp, grad_accum) micro-batches of the first stage's layers alive
  (Korthikanti sec. 4.2.3).

What the runtime adds (with sources at each constant): the CUDA context and NCCL's buffers per
communicator on a GPU, the worker process itself on a CPU, and the allocator's fragmentation on both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

from scalestudy.errors import InfeasibleTrial, ReasonClass
from scalestudy.parallel.deepspeed_config import REDUCE_BUCKET_ELEMENTS
from scalestudy.perfmodel import zero3
from scalestudy.perfmodel.layouts import autotp, selective
from scalestudy.perfmodel.params import params_for
from scalestudy.spec.catalog import ModelDims, Precision
from scalestudy.spec.study import TrialConfig

GIB = float(1 << 30)
MIB = float(1 << 20)

# DeepSpeed defaults our config does not override (deepspeed/runtime/engine.py, zero/config.py).
ZERO0_ALLREDUCE_BUCKET_ELEMENTS = 500_000_000  # engine.MEMORY_OPT_ALLREDUCE_SIZE
SUB_GROUP_ELEMENTS = 1_000_000_000  # zero_optimization.sub_group_size

# The CUDA driver's context with lazily loaded kernels (CUDA_MODULE_LOADING=LAZY, PyTorch's default
# since CUDA 11.7) plus cuBLAS/cuDNN workspaces: 0.5-0.8 GiB per process on A100/H100 (what
# nvidia-smi shows for a process before its first tensor). The upper end, as a refusal rule should.
CUDA_CONTEXT_BYTES = 0.8 * GIB
# NCCL keeps, per communicator and channel, a buffer of NCCL_BUFFSIZE (4 MiB by default, NCCL's
# environment-variable docs) for each ring neighbour (2 peers); up to NCCL_MAX_NCHANNELS (32) channels
# on NVLink machines. One communicator per process group a trial uses (world, dp, tp, pp).
NCCL_BUFFSIZE_BYTES = 4 * MIB
NCCL_CHANNELS = 32
NCCL_RING_PEERS = 2
# PyTorch's CUDA caching allocator: blocks split and cached across steps leave part of the reserved
# pool unusable. GMLake (Guo et al., ASPLOS 2024, arXiv:2401.08156) measured this fragmentation at
# 15% of reserved memory on average (up to 33%) over eight LLMs trained on A100-80GB with ZeRO,
# recomputation and offloading, memory that its stitching recovered. It arises from what is
# allocated and freed every step; model states are allocated once, as flat buffers.
GPU_FRAGMENTATION_FRACTION = 0.15
# A CPU worker's resident size before its model exists: Python, torch, DeepSpeed, transformers and the
# gloo/shared-memory communication buffers. Measured: the peak RSS of llama2-tiny trials (0.2M
# parameters, a few MiB of tensors) less those tensors, 0.52 GiB at world size 1 (ZeRO-0) and 0.57
# at world size 2 (ZeRO-3) (`process` group of tests/validation/data/memory_measured.yaml).
CPU_PROCESS_BYTES = 0.54 * GIB
# glibc's heap under the worker's settings (train/host_memory.py: freed memory is kept, as a caching
# allocator keeps it, and tensors up to 32 MiB are carved from the heap) holds, at the peak, chunks
# freed earlier that the tensors alive then could not reuse: gloo's worker threads allocate the
# collectives' temporaries in arenas of their own, DeepSpeed's flat partitions and fp32 copies come
# and go every step. Not derived: measured as peak RSS - process - estimated tensors on the
# `calibration` trials of memory_measured.yaml (another model than the scored ones), where it ranged
# from 0.07 GiB (plain ZeRO-0) to 0.43 GiB (ZeRO-3) and did not scale with the tensors: their mean.
CPU_HEAP_RETAINED_BYTES = 0.24 * GIB


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-device memory in GiB (2**30 bytes) at the step's peak; the terms sum to total_gib."""

    params_gib: float  # weights held: all (ZeRO 0-2) or this rank's partition + persistent ones
    grads_gib: float  # gradients alive at the peak (training dtype)
    optimizer_gib: float  # fp32 master weights + Adam's m and v
    activations_gib: float  # saved for backward, logits' buffers included
    gathered_gib: float  # ZeRO-3: other ranks' weights gathered for the modules about to run
    buckets_gib: float  # DeepSpeed's reduce buckets and the copies gradient reduction makes
    step_temporaries_gib: float  # optimizer step: fp32 gradients (per sub-group) + Adam temporaries
    fragmentation_gib: float  # the allocator's unusable share (caching allocator / glibc heap)
    nccl_gib: float  # NCCL's buffers, per communicator (GPU)
    runtime_gib: float  # CUDA context (GPU) or the worker process itself (CPU)
    total_gib: float

    @property
    def terms_gib(self) -> dict[str, float]:
        """Each term of the estimate by name (what `validate` and the ledger show), total excluded."""
        return {f.name.removesuffix("_gib"): getattr(self, f.name) for f in fields(self)
                if f.name != "total_gib"}


TERMS = tuple(f.name.removesuffix("_gib") for f in fields(MemoryBreakdown) if f.name != "total_gib")


def state_bytes_per_param(precision: Precision) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) bytes per parameter for mixed-precision Adam with an
    fp32 master copy (the ZeRO paper's 2 + 2 + 12); fp32 has no separate master copy without ZeRO."""
    if precision is Precision.fp32:
        return 4, 4, 8
    return 2, 2, 12


@functools.lru_cache(maxsize=4096)
def params_per_device(dims: ModelDims, tp: int, pp: int) -> float:
    """Parameters held by the largest pipeline stage on one tp rank (before ZeRO sharding), with
    every matrix split over tp (what the time model counts)."""
    if pp == 1:
        return dims.num_params() / tp
    blocks = dims.num_layers // pp * dims.layer_params()
    ends = max(dims.embedding_params(), dims.lm_head_params() + dims.hidden_size)
    return (blocks + ends) / tp


@functools.lru_cache(maxsize=4096)
def weights_per_device(dims: ModelDims, tp: int, pp: int, autotp: bool = True) -> float:
    """What a tp rank of the largest stage stores. DeepSpeed AutoTP leaves the embedding whole on
    every rank (layouts.lm_head_split); Megatron splits it over the vocabulary like every other
    matrix (VocabParallelEmbedding), which is params_per_device."""
    if tp == 1 or not autotp:
        return params_per_device(dims, tp, pp)
    emb = dims.embedding_params()
    if pp == 1:
        return (dims.num_params() - emb) / tp + emb
    blocks = dims.num_layers // pp * dims.layer_params()
    return max(blocks / tp + emb, (blocks + dims.lm_head_params() + dims.hidden_size) / tp)


def _persistent_params(dims: ModelDims, tp: int) -> float:
    """Elements ZeRO-3 keeps gathered on every rank: those of at most
    stage3_param_persistence_threshold (1e5) elements (norms, GPT's biases; zero3.block_weights)."""
    per_block = dims.layer_params() / tp - sum(zero3.block_weights(dims, tp))
    return dims.num_layers * max(per_block, 0.0) + dims.hidden_size


def _weights(cfg: TrialConfig) -> float:
    """weights_per_device of the trial, split as its tensor parallelism splits them."""
    autotp_split = cfg.tp > 1 and autotp(cfg, params_for(cfg.hardware_profile))
    return weights_per_device(cfg.model_dims, cfg.tp, cfg.pp, autotp_split)


def model_states_bytes(cfg: TrialConfig) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) per device in bytes, the ZeRO paper's accounting
    (16-bit gradients kept whole below ZeRO-2, sharded from it on): the part of the estimate that
    DeepSpeed's own estimators cover (tests/unit/test_memory_deepspeed_estimator.py)."""
    n = _weights(cfg)
    w, g, o = state_bytes_per_param(cfg.precision)
    if cfg.zero_stage >= 1 and cfg.precision is Precision.fp32:
        o = 12  # ZeRO clones an fp32 master even when the weights are fp32
    dp, z = cfg.dp, cfg.zero_stage
    return (n * w / (dp if z >= 3 else 1), n * g / (dp if z >= 2 else 1),
            n * o / (dp if z >= 1 else 1))


def _llama_layer_bytes(dims: ModelDims, s: int, b: int, t: int, a: int, fused: bool) -> float:
    """Bytes Hugging Face's Llama block saves for backward (module doc), per micro-batch."""
    h, f, k = dims.hidden_size, dims.ffn, dims.kv_heads * dims.head_dim
    # attention: q, k, v and o_proj's input here; SDPA's own output in the core's bytes
    per_token = 2 * (4 + 2 * a) * h + a * (2 * h + 2 * k) / t + 4 * a * f / t
    return s * b * (per_token + _attention_core_bytes(dims, s, t, a, fused))


def _attention_core_bytes(dims: ModelDims, s: int, t: int, a: int, fused: bool) -> float:
    """Per token, what the attention core alone saves: SDPA's output (h, the kernel's backward
    needs it; o_proj saves its own contiguous copy), and with eager attention the fp32 softmax
    output and its a-byte copy below fp32. Selective recomputation frees exactly this: the core
    runs under torch's checkpoint (train/model_factory.py), which saves only its inputs, the
    q, k and v the block keeps anyway."""
    core = a * dims.hidden_size / t
    if not fused:
        core += (4 + (a if a != 4 else 0)) * dims.num_heads * s / t
    return core


def activation_bytes_per_layer(
    dims: ModelDims, seq_len: int, micro_batch: int, tp: int, act_bytes: int,
    fused_attention: bool = True,
) -> float:
    """One block's saved activations (Llama: Hugging Face's; GPT: Korthikanti et al. 2022, eq. 2)."""
    s, b, h, a = seq_len, micro_batch, dims.hidden_size, dims.num_heads
    if dims.architecture == "llama":
        return _llama_layer_bytes(dims, s, b, tp, act_bytes, fused_attention)
    coeff = 10.0 + 24.0 / tp + (0.0 if fused_attention else 5.0 * a * s / (h * tp))
    return s * b * h * coeff * act_bytes / 2.0


def _published_layout(cfg: TrialConfig) -> bool:
    """Layout options only published runs (Megatron-style stacks) use: memory_layouts.py's.
    Selective recomputation alone is not one of them: the measure backend runs it on a Hugging
    Face model (tests/validation/data/memory_measured.yaml's sel-* trials)."""
    return bool(getattr(cfg, "sequence_parallel", False) or getattr(cfg, "cp", 1) > 1
                or getattr(cfg, "fp8", False) or (getattr(cfg, "virtual_stages", 1) or 1) > 1)


def activation_bytes(cfg: TrialConfig, fused_attention: bool = True) -> float:
    """Saved activations of the first pipeline stage (the fullest) plus the logits' buffers."""
    if _published_layout(cfg):
        from scalestudy.perfmodel import memory_layouts

        return memory_layouts.activation_bytes(cfg, fused_attention)
    dims = cfg.model_dims
    s, b, h, a = cfg.seq_len, cfg.micro_batch, dims.hidden_size, cfg.precision.bytes
    per_layer = activation_bytes_per_layer(dims, s, b, cfg.tp, a, fused_attention)
    in_flight = min(cfg.pp, cfg.grad_accum) if cfg.pp > 1 else 1
    layers = in_flight * (dims.num_layers // cfg.pp)
    if selective(cfg):  # every block's activations but its attention core's (recomputed)
        body = layers * (per_layer - s * b * _attention_core_bytes(dims, s, cfg.tp, a,
                                                                   fused_attention))
    elif cfg.activation_checkpointing:  # layer inputs kept, one layer recomputed at a time
        body = layers * s * b * h * a + per_layer
    else:
        body = layers * per_layer
    return body + s * b * dims.vocab_size * (a + 12)


@dataclass(frozen=True)
class Phase:
    """Bytes alive at one moment of the step beyond the resident ones, by breakdown term."""

    terms: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def _held(allocated: float, written: float, on_gpu: bool) -> float:
    """A buffer's footprint: whole in the caching allocator; on a CPU only its written pages."""
    return allocated if on_gpu else min(allocated, written)


def _zero3_gathered(cfg: TrialConfig) -> float:
    """Elements gathered when the backward starts: the blocks the reuse distance keeps from the
    forward (at least the running one), the LM head and the prefetch bucket in flight, at most every
    weight there is to gather."""
    dims, tp = cfg.model_dims, cfg.tp
    block = sum(zero3.block_weights(dims, tp))
    head = dims.lm_head_params() / tp
    layers = dims.num_layers // cfg.pp
    kept = zero3.retained_blocks(block, head, layers)
    everything = _weights(cfg) - _persistent_params(dims, tp)
    return min(everything, max(kept, 1) * block + head + zero3.PREFETCH_BUCKET)


def _phases(cfg: TrialConfig, acts: float, n: float) -> tuple[dict[str, float], list[Phase]]:
    """(resident bytes by term, the phases' extra bytes): see the module doc, stage by stage."""
    gpu, z, dp = cfg.hardware_profile.is_gpu, cfg.zero_stage, cfg.dp
    w = cfg.precision.bytes
    master = 4 if (w != 4 or z >= 1) else 0
    shard = dp if z >= 1 else 1
    resident = {"params": n * w, "optimizer": n * (master + 8) / shard}
    part = n / dp  # this rank's partition (ZeRO >= 1)
    # CPU AdamW (not fused): two temporaries of the tensor it steps; flat partitions under ZeRO.
    adam = 0.0 if gpu else 2 * 4 * (part if z >= 1 else _largest_tensor(cfg))
    if z == 0:
        flat = min(n, ZERO0_ALLREDUCE_BUCKET_ELEMENTS) * w if dp > 1 else 0.0
        fp32_grads = 4 * n if w != 4 else 0.0  # FP16_Optimizer's fp32 gradients
        return resident, [Phase({"activations": acts}),
                          Phase({"grads": n * w, "buckets": flat}),
                          Phase({"grads": n * w, "step_temporaries": fp32_grads + adam})]
    overlap = gpu or z == 3  # parallel/deepspeed_config.zero_config
    if z in (1, 2):
        copies = 2 if overlap else 1
        buckets = _held(copies * REDUCE_BUCKET_ELEMENTS, n, gpu) * w
        fp32_grads = 4 * part + (w * part if w != 4 else 0.0)  # flatten, then .float()
        # A CPU bucket is mapped afresh each backward and written as the activations are freed.
        return resident, [Phase({"activations": acts, "buckets": buckets if gpu else 0.0}),
                          Phase({"grads": part * w, "buckets": buckets}),
                          Phase({"step_temporaries": fp32_grads + adam})]
    persistent = _persistent_params(cfg.model_dims, cfg.tp)
    resident["params"] = (part + persistent) * w
    resident["grads"] = part * w  # grad_partitions_flat_buffer, allocated once
    resident["buckets"] = _held(REDUCE_BUCKET_ELEMENTS, n, gpu) * w
    sub = min(SUB_GROUP_ELEMENTS, part)
    fp32_grads = 4 * sub + (w * sub if w != 4 else 0.0)
    adam = 0.0 if gpu else 2 * 4 * sub
    return resident, [Phase({"activations": acts, "gathered": _zero3_gathered(cfg) * w}),
                      Phase({"step_temporaries": fp32_grads + adam})]


def _largest_tensor(cfg: TrialConfig) -> float:
    """Elements of the largest weight on a rank without ZeRO: the embedding (whole under AutoTP) or
    the LM head, else the largest block matrix."""
    dims = cfg.model_dims
    return max(dims.embedding_params(), dims.lm_head_params() / cfg.tp,
               max(zero3.block_weights(dims, cfg.tp), default=0.0))


def _communicators(cfg: TrialConfig) -> int:
    """NCCL communicators a trial's rank joins: the world's, and dp, tp and pp groups of their own."""
    lay = cfg.layout
    if lay.world_size == 1:
        return 0
    own = sum(1 for size in (lay.dp, lay.tp, lay.pp) if 1 < size < lay.world_size)
    return 1 + own


def memory_breakdown(cfg: TrialConfig, fused_attention: bool = True) -> MemoryBreakdown:
    """Per-device memory of one trial at the step's peak (see the module doc for every term)."""
    n = _weights(cfg)
    resident, phases = _phases(cfg, activation_bytes(cfg, fused_attention), n)
    peak = max(phases, key=lambda p: p.total)
    terms = dict.fromkeys(TERMS, 0.0)
    for source in (resident, peak.terms):
        for name, value in source.items():
            terms[name] += value
    gpu = cfg.hardware_profile.is_gpu
    if gpu:
        f = GPU_FRAGMENTATION_FRACTION
        terms["fragmentation"] = peak.total * f / (1.0 - f)  # f of the reserved pool, per step
        terms["nccl"] = _communicators(cfg) * NCCL_BUFFSIZE_BYTES * NCCL_CHANNELS * NCCL_RING_PEERS
        terms["runtime"] = CUDA_CONTEXT_BYTES
    else:
        terms["fragmentation"] = CPU_HEAP_RETAINED_BYTES
        terms["runtime"] = CPU_PROCESS_BYTES
    gib = {name: value / GIB for name, value in terms.items()}
    return MemoryBreakdown(**{f"{k}_gib": v for k, v in gib.items()}, total_gib=sum(gib.values()))


# THE memory rule, the one every command applies (plan/ asks it once per trial; predict() asks it
# for a config given directly): a trial fits when its estimate is at most the device's memory less
# MEMORY_MARGIN_FRACTION. Why a margin on top of the fragmentation term: the fragmentation fraction
# is an average (GMLake's worst case was 33%), and a device with 0 bytes to spare fails on the first
# unlucky allocation order; 5% is 4 GiB of an 80 GiB H100.
MEMORY_MARGIN_FRACTION = 0.05


def usable_memory_gib(hbm_gib: float) -> float:
    """Device memory a trial may plan to use: all but MEMORY_MARGIN_FRACTION of it."""
    return hbm_gib * (1.0 - MEMORY_MARGIN_FRACTION)


def memory_refusal(need_gib: float, hbm_gib: float) -> str | None:
    """The memory rule's one-line reason when `need_gib` does not fit a device of `hbm_gib`, else None."""
    usable = usable_memory_gib(hbm_gib)
    if need_gib <= usable:
        return None
    return (f"needs {need_gib:.1f} GiB per device, has {hbm_gib:.0f} GiB of which "
            f"{MEMORY_MARGIN_FRACTION:.0%} is kept free ({usable:.1f} GiB usable)")


def check_memory(cfg: TrialConfig, fused_attention: bool = True) -> MemoryBreakdown:
    """The trial's memory estimate; InfeasibleTrial (class memory) when it breaks the memory rule."""
    mem = memory_breakdown(cfg, fused_attention)
    reason = memory_refusal(mem.total_gib, cfg.hardware_profile.hbm_gib)
    if reason:
        raise InfeasibleTrial(reason, ReasonClass.memory)
    return mem
