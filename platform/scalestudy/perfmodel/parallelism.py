"""The communication a parallel layout issues per optimizer step, and when in the schedule it runs.

Process groups come from one grid `arange(world).view(dp, pp, tp)` (tp innermost, as picotron and
Megatron): a tp group is tp consecutive ranks (inside a node when tp <= GPUs per node), pipeline
neighbours are tp ranks apart, a dp group strides tp * pp ranks.

Traffic (w = bytes of a 16-bit or fp32 weight/gradient, P = parameters held per tp rank and stage,
m = gradient-accumulation micro-batches, T = tokens per micro-batch):
  * ZeRO-0/1 (DDP-like): one gradient all_reduce of P*w per step, in buckets (DeepSpeed's
    reduce_bucket_size, 5e8 elements) during the LAST micro-batch's backward: all but the last bucket
    can overlap. ZeRO-1 then all_gathers the updated 16-bit weights after the optimizer step (blocking);
    ZeRO-0 needs nothing after the step.
  * ZeRO-2: gradients are reduce_scattered into their owner's partition during EVERY micro-batch's
    backward (DeepSpeed's partitioned-gradient path), plus the post-step all_gather of ZeRO-1.
  * ZeRO-3: every FSDP unit (one transformer block; embedding and head as one more) is all_gathered
    before its forward and again before its backward, and its gradients reduce_scattered after its
    backward, for EVERY micro-batch: gradient accumulation multiplies ZeRO-3 traffic by m. No post-step
    gather (weights stay sharded).
  * TP (Megatron, no sequence parallelism): two all_reduces of T*h activations per block in forward
    (after attention and after the MLP) and two in backward, plus two more per block when checkpointed
    activations are recomputed. They sit on the critical path: nothing overlaps them.
  * PP (1F1B): one send/recv of T*h activations forward and one of their gradients backward per
    micro-batch per stage boundary (Megatron's scatter/gather split sends 1/tp of it per tp rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scalestudy.perfmodel import network as net
from scalestudy.perfmodel.memory import params_per_device
from scalestudy.perfmodel.params import ModelParams
from scalestudy.spec.catalog import Precision
from scalestudy.spec.study import TrialConfig

REDUCE_BUCKET_ELEMENTS = 5e8  # DeepSpeed's default reduce_bucket_size

# When a collective runs, which decides how much of it compute can hide (see overlap.py).
FORWARD = "forward"        # overlaps the forward of every micro-batch (ZeRO-3 gathers)
BACKWARD = "backward"      # overlaps the backward of every micro-batch (ZeRO-3 / ZeRO-2 reductions)
LAST_BACKWARD = "last_backward"  # overlaps only the last micro-batch's backward (ZeRO-0/1 all_reduce)
BLOCKING = "blocking"      # on the critical path (TP all_reduces, pipeline send/recv, post-step gather)
AFTER_STEP = "after_step"  # after the optimizer, also blocking, once per step


@dataclass(frozen=True)
class Comm:
    kind: str
    phase: str
    calls_per_step: float
    bytes_per_call: float
    time_per_call_s: float
    chunk_s: float  # the part no schedule can hide (first gather / last bucket)

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
    dp_g = net.Group.of(cfg.layout, "dp")
    tp_g = net.Group.of(cfg.layout, "tp")
    out: list[Comm] = []

    def add(kind: str, phase: str, calls: float, size: float, group: net.Group,
            chunk_calls: float = 0.0) -> None:
        t = net.collective_time(kind, size, group, hw, p)
        if calls > 0 and t > 0:
            out.append(Comm(kind, phase, calls, size, t, chunk_calls * t))

    if cfg.dp > 1:
        if cfg.zero_stage == 3:
            unit = dims.layer_params() / cfg.tp * w
            ends = (held - layers * dims.layer_params() / cfg.tp) * w  # embedding/head unit(s)
            add(net.ALL_GATHER, FORWARD, m * layers, unit, dp_g, chunk_calls=1)
            add(net.ALL_GATHER, BACKWARD, m * layers, unit, dp_g, chunk_calls=0)
            add(net.REDUCE_SCATTER, BACKWARD, m * layers, unit, dp_g, chunk_calls=1)
            add(net.ALL_GATHER, FORWARD, 2 * m, ends, dp_g, chunk_calls=0)
            add(net.REDUCE_SCATTER, BACKWARD, m, ends, dp_g, chunk_calls=0)
        else:
            grad_bytes = held * w
            buckets = max(1, math.ceil(held / REDUCE_BUCKET_ELEMENTS))
            bucket = grad_bytes / buckets
            if cfg.zero_stage == 2:
                add(net.REDUCE_SCATTER, BACKWARD, m * buckets, bucket, dp_g, chunk_calls=1)
            else:
                add(net.ALL_REDUCE, LAST_BACKWARD, buckets, bucket, dp_g, chunk_calls=1)
            if cfg.zero_stage >= 1:
                add(net.ALL_GATHER, AFTER_STEP, 1, held * w, dp_g)
    if cfg.tp > 1:
        act = cfg.micro_batch * cfg.seq_len * dims.hidden_size * cfg.precision.bytes
        per_layer = 4 + (2 if cfg.activation_checkpointing else 0)
        add(net.ALL_REDUCE, BLOCKING, m * layers * per_layer, act, tp_g)
    if cfg.pp > 1:
        act = cfg.micro_batch * cfg.seq_len * dims.hidden_size * cfg.precision.bytes / cfg.tp
        crosses = cfg.tp * cfg.pp > g  # some stage boundary leaves the node
        pair = net.Group(2, 1, 2) if crosses else net.Group(2, 2, 1)
        add(net.SEND_RECV, BLOCKING, 2 * m, act, pair)
    return out


def by_kind(comms: list[Comm]) -> dict[str, tuple[float, float, float]]:
    """kind -> (calls, bytes, seconds) per step."""
    agg: dict[str, list[float]] = {}
    for c in comms:
        a = agg.setdefault(c.kind, [0.0, 0.0, 0.0])
        a[0] += c.calls_per_step
        a[1] += c.bytes
        a[2] += c.time_s
    return {k: (v[0], v[1], v[2]) for k, v in agg.items()}
