"""The performance model's efficiency parameters: few, physical, the same for every trial.

A hardware profile's data-sheet figures (peak FLOP/s, HBM and link bandwidths) say what a device
could do; these parameters say which fraction of it real kernels reach. Defaults are for NVIDIA
data-centre GPUs with cuBLAS, FlashAttention-style fused attention and NCCL; a profile overrides any of
them through its `calibration` mapping (what `scalestudy calibrate` measures and `scalestudy fit`
fits), using the field names below as keys. Nothing here is tuned per trial or per published row.
"""

from __future__ import annotations

import functools
import json

from pydantic import BaseModel, ConfigDict, Field

from scalestudy.spec.catalog import HardwareProfile


class ModelParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Compute ---------------------------------------------------------------------------------
    # Fraction of peak a large, square GEMM reaches (best cuBLAS GEMM / dense peak, mamf-finder
    # tables: A100 SXM 267.9 of 312 TFLOP/s = 0.86, H100 SXM 792.1 of 989 = 0.80). Per device in
    # hardware.yaml's calibration; this default is for a device without one.
    gemm_efficiency: float = Field(0.85, gt=0, le=1)
    # Fused attention relative to the GEMM rate above (compute.py runs it at peak * gemm_efficiency
    # * attention_efficiency): FlashAttention-2 reaches ~70% of A100's peak, ~0.8 of cuBLAS's rate,
    # and ~0.45 of it on H100, where FA2 lacks Hopper's WGMMA/TMA (Dao 2023; hardware.yaml).
    attention_efficiency: float = Field(0.75, gt=0, le=1)
    # Sequence length at which a fused attention kernel runs at half its asymptotic rate: its fixed
    # cost per tile row amortises over the keys (FA2 causal, head dim 128: 155/182/189 TFLOP/s at
    # 2k/4k/8k on A100, 265/294/308 on H100, Dao 2023 fig. 4(d)/7(d) -> ~600 tokens on both). 0:
    # no such cost (CPU kernels, measured attention rows).
    attention_half_seq: float = Field(0.0, ge=0)
    # The software stack's attention kernel: fused (FlashAttention, PyTorch SDPA; the default since
    # 2022) or materialised scores (Megatron-LM 2021: batched GEMMs around a fused softmax), whose
    # a*s*s score tensors cost HBM traffic and memory (see compute.py and memory.py).
    fused_attention: bool = True
    # The software stack fuses the elementwise work around the GEMMs (issue 35, item 8): Megatron-LM's
    # and Transformer Engine's fused LayerNorm/RMSNorm, bias-GeLU / SwiGLU, bias-dropout-add and
    # rotary kernels (Narayanan et al. 2021, Sec. 4.2 "operator fusion"; TE's fused modules) read
    # and write each tensor once, where eager PyTorch (this platform's trials, HF models) runs every
    # op as its own kernel (compute.py's pass counts). A software fact of a stack, never fitted.
    fused_elementwise: bool = False
    # Achievable fraction of HBM bandwidth for streaming kernels (norms, activations, optimizer).
    hbm_efficiency: float = Field(0.8, gt=0, le=1)
    # Fixed cost of one kernel / framework op (launch + dispatch). GPU: ~5-10 us of CPU-side launch that
    # is mostly hidden by asynchronous launches, so a small default; CPU eager PyTorch: tens of us.
    op_overhead_s: float = Field(4e-6, ge=0)
    # Compute of a real training step against the sum of its parts benchmarked alone (calibrate: a
    # DeepSpeed step of a reference shape on one device over the model's sum of the microbenchmarks).
    # On CPU eager PyTorch a step's kernels meet caches that the previous kernels evicted and
    # Python/autograd/engine work between them, where each microbenchmark loops hot on one op
    # (1.2-1.5 on the 2-core development machine, calibrate/reference_step.py). It multiplies the
    # kernel and op sums of forward and backward only: the ZeRO-3 hook and optimizer figures below
    # were measured inside an engine step already (compute.py). On GPUs the efficiencies above are
    # what kernels reach in real training, so 1. Below 1 where the parts benchmarked alone ran
    # slower than inside the step (a quick calibration on the 2-core AMD EPYC without native bf16,
    # 2026-12-07, put fp32's parts 28% over its measured step; three others within +-4%): the step
    # is what is measured, so the factor follows it. Per precision: precision_ratio below.
    in_step_slowdown: float = Field(1.0, ge=0.5)
    # Compute slowdown of each device while every device of its node trains at once, against one
    # device alone (calibrate: the reference step on every worker of a node as data parallelism, over
    # what the model predicts for it from the lone step and the collectives' benchmarks). CPU cores
    # share caches, memory bandwidth and the cores the OS, Ray and the driver also need, and a
    # synchronous collective waits for the core that was interrupted. A GPU has its own SMs and HBM: 1.
    shared_node_slowdown: float = Field(1.0, ge=1)
    # A framework family's compute against this model's kernel sum (issue 35, item 8): what its
    # software stack (kernel choices and fusions, host-side work between kernels) costs a step of
    # the same kernels. Divides forward, backward and recompute time. Never a per-source constant:
    # tests/validation fits it per framework family (Megatron-LM, NeMo, DeepSpeed, PyTorch FSDP)
    # from that family's published rows only, each source scored by a fit without it, and reports
    # it per family. 1: the kernels as modelled (every catalogue profile).
    software_efficiency: float = Field(1.0, gt=0, le=1)
    # Fixed cost per optimizer step outside the kernels above (engine bookkeeping, loss scaling,
    # gradient-norm reduction, data loading not hidden).
    step_overhead_s: float = Field(0.0, ge=0)
    # Optimizer step per parameter held, when measured (calibrate: DeepSpeed's step at two model
    # widths). None: Adam's bytes per parameter at the streaming bandwidth (compute.py).
    optimizer_s_per_param: float | None = Field(None, ge=0)
    # ZeRO-3's fetch/release hooks per module run, in forward and again in backward: DeepSpeed hooks
    # every module whose forward runs, with parameters or not (compute.py counts them per
    # architecture). Python bookkeeping beyond the all-gathers themselves, priced as serial work.
    # CPU eager: calibrate's stage 3 against stage 0, per module run of its stack of Linears and
    # their Sequential. GPU: calibrate/gpu.py's reference step at stage 3 against stage 0 on one
    # GPU; the catalogue's GPU profiles keep 0 (hidden behind asynchronous launches), which an H200
    # contradicted at TinyLlama's size (stage 3 at half stage 0's throughput at world 1, 2026-12-04).
    zero3_module_overhead_s: float = Field(0.0, ge=0)
    # ZeRO-3's trace-based parameter prefetch (zero3.py). DeepSpeed releases before mid-2021 skipped
    # the prefetches (the step id ran one ahead of the recorded trace: DeepSpeed #1069, May 2021),
    # so every gather waited for its module; a published row run on such a release says so.
    zero3_prefetch: bool = True
    # Share of the forward that activation checkpointing runs again before the backward: 1 for full
    # checkpointing (every block's forward recomputed); selective schemes recompute less (torchtitan's
    # op policy recomputes every second matmul and the cheap ops, about half; a run that checkpoints
    # every n-th block, 1/n). Scales the recompute compute, its FLOPs and its TP all-reduces; the
    # memory model keeps full checkpointing's activations (a lower bound). Only read when the trial
    # checkpoints.
    recompute_fraction: float = Field(1.0, gt=0, le=1)
    # How tensor parallelism all-reduces in backward. False: Megatron's f operator, one all-reduce
    # of the input's gradient per attention and per MLP (Shoeybi et al. 2019, fig. 3; torchtitan's
    # PrepareModuleInput does the same), what every published TP row ran. True: DeepSpeed AutoTP,
    # which this platform's trials run: every column-parallel Linear (HF Llama's q, k, v, gate, up;
    # OPT's q, k, v, fc1) all-reduces its own input gradient (module_inject/layers.py: LinearLayer
    # -> ColumnParallel.backward, DeepSpeed 0.19.8), blocking unless tp_overlap_comm is set. Profiles
    # `scalestudy calibrate` writes set it: they describe this platform's trials. A trial of the
    # measure backend is priced as AutoTP whatever this says (parallelism.py), and so is the
    # predicted twin of one (scalestudy_analysis/predictions.py).
    tp_all_reduce_per_linear: bool = False
    # Each TP all-reduce inside a step beyond its benchmarked time: it waits for the slowest rank of
    # its group to arrive (a step has several per block, each a synchronisation point) and, with gloo
    # on busy cores, for the collective's own threads. Calibrate (CPU) solves it from the reference
    # step at tp = world against the same step's collectives benchmarked in lock-step; measured
    # in a tp-2 trial on the 2-core development machine: 39 all-reduces a step of ~0.2 MB each at
    # 0.08 GB/s busbw, where the lock-step benchmark gives ~0.25 GB/s at that size; calibrate then
    # solved 2.6 ms per call (2026-12-04). GPUs: 0 (not measured).
    tp_collective_overhead_s: float = Field(0.0, ge=0)
    # Pipeline chunks per pipeline rank (Megatron's interleaved 1F1B, Narayanan et al. 2021, Sec.
    # 2.2.2): the fill/drain bubble shrinks to (pp - 1) / V micro-batch slots and each micro-batch
    # crosses V times as many stage boundaries. 1: the plain 1F1B schedule.
    pipeline_virtual_stages: int = Field(1, ge=1)
    # Compute of a pipeline stage's step against the same blocks priced as above (pp > 1 only).
    # Calibrate (CPU) solves it from the pipeline reference step at pp = world (1F1B, every other
    # factor fixed): a stage runs under torch.distributed.pipelining, without the DeepSpeed engine's
    # hooks around the whole model, and holds half the blocks per process, so where the factors
    # above were solved on a whole-model DeepSpeed step it runs faster (two quick calibrations on a
    # 2-core AMD EPYC without native bf16, 2026-12-07: 0.85, where the reference step measured
    # 0.155 s against 0.181 s predicted without it, and 0.98). GPUs: 1 (not measured).
    pipeline_compute_factor: float = Field(1.0, gt=0)
    # Network ---------------------------------------------------------------------------------
    # Achievable bus bandwidth / link rate for large messages, nccl-tests busbw
    # (tests/validation/data/nccl_published.yaml): NVLink: A100 all-reduce 230.8-232.5 of 300 GB/s
    # (nccl #527, nccl-tests #175), H100 ring ~370 of 450 (sjeaugey, nccl-tests #212) -> 0.8.
    # InfiniBand/RoCE across nodes: DGX A100 192 of 200 GB/s (NVIDIA, nccl #812), 4 x 400 Gb/s H100
    # nodes 190 of 200 (nccl #1368), NDR 46-49 of 50 GB/s per NIC (nccl-tests #290, #267),
    # 4 x HDR 86-96 of 100 (nccl-tests #175, #119) -> 0.92.
    nvlink_efficiency: float = Field(0.8, gt=0, le=1)
    network_efficiency: float = Field(0.92, gt=0, le=1)
    # Multiplies the per-step latencies of NCCL's own tuning model (network.py: base, NVLink-hop and
    # network-hop latency per protocol); 1 = NCCL's published table.
    latency_scale: float = Field(1.0, gt=0)
    # NCCL's per-step cost of posting a network send (tuning.cc getNetOverhead: 1 us on Intel hosts,
    # 2 us on AMD hosts; x3 for the Simple protocol). Set per device in hardware.yaml by its host CPU.
    net_overhead_s: float = Field(1e-6, ge=0)
    # Overlap ---------------------------------------------------------------------------------
    # Compute slowdown per second of hidden communication: NCCL kernels occupy SMs (its channels,
    # ~16-24 of 108-132 SMs) and HBM bandwidth while they overlap compute, so hiding is never free.
    # Measured: compute overlapped with collectives runs 18.9% slower on average (up to 40%) on
    # A100/H100 (Lee et al. 2025, arXiv 2507.03114); the overlapped compute lasts about as long as
    # the collective it hides, so ~0.19 s per second hidden.
    overlap_slowdown: float = Field(0.19, ge=0, le=1)
    # Power -------------------------------------------------------------------------------------
    # Power of a device that is only communicating or waiting, as a fraction of (TDP - idle).
    comm_power_fraction: float = Field(0.3, ge=0, le=1)


