"""A pipeline trial's training step: stages under a torch.distributed.pipelining schedule, the
gradients reduced over the data-parallel replicas of each stage, the optimizer, and the timestamps
the bubble is measured from.

    groups = process_groups(layout, device.type)        # every rank, collective
    trainer = PipelineTrainer(cfg, layout, device, groups)
    loss = trainer.step(step)                            # one optimizer step; this rank's loss
    reading = trainer.reading(timed_steps)               # collective: figures of the timed steps

Mechanism (docs: why not DeepSpeed's PipelineEngine): torch.distributed.pipelining with the manual
split of train/pipeline.py, as torchtitan runs it. ``gpipe`` -> ScheduleGPipe, ``1f1b`` ->
Schedule1F1B, ``interleaved_1f1b`` -> ScheduleInterleaved1F1B over virtual_stages chunks per rank.
The loss goes to the schedule unscaled; the schedule divides the accumulated gradients by the
micro-batch count once, after the last backward (PipelineStage.scale_grads), and accumulates over
micro-batches itself: what DeepSpeed's gradient accumulation does for pp = 1.

Data parallelism across the dp replicas of a stage, after the schedule (torch's schedules run every
backward themselves, so nothing can hook DeepSpeed's boundary): the gradients of every local
parameter in one flat all_reduce over the dp group, divided by dp. ZeRO-0: every rank then steps
AdamW on all its parameters. ZeRO-1 (optimizer states sharded): each parameter belongs to one dp
rank (largest first to the least loaded, as ZeroRedundancyOptimizer assigns them), only its owner
keeps Adam's states and steps it, and each owner then broadcasts its updated parameters to the
group in one flat buffer: the all_gather of the updated weights that ZeRO-1 adds (a broadcast per
owner carries the same bytes). Written here rather than torch's ZeroRedundancyOptimizer because the
tensor-parallel shards are DTensors, which it does not flatten; this works on their local tensors.

Timestamps: every forward (with the loss on the last stage) and every backward of a micro-batch is
timed on its rank (TimedStage); the pipeline ranks align on a barrier before the schedule starts, so
a step's pipeline span is the latest rank's end, counted from each rank's own start. A rank's bubble
= span - its forward and backward time (fill, drain, waiting for a neighbour, and the p2p transfers
themselves, which on one host take a small share of it). p2p: bytes and operations from the send and
receive ops the stage hands the schedule, and the time the rank blocked waiting on them (which
includes waiting for the neighbour's compute: on a pipeline, the bubble).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)
from torch.distributed.pipelining import schedules as torch_schedules

from scalestudy.parallel.deepspeed_config import optimizer_config
from scalestudy.parallel.layout import GRID_AXES, Layout
from scalestudy.train.data import rank_micro_batches
from scalestudy.train.pipeline import StageChunk, build_stages, causal_lm_loss, local
from scalestudy.train.pipeline_summary import PipelineReading, RankReading, pipeline_reading

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved_1f1b": ScheduleInterleaved1F1B}


# --- process groups ---------------------------------------------------------------------------

@dataclass
class Groups:
    """This rank's dp, pp and tp process groups, from one device mesh over the layout's grid."""

    mesh: Any
    ranks: dict[str, list[int]]  # axis -> global ranks of this rank's group

    def group(self, axis: str) -> Any:
        return self.mesh.get_group(axis)


_MESHES: dict[tuple, Any] = {}


def process_groups(layout: Layout, device_type: str) -> Groups:
    """The mesh ``arange(world).view(dp, pp, tp)`` (collective, every rank; one per layout shape and
    default group, so a warm worker's next trial of the same shape reuses it), checked against the
    layout's own groups: the ranks that exchange activations, shards and gradients are the ones the
    performance model and the analysis place."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, layout.dp, layout.pp, layout.tp)
    default = dist.distributed_c10d._get_default_group()
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not default:  # a new process group: its own mesh
        cached = _MESHES[key] = (default, init_device_mesh(
            device_type, (layout.dp, layout.pp, layout.tp), mesh_dim_names=GRID_AXES))
    mesh = cached[1]
    rank = dist.get_rank()
    ranks = {a: dist.get_process_group_ranks(mesh.get_group(a)) for a in GRID_AXES}
    for axis in GRID_AXES:
        if ranks[axis] != layout.group_of(axis, rank):
            raise RuntimeError(f"{axis} group {ranks[axis]} of rank {rank} differs from the "
                               f"layout's {layout.group_of(axis, rank)}")
    return Groups(mesh, ranks)


# --- a stage that keeps time ------------------------------------------------------------------

@dataclass
class StepLog:
    """One rank's record of one optimizer step (seconds; ``end_s`` from the rank's aligned start)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    end_s: float = 0.0
    p2p_wait_s: float = 0.0
    p2p_ops: int = 0
    p2p_bytes: int = 0
    dp_comm_s: float = 0.0
    optimizer_s: float = 0.0
    spans: list[tuple[str, int, int, float, float]] = field(default_factory=list)  # kind, stage, mb, t0, t1

    @property
    def busy_s(self) -> float:
        return self.forward_s + self.backward_s


class TimedStage(PipelineStage):
    """A PipelineStage that records each micro-batch's forward and backward and counts its p2p
    ops and bytes into the trainer's current StepLog."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.log: StepLog | None = None

    def _span(self, kind: str, mb: int, t0: float) -> None:
        t1 = time.perf_counter()
        if self.log is not None:
            setattr(self.log, f"{kind}_s", getattr(self.log, f"{kind}_s") + t1 - t0)
            self.log.spans.append((kind, self.stage_index, mb, t0, t1))

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any):
        t0 = time.perf_counter()
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._span("forward", fwd_chunk_id, t0)
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any):
        t0 = time.perf_counter()
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._span("backward", bwd_chunk_id, t0)
        return out

    def _counted(self, ops: list) -> list:
        if self.log is not None:
            self.log.p2p_ops += len(ops)
            self.log.p2p_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        return self._counted(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        return self._counted(super().get_bwd_send_ops(bwd_chunk_id))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        return self._counted(super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        return self._counted(super().get_bwd_recv_ops(bwd_chunk_id))


@contextmanager
def _timed_p2p_waits(log: StepLog) -> Iterator[None]:
    """Time the schedule's p2p waits: every schedule waits on its send/recv works through the one
    module function torch_schedules._wait_batch_p2p, wrapped for the step (and restored)."""
    original = torch_schedules._wait_batch_p2p

    def timed(work: list) -> None:
        t0 = time.perf_counter()
        original(work)
        log.p2p_wait_s += time.perf_counter() - t0

    torch_schedules._wait_batch_p2p = timed
    try:
        yield
    finally:
        torch_schedules._wait_batch_p2p = original


# --- data parallelism across stage replicas ---------------------------------------------------

class ReplicaOptimizer:
    """AdamW over this rank's stage parameters with their gradients averaged over the dp group;
    ZeRO-1 shards Adam's states over it (module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: Any, dp_group: Any, dp_size: int,
                 dp_rank: int):
        self.params, self.group, self.dp, self.dp_rank = params, dp_group, dp_size, dp_rank
        self.zero1 = cfg.zero_stage == 1 and dp_size > 1
        self.owner = _owners(params, dp_size) if self.zero1 else [dp_rank] * len(params)
        mine = [p for p, o in zip(params, self.owner) if o == dp_rank]
        kwargs = {k: v for k, v in optimizer_config(cfg)["params"].items() if k != "torch_adam"}
        self.optimizer = torch.optim.AdamW(mine, **kwargs) if mine else None

    def reduce_gradients(self) -> None:
        """One flat all_reduce of every local gradient over the dp group, then / dp."""
        if self.dp == 1:
            return
        grads = [local(p.grad) for p in self.params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.dp)
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    def step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
        if self.zero1:
            self._gather_updated()
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def _gather_updated(self) -> None:
        """Each owner's updated parameters to the whole dp group, one flat broadcast per owner."""
        ranks = dist.get_process_group_ranks(self.group)
        for owner in range(self.dp):
            tensors = [local(p) for p, o in zip(self.params, self.owner) if o == owner]
            if not tensors:
                continue
            flat = torch._utils._flatten_dense_tensors(tensors)
            dist.broadcast(flat, src=ranks[owner], group=self.group)
            if owner != self.dp_rank:
                for t, new in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
                    t.copy_(new)


def _owners(params: list[torch.nn.Parameter], dp: int) -> list[int]:
    """The dp rank that keeps each parameter's optimizer states: largest first, to the least
    loaded rank (ties to the lowest), the same on every rank of the group."""
    load = [0] * dp
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-local(params[i]).numel(), i)):
        r = min(range(dp), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += local(params[i]).numel()
    return owner


# --- the trainer ------------------------------------------------------------------------------

class PipelineTrainer:
    """One rank's share of a pipeline trial: its stage chunks, the schedule, the replica optimizer
    and a StepLog per step run."""

    def __init__(self, cfg: Any, layout: Layout, device: torch.device, groups: Groups):
        self.cfg, self.layout, self.device, self.groups = cfg, layout, device, groups
        self.dp_rank, self.pp_rank, _ = layout.coords(dist.get_rank())
        tp_mesh = groups.mesh["tp"] if layout.tp > 1 else None
        self.chunks: list[StageChunk] = build_stages(cfg, device, self.pp_rank, tp_mesh)
        n_stages = layout.pp * cfg.virtual_stages
        pp_group = groups.group("pp")
        self.stages = [TimedStage(c.module, c.index, n_stages, device, group=pp_group)
                       for c in self.chunks]
        self.first = any(c.index == 0 for c in self.chunks)
        self.last = any(c.index == n_stages - 1 for c in self.chunks)
        loss = self._timed_loss(causal_lm_loss(cfg.model_dims.vocab_size))
        schedule = SCHEDULES[getattr(cfg.schedule, "value", cfg.schedule)]
        n = layout.grad_accum
        self.schedule = (schedule(self.stages, n, loss_fn=loss) if cfg.virtual_stages > 1
                         else schedule(self.stages[0], n, loss_fn=loss))
        params = [p for c in self.chunks for p in c.module.parameters()]
        self.optimizer = ReplicaOptimizer(params, cfg, groups.group("dp"), layout.dp, self.dp_rank)
        self.logs: dict[int, StepLog] = {}
        self._log: StepLog | None = None

    def _timed_loss(self, loss_fn):
        """The loss on the last stage, timed as part of that micro-batch's forward."""
        def timed(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            out = loss_fn(logits, labels)
            if self._log is not None:
                self._log.forward_s += time.perf_counter() - t0
            return out
        return timed

    def batch(self, step: int) -> torch.Tensor:
        """This dp rank's micro-batches of ``step``, one tensor (the schedule splits it in order)."""
        cfg = self.cfg
        mbs = rank_micro_batches(step, self.layout, self.dp_rank, seq_len=cfg.seq_len,
                                 vocab_size=cfg.model_dims.vocab_size, seed=cfg.seed)
        return torch.cat(mbs).to(self.device)

    def step(self, step: int, batch: torch.Tensor | None = None) -> torch.Tensor:
        """One optimizer step; this rank's loss (the mean over its pipeline's micro-batches on a
        last-stage rank, 0 elsewhere), left on the device."""
        ids = self.batch(step) if batch is None else batch
        log = self.logs[step] = StepLog()
        self._log = log
        for s in self.stages:
            s.log = log
        losses: list[torch.Tensor] = []
        dist.barrier(group=self.groups.group("pp"))  # the pipeline starts together: a common zero
        t0 = time.perf_counter()
        with _timed_p2p_waits(log):
            args = (ids,) if self.first else ()
            kwargs = {"target": ids, "losses": losses} if self.last else {}
            self.schedule.step(*args, **kwargs)
        t1 = time.perf_counter()
        self.optimizer.reduce_gradients()
        t2 = time.perf_counter()
        self.optimizer.step()
        log.end_s, log.dp_comm_s, log.optimizer_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        self._log = None
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([x.detach().float() for x in losses]).mean()

    def reading(self, steps: list[int] | range, peak_memory_gib: float = float("nan")
                ) -> PipelineReading:
        """The figures of ``steps`` (collective, every rank; train/pipeline_summary.py): each
        pipeline's span per step is its latest rank's end (a MAX over the pp group), then every
        rank's sums travel to all ranks."""
        logs = [self.logs[s] for s in steps]
        ends = torch.tensor([g.end_s for g in logs], dtype=torch.float64)
        dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=self.groups.group("pp"))
        mine = RankReading(
            rank=dist.get_rank(), pp_rank=self.pp_rank, steps=len(logs),
            blocks=sum(len(c.module.layer_ids) for c in self.chunks),
            forward_s=sum(g.forward_s for g in logs), backward_s=sum(g.backward_s for g in logs),
            span_s=float(ends.sum()), p2p_wait_s=sum(g.p2p_wait_s for g in logs),
            p2p_ops=sum(g.p2p_ops for g in logs), p2p_bytes=sum(g.p2p_bytes for g in logs),
            dp_comm_s=sum(g.dp_comm_s for g in logs), optimizer_s=sum(g.optimizer_s for g in logs),
            peak_memory_gib=peak_memory_gib)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine.model_dump())
        cfg = self.cfg
        return pipeline_reading([RankReading(**r) for r in everyone],
                                getattr(cfg.schedule, "value", cfg.schedule), cfg.virtual_stages,
                                self.layout.grad_accum)


