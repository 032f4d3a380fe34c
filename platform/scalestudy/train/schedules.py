"""A pipeline trial's training step: stages under a torch.distributed.pipelining schedule, the
gradients reduced over the data-parallel replicas of each stage, the optimizer, and the timestamps
the bubble is measured from.

    groups = process_groups(layout, device.type)        # every rank, collective
    trainer = PipelineTrainer(cfg, layout, device, groups)
    loss = trainer.step(step)                            # one optimizer step; this rank's loss
    reading = trainer.reading(timed_steps)               # collective: figures of the timed steps

Mechanism: torch.distributed.pipelining with the manual split of train/pipeline.py, as torchtitan
runs it. ``gpipe`` -> ScheduleGPipe, ``1f1b`` -> Schedule1F1B, ``interleaved_1f1b`` ->
ScheduleInterleaved1F1B over virtual_stages chunks per rank. Why not DeepSpeed: its PipelineEngine
runs one schedule (1F1B, no GPipe, no interleaving), needs the model rewritten as a PipelineModule of
LayerSpecs (not the Hugging Face model the other trials train), refuses ZeRO-2/3 and does not
compose with AutoTP; and a DeepSpeed engine per stage cannot sit under torch's schedules, which run
each micro-batch's backward themselves (torch.autograd.backward on the stage's outputs): the engine
never sees the backward that triggers its gradient accumulation boundary and ZeRO's reductions.
Tensor parallelism inside a stage is therefore torch's too (train/pipeline.py).
The loss goes to the schedule unscaled; the schedule divides the accumulated gradients by the
micro-batch count once, after the last backward (PipelineStage.scale_grads), and accumulates over
micro-batches itself: what DeepSpeed's gradient accumulation does for pp = 1.

Data parallelism across the dp replicas of a stage, after the schedule: train/stage_replicas.py.

Timestamps: every forward (with the loss on the last stage) and every backward of a micro-batch is
timed on its rank (TimedStage); the pipeline ranks align on a barrier before the schedule starts, so
a step's pipeline span is the latest rank's end, counted from each rank's own start. A rank's bubble
= span - its forward and backward time (fill, drain, waiting for a neighbour, and the p2p transfers
themselves, which on one host take a small share of it). p2p: bytes and operations from the send and
receive ops the stage hands the schedule, and the time the rank blocked waiting on them (which
includes waiting for the neighbour's compute: on a pipeline, the bubble).
"""

from __future__ import annotations

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

from scalestudy.parallel.layout import GRID_AXES, Layout
from scalestudy.train.data import rank_micro_batches
from scalestudy.train.pipeline import StageChunk, build_stages, causal_lm_loss, local
from scalestudy.train.pipeline_summary import PipelineReading, RankReading, pipeline_reading
from scalestudy.train.stage_replicas import ReplicaOptimizer

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


def _alive(mesh: Any) -> bool:
    """Whether every group of the mesh is still registered: a warm worker's end of trial
    (train/reentry.py) destroys the groups a trial made, and a mesh over destroyed groups fails
    with "Could not resolve the process group registered under the name ..." (measured: every
    pipeline trial after another on the same warm group failed so, before this check)."""
    registered = dist.distributed_c10d._world.pg_map
    try:  # the mesh keeps its groups by name; a destroyed one's name no longer resolves
        return all(mesh.get_group(a) in registered for a in GRID_AXES)
    except (RuntimeError, ValueError, KeyError):
        return False


