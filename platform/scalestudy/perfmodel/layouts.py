"""The layouts published runs use (issue 35): what sequence and context parallelism, selective
recomputation, overlapped TP communication and FP8 GEMMs change in a step. compute.py,
parallelism.py and overlap.py call these; memory_layouts.py holds their memory terms.

Physics and sources, one term each:
  * Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", Sec. 4.2.2): the norm, dropout and residual regions run on 1/tp of the
    sequence, so their HBM traffic divides by tp; each TP all-reduce of T*h activations becomes an
    all-gather before the column-parallel GEMMs and a reduce-scatter after the row-parallel ones:
    the same bus bytes (an all-reduce is a reduce-scatter plus an all-gather), two latencies.
  * Context parallelism (Megatron-Core's ring attention, Liu et al. 2023 "Ring Attention"; the
    load-balanced causal split of Megatron/Llama 3: each rank holds 2 of 2*cp chunks): a rank runs
    1/cp of the tokens through every GEMM and 1/cp of the causal attention work; per block the
    K and V chunks travel round the cp ring, cp - 1 point-to-point steps in forward and twice that
    traffic in backward (K, V and their gradients), each step overlapping the attention of the
    chunk in hand: exposed = max(0, p2p - attention) per block.
  * Selective recomputation (Korthikanti et al. 2022, Sec. 4.3): only the attention core (QK^T,
    softmax, AV) runs again before the backward: its forward FLOPs, not the block's.
  * TP communication overlap (Megatron-Core / Transformer Engine userbuffers: the all-gather and
    reduce-scatter of sequence-parallel TP split into chunks pipelined with the GEMM they feed,
    Wang et al. 2023 "Overlap communication with dependent computation via decomposition"): the TP
    collectives overlap the block's GEMMs; what exceeds them, and the first chunk, stay exposed,
    and the hidden part costs overlap_slowdown (params.py) in compute.
  * FP8 (Transformer Engine's recipe, Micikevicius et al. 2022 "FP8 Formats for Deep Learning"):
    the block's GEMMs run at the FP8 tensor-core peak (hardware.yaml: H100/H200 1,979 TFLOP/s
    dense) times gemm_efficiency; each GEMM's inputs are cast to FP8 first (read 2 bytes, write
    1, per element of the activation and of the weight) and read at 1 byte; attention, norms,
    the LM head and the optimizer stay bf16.
"""

from __future__ import annotations

import functools

from scalestudy.perfmodel import network as net
from scalestudy.spec.catalog import HardwareProfile, ModelDims
from scalestudy.spec.checks import FP8_PEAK_KEY
from scalestudy.spec.study import TrialConfig
from scalestudy.spec.trial import Backend, RecomputeGranularity

# Bytes through HBM per element to cast a bf16 operand to FP8 (read 2, write 1); TE fuses the amax
# it needs for the scale into the same kernel.
FP8_CAST_BYTES = 3.0


def local_tokens(cfg: TrialConfig) -> float:
    """Tokens one device runs through its GEMMs per micro-batch: a cp rank holds 1/cp of each
    sequence."""
    return float(cfg.seq_len * cfg.micro_batch) / cfg.cp


def fp8_peak_flops(hw: HardwareProfile) -> float:
    """The device's dense FP8 tensor-core peak (FLOP/s); 0 where it has none."""
    value = hw.calibration.get(FP8_PEAK_KEY)
    return float(value) * 1e12 if isinstance(value, (int, float)) else 0.0


def selective(cfg: TrialConfig) -> bool:
    return cfg.activation_checkpointing and (
        cfg.recompute_granularity is RecomputeGranularity.selective)


@functools.lru_cache(maxsize=1024)
def attention_share(dims: ModelDims, seq_len: int) -> float:
    """The attention core's share of a forward's model FLOPs per token (4*l*h*s of 2*N + 4*l*h*s,
    flops.py): what selective recomputation runs again, as a fraction of the forward."""
    from scalestudy.perfmodel.flops import matmul_params  # noqa: PLC0415 - flops imports nothing here

    attn = 4.0 * dims.num_layers * dims.hidden_size * seq_len
    return attn / (2.0 * matmul_params(dims) + attn)


def autotp(cfg: TrialConfig, p) -> bool:
    """Whether this trial's TP is DeepSpeed AutoTP's (params.tp_all_reduce_per_linear): a measured
    trial's always, whatever the profile prices by default (the catalogue's GPU profiles describe
    the published, Megatron-style runs)."""
    return bool(p.tp_all_reduce_per_linear) or cfg.backend == Backend.measure