def mean_losses(losses: list[torch.Tensor], layout: Layout, device: torch.device) -> list[float]:
    """Per step, the loss over the whole global batch (collective): the last-stage ranks' means
    (one per dp replica, the same on each of its tp ranks) averaged; the others contribute 0."""
    t = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device) for x in losses])
    dist.all_reduce(t)
    return (t / (layout.dp * layout.tp)).cpu().tolist()


def measure_steps(cfg: Any, device: torch.device, warmup: int, steps: int
                  ) -> tuple[list[float], PipelineReading]:
    """A pipeline trial's timed steps outside the trial body (calibration, validation): ``warmup``
    steps, then ``steps`` timed as the body times its own (the slowest rank's time of each), with
    the memory peak restarted before them. Collective, every rank; returns the step times and the
    pipeline's figures of the timed steps."""
    from scalestudy.measure.memory import memory_reading, reset_peak, reset_process_peak
    from scalestudy.train.process import sync

    trainer = PipelineTrainer(cfg, cfg.layout, device, process_groups(cfg.layout, device.type))
    for s in range(warmup):
        trainer.step(s)
    sync(device)
    reset_peak(device)
    if device.type == "cpu":
        reset_process_peak()
    times = []
    for s in range(warmup, warmup + steps):
        t = time.perf_counter()
        trainer.step(s)
        sync(device)
        times.append(time.perf_counter() - t)
    reading = trainer.reading(range(warmup, warmup + steps), memory_reading(device).allocated_gib)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist(), reading
