"""The communication a parallel layout issues per optimizer step, and when in the schedule it runs.

Process groups come from one grid `arange(world).view(dp, pp, tp)` (tp innermost, as picotron and
Megatron): a tp group is tp consecutive ranks (inside a node when tp <= GPUs per node), pipeline
neighbours are tp ranks apart, a dp group strides tp * pp ranks.

Traffic (w = bytes of a 16-bit or fp32 weight/gradient, P = parameters held per tp rank and stage,
m = gradient-accumulation micro-batches, T = tokens per micro-batch):
  * ZeRO-0/1 (DDP-like): one gradient all_reduce of P*w per step, in buckets (DeepSpeed's
    reduce_bucket_size, 5e8 elements). ZeRO-1 (overlap_comm, as the trial's DeepSpeed config sets it)
    reduces during the LAST micro-batch's backward: all but the last bucket can overlap; it then
    all_gathers the updated 16-bit weights after the optimizer step (blocking). ZeRO-0 runs as
    DeepSpeed's engine runs it: allreduce_gradients() once the last backward has returned, nothing
    to hide it behind (engine.backward at the accumulation boundary).
  * ZeRO-2: gradients are reduce_scattered into their owner's partition during EVERY micro-batch's
    backward (DeepSpeed's partitioned-gradient path), plus the post-step all_gather of ZeRO-1.
  * ZeRO-3: DeepSpeed's per-module gathers and bucketed gradient reduce_scatters, every
    micro-batch (zero3.py says which, how big and when): two gathers of nearly every weight and one
    reduction per micro-batch, so gradient accumulation multiplies ZeRO-3 traffic by m. No
    post-step gather (weights stay sharded). gather_granularity block: FSDP's one gather and one
    reduce_scatter per transformer block instead (_block_plan).
  * TP (Megatron; with sequence parallelism each all_reduce is an all_gather and a reduce_scatter of
    the same buffer, layouts.py; overlapped with tp_comm_overlap, predict.simulate): two all_reduces
    of T*h activations per block in forward
    (after attention and after the MLP) and two in backward, plus two more per block when checkpointed
    activations are recomputed (times params.recompute_fraction for selective schemes). They sit on
    the critical path: nothing overlaps them. DeepSpeed AutoTP (params.tp_all_reduce_per_linear,
    and every trial of the measure backend: this platform's trials run AutoTP) all-reduces in
    backward once per column-parallel Linear instead (COLUMN_PARALLEL_LINEARS).
  * PP: every micro-batch's T*h activation crosses each of the pp * V - 1 stage boundaries
    forward and its gradient backward; a rank blocks on a send or a receive of each crossing it
    takes part in, 4m(pp * V - 1)/pp per step on the mean rank (p2p_ops_per_rank). Megatron's
    scatter/gather sends 1/tp of it per tp rank, the measured pipeline the whole; V chunks per rank
    under the interleaved schedule (the trial's virtual_stages, else the profile's).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from scalestudy.perfmodel import layouts
from scalestudy.perfmodel import network as net
from scalestudy.perfmodel import zero3 as z3
from scalestudy.perfmodel.compute import ComputeTimes
from scalestudy.perfmodel.memory import params_per_device
from scalestudy.perfmodel.params import ModelParams, precision_ratio
from scalestudy.spec.catalog import ModelDims, Precision
from scalestudy.spec.study import TrialConfig
from scalestudy.spec.trial import Backend, GatherGranularity

# Column-parallel Linears per block as AutoTP shards the Hugging Face modules (HF Llama: q, k, v,
# gate, up; the "gpt" blocks are built as HF OPT: q, k, v, fc1): each all-reduces its input's
# gradient in backward under DeepSpeed AutoTP.
COLUMN_PARALLEL_LINEARS = {"llama": 5, "gpt": 4}

REDUCE_BUCKET_ELEMENTS = 5e8  # DeepSpeed's default reduce_bucket_size

# When a collective runs, which decides how much of it compute can hide (see overlap.py).
FORWARD = "forward"        # overlaps the forward of every micro-batch (ZeRO-3 gathers)
BACKWARD = "backward"      # overlaps the backward of every micro-batch (ZeRO-3 / ZeRO-2 reductions)
LAST_BACKWARD = "last_backward"  # overlaps only the last micro-batch's backward (ZeRO-0/1 all_reduce)
BLOCKING = "blocking"      # on the critical path (TP all_reduces, pipeline send/recv, post-step gather)
AFTER_STEP = "after_step"  # after the optimizer, also blocking, once per step


class Comm(NamedTuple):
    """One kind of call in one phase (a NamedTuple: a prediction builds a dozen)."""

    kind: str
    phase: str
    calls_per_step: float
    bytes_per_call: float
    time_per_call_s: float
    chunk_s: float  # the part no schedule can hide (first gather / last bucket)
    group: str = "dp"  # dp | tp | pp: collectives of one group run one after another
    floor_per_call_s: float = 0.0  # its bytes over the slowest link it crosses (network.link_floor_s)

    @property
    def time_s(self) -> float:
        return self.calls_per_step * self.time_per_call_s

    @property
    def bytes(self) -> float:
        return self.calls_per_step * self.bytes_per_call


def communication(cfg: TrialConfig, p: ModelParams) -> list[Comm]:
    hw, dims = cfg.hardware_profile, cfg.model_dims
    g = hw.gpus_per_node
    w = 4 if cfg.precision is Precision.fp32 else 2
    m, layers = cfg.grad_accum, dims.num_layers // cfg.pp
    held = params_per_device(dims, cfg.tp, cfg.pp)  # per tp rank, largest stage, before ZeRO
    dp_g = net.Group.along(cfg, "dp")
    tp_g = net.Group.along(cfg, "tp")
    out: list[Comm] = []

    def add(kind: str, phase: str, calls: float, size: float, group: net.Group,
            chunk_calls: float = 0.0, name: str = "dp", extra_s: float = 0.0) -> None:
        t = net.collective_time(kind, size, group, hw, p) + extra_s
        if calls > 0 and t > 0:
            floor = net.link_floor_s(kind, size, group, hw)
            out.append(Comm(kind, phase, calls, size, t, chunk_calls * t, name, floor))

    if cfg.dp > 1:
        if cfg.zero_stage == 3:
            for kind, phase, calls, size, secs in _zero3_calls(cfg, p, dp_g, w):
                out.append(Comm(kind, phase, m * calls, size, secs, 0.0, "dp",
                                net.link_floor_s(kind, size, dp_g, hw)))
        else:
            grad_bytes = held * w
            buckets = max(1, math.ceil(held / REDUCE_BUCKET_ELEMENTS))
            bucket = grad_bytes / buckets
            if cfg.zero_stage == 2:
                add(net.REDUCE_SCATTER, BACKWARD, m * buckets, bucket, dp_g, chunk_calls=1)
            elif cfg.zero_stage == 1:
                add(net.ALL_REDUCE, LAST_BACKWARD, buckets, bucket, dp_g, chunk_calls=1)
            else:  # DeepSpeed's engine all-reduces ZeRO-0 gradients after the backward returns
                add(net.ALL_REDUCE, AFTER_STEP, buckets, bucket, dp_g)
            if cfg.zero_stage >= 1:
                add(net.ALL_GATHER, AFTER_STEP, 1, held * w, dp_g)
    if cfg.tp > 1:
        act = layouts.local_tokens(cfg) * dims.hidden_size * cfg.precision.bytes
        autotp = layouts.autotp(cfg, p)
        backward = COLUMN_PARALLEL_LINEARS[dims.architecture] if autotp else 2
        # Full recomputation reruns the block's two forward collectives; selective recomputation
        # reruns the attention core only, inside the TP region, with none (layouts.py).
        redo = 2 * p.recompute_fraction if cfg.activation_checkpointing else 0
        redo = 0 if layouts.selective(cfg) else redo
        per_layer = 2 + backward + redo
        extra_s = p.tp_collective_overhead_s * precision_ratio(
            cfg.hardware_profile, "tp_collective_overhead_s", cfg.precision.value)
        for kind, calls in layouts.tp_collectives(cfg):  # sequence parallelism: AG + RS
            add(kind, BLOCKING, m * layers * per_layer * calls, act, tp_g, name="tp",
                extra_s=extra_s)
        if autotp and layouts.lm_head_split(cfg, p)[0] > 1:  # AutoTP's gathered LM head
            logits = layouts.local_tokens(cfg) * dims.vocab_size * cfg.precision.bytes
            add(net.ALL_GATHER, BLOCKING, m, logits, tp_g, name="tp", extra_s=extra_s)
            add(net.ALL_REDUCE, BLOCKING, m, act, tp_g, name="tp", extra_s=extra_s)  # its input grad
    if cfg.pp > 1:
        act = layouts.local_tokens(cfg) * dims.hidden_size * cfg.precision.bytes
        # Megatron splits each boundary's activation over the tp ranks (scatter/gather); the
        # measured pipeline (train/pipeline.py) sends every tp rank's whole, replicated copy.
        act = act if cfg.backend == Backend.measure else act / cfg.tp
        crosses = cfg.tp * cfg.pp > g  # some stage boundary leaves the node
        pair = net.Group(2, 1, 2) if crosses else net.Group(2, 2, 1)
        add(net.SEND_RECV, BLOCKING, p2p_ops_per_rank(cfg, p), act, pair, name="pp")
    return out


def virtual_stages(cfg: TrialConfig, p: ModelParams) -> int:
    """Chunks per pipeline rank: the trial's own (interleaved_1f1b), else the profile's
    pipeline_virtual_stages (a published run's interleaving, params.py)."""
    return cfg.virtual_stages if cfg.virtual_stages > 1 else p.pipeline_virtual_stages


def p2p_ops_per_rank(cfg: TrialConfig, p: ModelParams) -> float:
    """Sends and receives a pipeline rank blocks on per step, the mean over ranks: each of the
    pp * V - 1 stage boundaries is crossed by every micro-batch's activation (forward) and its
    gradient (backward), each a send on one rank and a receive on the next. At pp = 2, V = 1: 2m
    (the count this model always used); a middle rank posts 4m, the end ranks 2m."""
    boundaries = cfg.pp * virtual_stages(cfg, p) - 1
    return 4.0 * cfg.grad_accum * boundaries / cfg.pp


def pipeline_blocks(cfg: TrialConfig) -> tuple[int, ...] | None:
    """Transformer blocks of each pipeline rank (its chunks together; the last rank runs the LM
    head), None without a pipeline: what overlap.step_time weighs the stages by."""
    if cfg.pp == 1:
        return None
    counts = cfg.stage_layers
    return tuple(sum(counts[r::cfg.pp]) for r in range(cfg.pp))


def by_kind(comms: list[Comm]) -> dict[str, tuple[float, float, float]]:
    """kind -> (calls, bytes, seconds) per step."""
    agg: dict[str, list[float]] = {}
    for c in comms:
        a = agg.setdefault(c.kind, [0.0, 0.0, 0.0])
        a[0] += c.calls_per_step
        a[1] += c.bytes
        a[2] += c.time_s
    return {k: (v[0], v[1], v[2]) for k, v in agg.items()}


# ZeRO-3 ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Zero3Plan:
    """What DeepSpeed gathers on this stage per micro-batch (elements per tp rank, see zero3.py)."""

    groups: tuple[float, ...]  # one block's gather groups, in forward order
    layers: int
    emb: float        # embedding, gathered before the forward
    head: float       # gathered before the LM head (a tied head gathers the embedding again)
    emb_again: float  # embedding gathered again at the end of the backward
    keep: int         # last blocks the backward reuses without gathering
    reduced: float    # gradient elements reduce_scattered
    # Per-block gathers (FSDP, gather_granularity block): elements each block reduce_scatters
    # once its backward is done (0: DeepSpeed's buckets), and the prefetch window in elements.
    block_reduce: float = 0.0
    max_live: float = z3.MAX_LIVE


def _plan(cfg: TrialConfig, p: ModelParams) -> _Zero3Plan:
    block = cfg.gather_granularity is GatherGranularity.block
    return _plan_of(cfg.model_dims, cfg.tp, cfg.pp, block, layouts.autotp(cfg, p))


@functools.lru_cache(maxsize=1024)
def _plan_of(dims: ModelDims, tp: int, pp: int, block: bool = False,
             autotp: bool = False) -> _Zero3Plan:
    layers = dims.num_layers // pp
    if block:
        return _block_plan(dims, tp, pp, layers)
    groups = z3.gather_groups(z3.block_weights(dims, tp))
    blocks = layers * sum(groups)
    big = z3.PERSISTENCE_THRESHOLD
    # AutoTP keeps the embedding, and a head tied to it, whole on every tp rank (layouts.lm_head_split);
    # Megatron splits both over the vocabulary.
    whole = 1 if autotp else tp
    emb = dims.embedding_params() / whole
    emb = emb if emb > big else 0.0  # the first stage holds the embedding (params_per_device)
    tied = dims.lm_head_params() == 0
    head = dims.vocab_size * dims.hidden_size / whole if tied else dims.lm_head_params() / tp
    head = head if head > big and pp == 1 else 0.0
    if tied and blocks <= z3.MAX_REUSE_DISTANCE:
        head = 0.0  # the embedding weight is still gathered when the tied head runs
    emb_again = emb if 2 * (blocks + emb) > z3.MAX_REUSE_DISTANCE else 0.0
    keep = z3.retained_blocks(sum(groups), head, layers)
    reduced = params_per_device(dims, tp, pp)  # every gradient, persistent parameters' too
    return _Zero3Plan(groups, layers, emb, head, emb_again, keep, reduced)


def _block_plan(dims: ModelDims, tp: int, pp: int, layers: int) -> _Zero3Plan:
    """FSDP's gathers (issue 35, item 4). FSDP wraps every transformer block as one unit with one
    flat parameter (torchtitan: fully_shard per block, then the root; llm-foundry and fms-fsdp: the
    block class as the auto-wrap policy), so each gather is one whole block, norms included; the
    root unit (embedding, final norm, LM head) is gathered before the forward and again for the
    backward. The next unit's gather is issued while this one computes and no earlier (FSDP1's
    limit_all_gathers and BACKWARD_PRE prefetch, FSDP2's one-unit prefetch): a window of two
    blocks. After its backward each block reduce-scatters its own gradient. The last block is not
    resharded before its backward (torchtitan's reshard_after_forward=False for it), the others
    are gathered again: in the recompute forward under checkpointing, else in the backward."""
    block = dims.layer_params() / tp
    root = (dims.embedding_params() + dims.lm_head_params() + dims.hidden_size) / tp
    root = root if pp == 1 else max(dims.embedding_params(), dims.lm_head_params()) / tp
    reduced = params_per_device(dims, tp, pp)
    return _Zero3Plan((block,), layers, root, 0.0, root, min(1, layers), reduced,
                      block_reduce=block, max_live=2 * block * (1 + 1e-9))


def _bucket(plan: _Zero3Plan) -> float:
    return min(z3.REDUCE_BUCKET, plan.reduced) or 1.0


def _zero3_calls(cfg: TrialConfig, p: ModelParams, g: net.Group, w: int):
    """(kind, phase, calls per micro-batch, bytes per call, seconds per call) of ZeRO-3's traffic,
    grouped by call size (one gather per prefetch group, see zero3.py)."""
    hw, plan = cfg.hardware_profile, _plan(cfg, p)
    calls: dict[float, list[float]] = {}
    for numel in plan.groups:
        calls.setdefault(numel, [0.0, 0.0])[0] += plan.layers
        calls[numel][1] += plan.layers - plan.keep
    for numel, fwd, bwd in ((plan.emb, 1.0, 0.0), (plan.head, 1.0, 0.0), (plan.emb_again, 0.0, 1.0)):
        if numel:
            calls.setdefault(numel, [0.0, 0.0])[0] += fwd
            calls[numel][1] += bwd
    out = []
    for numel, (fwd, bwd) in calls.items():
        t = net.collective_time(net.ALL_GATHER, numel * w, g, hw, p)
        out += [(net.ALL_GATHER, FORWARD, fwd, numel * w, t),
                (net.ALL_GATHER, BACKWARD, bwd, numel * w, t)]
    bucket = plan.block_reduce or _bucket(plan)
    t = net.collective_time(net.REDUCE_SCATTER, bucket * w, g, hw, p)
    out.append((net.REDUCE_SCATTER, BACKWARD, plan.reduced / bucket, bucket * w, t))
    return [c for c in out if c[2] > 0 and c[4] > 0]


@dataclass(frozen=True)
class Zero3Phases:
    """One micro-batch of ZeRO-3 on one device: wall seconds of each phase (compute, and the gathers
    and reductions the compute stream waits for) and the communication each phase issued."""

    forward_s: float
    backward_s: float
    forward_comm_s: float
    backward_comm_s: float


def _units(cfg: TrialConfig, p: ModelParams, ct: ComputeTimes, plan: _Zero3Plan, w: int):
    hw = cfg.hardware_profile
    g = net.Group.along(cfg, "dp")

    def gather(numel: float) -> float:
        return net.collective_time(net.ALL_GATHER, numel * w, g, hw, p) if numel else 0.0

    block = sum(plan.groups)
    groups = plan.groups or (0.0,)
    share = [n / block if block else 1.0 for n in groups]
    fwd = tuple(z3.Unit(ct.block_forward_s * s, gather(n), n) for s, n in zip(share, groups))
    bwd = tuple(z3.Unit(ct.block_backward_s * s, 0.0, n) for s, n in zip(share, groups))[::-1]
    bucket = _bucket(plan)
    per_elem = net.collective_time(net.REDUCE_SCATTER, bucket * w, g, hw, p) / bucket
    return gather, fwd, bwd, per_elem


def zero3_phases(cfg: TrialConfig, p: ModelParams, ct: ComputeTimes) -> Zero3Phases:
    w = 4 if cfg.precision is Precision.fp32 else 2
    plan = _plan(cfg, p)
    gather, fwd, bwd, per_elem = _units(cfg, p, ct, plan, w)
    layers, block = plan.layers, sum(plan.groups)
    # Reductions: amortised per block when the model fills several buckets; otherwise one bucket,
    # flushed when the backward ends (stage3's gradient epilogue).
    many = plan.reduced > z3.REDUCE_BUCKET
    rs_block = per_elem * plan.reduced / layers if many else 0.0  # persistent ones ride along
    rs_end = 0.0 if many else per_elem * plan.reduced
    if plan.block_reduce:  # FSDP: each block's own reduce_scatter, the root's at the end
        g = net.Group.along(cfg, "dp")
        rs_block = net.collective_time(net.REDUCE_SCATTER, plan.block_reduce * w, g,
                                       cfg.hardware_profile, p)
        rs_end = net.collective_time(net.REDUCE_SCATTER, plan.emb * w, g, cfg.hardware_profile, p)
    # The recompute forward's share of a block's forward (selective: the attention core only).
    redo_share = p.recompute_fraction
    if layouts.selective(cfg) and ct.block_forward_s:
        redo_share = ct.recompute_s / (layers * ct.block_forward_s)

    def bwd_block(regather: bool) -> tuple[z3.Unit, ...]:
        if cfg.activation_checkpointing:  # recompute gathers; the backward then reuses them
            k = redo_share
            redo = tuple(z3.Unit(k * u.compute_s, u.gather_s if regather else 0.0, u.numel)
                         for u in fwd)
            back = bwd
        else:
            redo = ()
            back = tuple(z3.Unit(u.compute_s, gather(u.numel) if regather else 0.0, u.numel)
                         for u in bwd)
        last = back[-1]
        return redo + back[:-1] + (z3.Unit(last.compute_s, last.gather_s, last.numel, rs_block),)

    out_f = max(0.0, ct.forward_s - layers * ct.block_forward_s)
    out_b = max(0.0, ct.backward_s - layers * ct.block_backward_s)
    forward = (((z3.Unit(0.0, gather(plan.emb), plan.emb),), 1), (fwd, layers),
               ((z3.Unit(out_f, gather(plan.head), plan.head),), 1))
    backward = (((z3.Unit(out_b, 0.0, plan.head),), 1), (bwd_block(False), plan.keep),
                (bwd_block(True), layers - plan.keep),
                ((z3.Unit(0.0, gather(plan.emb_again), plan.emb_again, rs_end),), 1))
    f_s, f_comm, _ = z3.run_phase(forward, p.zero3_prefetch, plan.max_live)
    b_s, b_comm, _ = z3.run_phase(backward, p.zero3_prefetch, plan.max_live)
    return Zero3Phases(f_s, b_s, f_comm, b_comm)