def lm_head_split(cfg: TrialConfig, p) -> tuple[int, float]:
    """(ranks the LM head's GEMM is split over, vocabulary the loss runs over on each rank).
    Megatron: a vocab-parallel head and loss, 1/tp each. AutoTP in training (DeepSpeed 0.19.8,
    module_inject/auto_tp.py): an untied head is column-parallel with gather_output, so each rank
    computes vocab/tp logits, all-gathers them (parallelism.py) and runs the loss over the whole
    vocabulary; a head tied to the embedding is left whole on every rank ("leaving these modules
    replicated to preserve tied weights"). Checked with torchrun at tp 2 (2026-12-07): gpt2-tiny's
    tied OPT head stays a Linear (4096, 96), llama2-calib's becomes a LinearLayer (1536, 128)."""
    vocab = cfg.model_dims.vocab_size
    if cfg.tp == 1 or not autotp(cfg, p):
        return cfg.tp, vocab / cfg.tp
    return (1 if cfg.model_dims.lm_head_params() == 0 else cfg.tp), vocab


def tp_collectives(cfg: TrialConfig) -> tuple[tuple[str, float], ...]:
    """(kind, calls per TP all-reduce it replaces): with sequence parallelism each all-reduce is an
    all-gather and a reduce-scatter of the same buffer (bus bytes unchanged, two latencies)."""
    if cfg.sequence_parallel:
        return ((net.ALL_GATHER, 1.0), (net.REDUCE_SCATTER, 1.0))
    return ((net.ALL_REDUCE, 1.0),)


def cp_group(cfg: TrialConfig) -> net.Group:
    """The cp ring's placement: cp ranks next to the tp group (Megatron's rank order tp-cp-dp-pp),
    so inside one node while tp * cp fits in it."""
    per_node = cfg.hardware_profile.gpus_per_node
    if cfg.tp * cfg.cp <= per_node:
        return net.Group(cfg.cp, cfg.cp, 1)
    per = max(1, per_node // cfg.tp)
    return net.Group(cfg.cp, per, -(-cfg.cp // per))


def cp_exposed_s(cfg: TrialConfig, p, attention_f_s: float, attention_b_s: float
                 ) -> tuple[float, float, float]:
    """(exposed forward s, exposed backward s, total p2p s) of one micro-batch's ring attention on
    one device (module doc). A step's K/V chunk: micro_batch * seq_len / cp tokens of the K and V
    projections on this tp rank; the backward sends K, V and their gradients."""
    if cfg.cp == 1:
        return 0.0, 0.0, 0.0
    dims, hw = cfg.model_dims, cfg.hardware_profile
    g = cp_group(cfg)
    kv = 2.0 * local_tokens(cfg) * dims.kv_heads * dims.head_dim / cfg.tp * cfg.precision.bytes
    pair = net.Group(2, 2, 1) if g.m == 1 else net.Group(2, 1, 2)
    step = net.collective_time(net.SEND_RECV, kv, pair, hw, p)
    steps, layers = cfg.cp - 1, dims.num_layers // cfg.pp
    per_f = attention_f_s / layers / cfg.cp  # attention of one chunk, hiding one step
    per_b = attention_b_s / layers / cfg.cp
    exp_f = layers * steps * max(0.0, step - per_f)
    exp_b = layers * steps * max(0.0, 2 * step - per_b)
    return exp_f, exp_b, layers * steps * 3 * step


def with_layout_comms(cfg: TrialConfig, p, ct, comms: list) -> list:
    """The step's communication with the layout terms that need the compute times: the cp ring's
    point-to-point steps (exposed part blocking, the rest hidden behind attention) and, with
    tp_comm_overlap, the TP collectives split into the part their GEMMs hide and the part they do
    not (the first of tp chunks of each, and what exceeds the GEMMs), the hidden part's compute
    slowdown (params.overlap_slowdown) charged with the exposed one."""
    from scalestudy.perfmodel import parallelism as par  # noqa: PLC0415 - par imports this module

    out = list(comms)
    m = cfg.grad_accum
    if cfg.cp > 1:
        exp_f, exp_b, total = cp_exposed_s(cfg, p, ct.attention_forward_s, ct.attention_backward_s)
        exposed = exp_f + exp_b
        if total > 0:
            out.append(par.Comm(net.SEND_RECV, par.BLOCKING, m, 0.0, exposed, 0.0, "cp"))
            out.append(par.Comm(net.SEND_RECV, HIDDEN, m, 0.0, total - exposed, 0.0, "cp"))
    if cfg.tp_comm_overlap and cfg.tp > 1:
        tp = [c for c in out if c.group == "tp" and c.phase == par.BLOCKING]
        total = sum(c.time_s for c in tp) / m  # per micro-batch
        window = ct.gemm_forward_s * 3 + ct.recompute_s  # forward, backward (2x) and recompute GEMMs
        exposed = min(total, max(total / cfg.tp, total - window))
        out = [c for c in out if c not in tp]
        share = exposed / total if total > 0 else 0.0  # of every TP collective alike
        blocking = share + p.overlap_slowdown * (1 - share)
        for c in tp:
            out.append(c._replace(time_per_call_s=c.time_per_call_s * blocking, chunk_s=0.0))
            out.append(c._replace(phase=HIDDEN, chunk_s=0.0,
                                  time_per_call_s=c.time_per_call_s * (1 - blocking)))
    return out


# A phase overlap.py does not price: communication fully hidden behind compute (its cost, if any,
# is charged in a blocking entry beside it).
HIDDEN = "hidden"