def process_groups(layout: Layout, device_type: str) -> Groups:
    """The mesh ``arange(world).view(dp, pp, tp)`` (collective, every rank; one per layout shape and
    default group while its groups live, so a process's next trial of the same shape reuses it
    unless its groups were destroyed, as a warm worker's end of trial does), checked against the
    layout's own groups: the ranks that exchange activations, shards and gradients are the ones the
    performance model and the analysis place."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, layout.dp, layout.pp, layout.tp)
    default = dist.distributed_c10d._get_default_group()
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not default or not _alive(cached[1]):  # a new mesh
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


class ActivationTracker:
    """Bytes of activations a pipeline rank holds for its micro-batches' backwards: what autograd
    saves in each forward (parameters left out, each storage once per micro-batch), held from that
    forward to the end of the micro-batch's backward; ``peak_bytes`` is the most held at once. The
    memory a schedule decides (1F1B: pp micro-batches on the first stage, one on the last; GPipe:
    all m), read where the process's RSS cannot tell it from the allocator's retained heap. On
    while ``on`` (the trainer turns it off for timed steps: a Python hook per saved tensor)."""

    def __init__(self, params: list[torch.Tensor]):
        self.on = True
        self.params = {local(p).untyped_storage().data_ptr() for p in params}
        self.held: dict[tuple[int, int], int] = {}
        self.seen: dict[tuple[int, int], set[int]] = {}
        self.current: tuple[int, int] | None = None
        self.peak_bytes = 0

    def hooks(self, key: tuple[int, int]):
        """saved_tensors_hooks that count what micro-batch ``key`` (stage, mb) saves."""
        self.current = key
        self.held.setdefault(key, 0)
        seen = self.seen.setdefault(key, set())

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = local(t).untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.params and ptr not in seen:
                seen.add(ptr)
                self.held[key] += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, sum(self.held.values()))
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def released(self, key: tuple[int, int]) -> None:
        self.held.pop(key, None)
        self.seen.pop(key, None)


class TimedStage(PipelineStage):
    """A PipelineStage that records each micro-batch's forward and backward and counts its p2p
    ops and bytes into the trainer's current StepLog (and, while its tracker is on, the
    activations each micro-batch holds)."""

    def __init__(self, *args: Any, tracker: ActivationTracker, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.log: StepLog | None = None
        self.tracker = tracker

    def _span(self, kind: str, mb: int, t0: float) -> None:
        t1 = time.perf_counter()
        if self.log is not None:
            setattr(self.log, f"{kind}_s", getattr(self.log, f"{kind}_s") + t1 - t0)
            self.log.spans.append((kind, self.stage_index, mb, t0, t1))

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any):
        t0 = time.perf_counter()
        if self.tracker.on:
            with self.tracker.hooks((self.stage_index, fwd_chunk_id)):
                out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        else:
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._span("forward", fwd_chunk_id, t0)
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any):
        t0 = time.perf_counter()
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self.tracker.released((self.stage_index, bwd_chunk_id))
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
        params = [p for c in self.chunks for p in c.module.parameters()]
        self.tracker = ActivationTracker(params)
        self.stages = [TimedStage(c.module, c.index, n_stages, device, group=pp_group,
                                  tracker=self.tracker) for c in self.chunks]
        self.first = any(c.index == 0 for c in self.chunks)
        self.last = any(c.index == n_stages - 1 for c in self.chunks)
        loss = self._timed_loss(causal_lm_loss(cfg.model_dims.vocab_size))
        schedule = SCHEDULES[getattr(cfg.schedule, "value", cfg.schedule)]
        n = layout.grad_accum
        self.schedule = (schedule(self.stages, n, loss_fn=loss) if cfg.virtual_stages > 1
                         else schedule(self.stages[0], n, loss_fn=loss))
        self.optimizer = ReplicaOptimizer(params, cfg, groups.group("dp"), layout.dp, self.dp_rank)
        self.logs: dict[int, StepLog] = {}
        self._log: StepLog | None = None

    def _timed_loss(self, loss_fn):
        """The loss on the last stage, timed as part of that micro-batch's forward."""
        def timed(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            tracker = self.tracker
            if tracker.on and tracker.current is not None:  # the micro-batch just forwarded
                with tracker.hooks(tracker.current):
                    out = loss_fn(logits, labels)
            else:
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
            # return_outputs=False: the last stage would keep every micro-batch's logits to merge
            self.schedule.step(*args, return_outputs=False, **kwargs)
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
            peak_memory_gib=peak_memory_gib, activation_peak_gib=self.tracker.peak_bytes / 2**30)
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
    trainer.tracker.on = False  # the warm-up held what every step holds; no hooks in timed steps
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