FIELDS = tuple(ModelParams.model_fields)
# Factors calibrate solves per precision from the reference steps of each (calibrate/
# reference_step.py). Where bf16 is emulated its kernels differ from fp32's in what a hot
# microbenchmark misses (GEMM layouts 10x apart, 2026-12-04) and in how long each rank computes
# between two TP all-reduces, which sets how long each waits for the slower one; the pipeline
# factor likewise (solved 20% apart between fp32 and emulated bf16 in one calibration, 2026-12-07,
# so a median for both left each precision's pipeline reference 9-11% off in sample). The profile
# keeps one value per field (the median over precisions, what `fit` refits) and, per precision,
# its ratio to it: calibration key `<field>_ratio_<precision>`.
PER_PRECISION = ("in_step_slowdown", "shared_node_slowdown", "tp_collective_overhead_s",
                 "pipeline_compute_factor")


def without_precision_ratios(calibration: dict) -> dict:
    """A calibration mapping less its per-precision ratios: what a new calibration starts from, so
    that none of an earlier one's ratios outlives the medians it was taken against."""
    stale = tuple(f"{name}_ratio_" for name in PER_PRECISION)
    return {k: v for k, v in calibration.items() if not k.startswith(stale)}


def precision_ratio(hw: HardwareProfile, name: str, precision: str) -> float:
    """What `name` is at `precision` relative to its profile-wide value (1 where not calibrated).
    0 is a calibrated value: an overhead solved at 0 for one precision and not for the other."""
    value = hw.calibration.get(f"{name}_ratio_{precision}")
    return float(value) if isinstance(value, (int, float)) and value >= 0 else 1.0


_BY_PROFILE: dict[int, tuple[HardwareProfile, ModelParams]] = {}


def params_for(hw: HardwareProfile, **overrides: float | bool) -> ModelParams:
    """Defaults overridden by the profile's scalar calibration entries of the same name."""
    if not overrides:  # the common call: one lookup per profile object (kept alive by the entry)
        hit = _BY_PROFILE.get(id(hw))
        if hit is not None and hit[0] is hw:
            return hit[1]
    chosen = {k: v for k, v in hw.calibration.items() if k in FIELDS}
    chosen.update(overrides)
    params = _cached(json.dumps(chosen, sort_keys=True))
    if not overrides and len(_BY_PROFILE) < 1024:
        _BY_PROFILE[id(hw)] = (hw, params)
    return params


@functools.lru_cache(maxsize=256)
def _cached(blob: str) -> ModelParams:
    return ModelParams(**json.loads(blob))
