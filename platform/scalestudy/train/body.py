"""The trial body: one trial on every rank of an initialised process group, with no Ray in it.

    summary = run_body(cfg, reporter)      # on each rank; rank 0 gets the summary, others None

build (model, DeepSpeed engine, this attempt's layout) -> warm-up steps -> timed window (after an
elastic resize: the new size's warm-up, then the rest of the window; train/segments.py) -> profiled
window -> one reduction across ranks -> rank 0's summary, handed to the reporter: a TrialSummary of
readings (train/summary.py), from which train/result.py derives every metric. The adapters start
the processes and the process group and say where checkpoints and the summary go: Ray Train
(launch/worker.py) or torchrun (train/local.py); both use train/process.py to set a rank up.

Nothing in the timed window syncs the host except the one device synchronisation that closes each
step's timer; losses stay on the device until the end. The profiled window comes after the timed
one, so profiling never perturbs throughput. Checkpoints (fault tolerance, elastic resizes) are taken
between steps, never inside one (train/resume.py).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from scalestudy.measure.devices import gather_node_devices
from scalestudy.measure.energy import NAN, EnergyReading
from scalestudy.measure.memory import memory_reading, reduce_memory_across_ranks, reset_peak
from scalestudy.measure.meters import MeterResult, TrialMeters
from scalestudy.measure.profiled_window import (ProfiledWindow, reduce_across_ranks,
                                               run_profiled_micro_batches)
from scalestudy.parallel.deepspeed_config import deepspeed_config
from scalestudy.parallel.layout import Layout
from scalestudy.spec.trial import TrialConfig
from scalestudy.train import resume, segments, timing
from scalestudy.train.checkpoint_store import StoredCheckpoint
from scalestudy.train.construct import build_trial_model, check_materialised
from scalestudy.train.data import global_batch, stage_window
from scalestudy.train.process import device_for, sync
from scalestudy.train.summary import MemoryPeaks, TrialSummary

SHARD_PROBES = ("layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight")


class Reporter(Protocol):
    """Where a trial's checkpoints and summary go (the adapter's side of the body)."""

    local_rank: int  # this rank's index on its node (its GPU, its energy meter's owner)
    keeps_checkpoints: bool  # False: fault tolerance has nowhere to resume from, so no saves

    def save_checkpoint(self, directory: str, step: int) -> None:
        """Every rank, with the directory it wrote its part of the checkpoint to."""

    def latest_checkpoint(self) -> AbstractContextManager[StoredCheckpoint | None]:
        """Where the checkpoint to resume from is stored, None on a fresh start."""

    def report_summary(self, summary: TrialSummary | None) -> None:
        """Every rank, once at the end: rank 0 with the summary, the others with None."""


@dataclass
class Trial:
    """One rank's built trial: what every window needs."""

    cfg: TrialConfig
    layout: Layout  # this attempt's: the trial's own, or an elastic trial's resized one
    engine: Any
    device: torch.device
    rank: int
    ds_config: dict[str, Any]
    # The timed window's micro-batches, on the device before it starts ({step: [micro-batch, ...]}):
    # the step timer then holds no host-to-device copy. Other steps build theirs in the step.
    staged: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    def stage(self, steps: range) -> None:
        cfg = self.cfg
        self.staged = stage_window(steps, self.device, self.layout, self.dp_rank, seq_len=cfg.seq_len,
                                   vocab_size=cfg.model_dims.vocab_size, seed=cfg.seed)

    def _ids(self, step: int, k: int) -> torch.Tensor:
        if step in self.staged:
            return self.staged[step][k]
        cfg, lay = self.cfg, self.layout
        batch = global_batch(step, lay.global_batch, cfg.seq_len, cfg.model_dims.vocab_size, cfg.seed)
        return batch[lay.batch_rows(k, self.dp_rank)].to(self.device)

    def micro_batch(self, step: int, k: int) -> torch.Tensor:
        """Forward, backward and engine step of micro-batch ``k`` of ``step``; its loss, on the device."""
        ids = self._ids(step, k)
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach().float()

    def step(self, step: int) -> torch.Tensor:
        """One optimizer step over the layout's micro-batches; the mean loss, left on the device."""
        total = torch.zeros((), device=self.device)
        for k in range(self.layout.grad_accum):
            total += self.micro_batch(step, k)
        return total / self.layout.grad_accum


def build(cfg: TrialConfig, device: torch.device) -> Trial:
    """Model and DeepSpeed engine at the layout of the world this attempt was given (an elastic
    trial may get another size than it asked for; the spec check made sure it divides). pp > 1:
    stages under a torch.distributed.pipelining schedule instead (train/pipeline_trial.py)."""
    if cfg.pp > 1:
        from scalestudy.train.pipeline_trial import build_pipeline_trial

        return build_pipeline_trial(cfg, device)
    import deepspeed

    layout = cfg.layout.resized(dist.get_world_size())
    ds_config = deepspeed_config(cfg, layout)
    model = build_trial_model(cfg, ds_config, device)  # partitioned or on meta, never whole in fp32
    timing.mark("model_built")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config)
    check_materialised(engine.module)  # AutoTP's shards are materialised inside initialize
    trial = Trial(cfg, layout, engine, device, dist.get_rank(), ds_config)
    if layout.tp > 1:
        _check_tp_group(trial)
    timing.mark("engine_ready")
    return trial


def _check_tp_group(trial: Trial) -> None:
    """DeepSpeed builds its own TP groups; refuse to measure if they differ from the layout's."""
    from deepspeed.utils import groups

    ours = trial.layout.group_of("tp", trial.rank)
    theirs = dist.get_process_group_ranks(groups.get_tensor_model_parallel_group())
    if sorted(theirs) != ours:
        raise RuntimeError(f"DeepSpeed TP group {theirs} differs from the layout's {ours}")


def make_meters(trial: Trial, instrument: bool) -> TrialMeters:
    """One energy meter and one utilization sampler per node, on the trial's own devices (CUDA
    UUIDs -> NVML handles, measure/devices.py), owned by the node's lowest rank (collective)."""
    node = gather_node_devices(trial.device)
    return TrialMeters(trial.cfg.hardware_profile.is_gpu, node, energy=instrument,
                       reason_off="instrumentation disabled for this run")


@dataclass
class Window:
    """The step loop's state across its windows: the loop state that checkpoints carry, this
    attempt's losses (restored floats, then device tensors) and where faults are injected."""

    state: resume.LoopState
    losses: list
    checkpoints: bool
    fault_step: int | None
    meters: TrialMeters | None = None  # running during the timed window; saves are cut out of it


def run_steps(trial: Trial, steps: range, w: Window, reporter: Reporter, timed: bool) -> None:
    """Steps of one window; after a step, the checkpoint that is due before the next one."""
    cfg = trial.cfg
    n_steps = w.state.end_step
    every = cfg.fault_tolerance.checkpoint_every
    for step in steps:
        if step == w.fault_step and w.state.restarts == 0:
            raise RuntimeError(f"injected fault at step {step} ({cfg.run_name})")
        sync(trial.device)
        t = time.perf_counter()
        w.losses.append(trial.step(step))
        sync(trial.device)
        if timed:
            w.state.step_times_s.append(time.perf_counter() - t)
        following = step + 1
        if w.checkpoints and following % every == 0 and following < n_steps:
            w.state.next_step, w.state.losses = following, [float(x) for x in w.losses]
            with w.meters.excluded() if timed and w.meters else nullcontext():
                resume.save(trial.engine, w.state, trial.rank, reporter)


def warmup_and_timed_window(trial: Trial, reporter: Reporter, meters: TrialMeters,
                            fault_step: int | None) -> Window:
    """Warm-up steps, then the timed window with the meters running (its batches staged on the
    device first); a restarted attempt resumes at its checkpoint's step, in whichever window that
    was."""
    cfg = trial.cfg
    checkpoints = resume.wants_checkpoints(cfg) and reporter.keeps_checkpoints
    world = trial.layout.world_size
    state = (resume.restore(trial.engine, world, reporter) if checkpoints
             else resume.LoopState(world_size=world))
    segments.begin(state, world, trial.layout.grad_accum, cfg.steps.warmup, cfg.steps.measure)
    w = Window(state, list(state.losses), checkpoints, fault_step)
    start, timed_from = state.next_step, state.timed_from
    run_steps(trial, range(start, timed_from), w, reporter, timed=False)
    timing.mark("warmed_up")
    timed = range(max(timed_from, start), state.end_step)
    trial.stage(timed)
    sync(trial.device)
    reset_peak(trial.device)
    w.meters = meters
    meters.start()
    if state.first_measured_wall is None:
        state.first_measured_wall = time.time()
    try:
        run_steps(trial, timed, w, reporter, timed=True)
        sync(trial.device)
    finally:  # a failing step (an injected fault) must not leave the samplers' threads running
        meters.stop()
    timing.mark("timed_window_done")
    trial.staged = {}
    return w


def profiled_window(trial: Trial) -> ProfiledWindow:
    """Communication and overlap from a profiled window after the timed one, reduced across ranks:
    whole steps run, their last micro-batches (at most MICRO_BATCH_CAP) are traced, each collective's
    bus bandwidth from its own group's size."""
    cfg = trial.cfg
    if cfg.pp > 1:  # a pipeline's schedule interleaves its micro-batches: whole steps are traced
        return trial.profiled(cfg.steps.warmup + cfg.steps.measure, cfg.steps.profile)
    pw = run_profiled_micro_batches(trial.micro_batch, trial.layout.grad_accum, device=trial.device,
                                    first_step=cfg.steps.warmup + cfg.steps.measure,
                                    n_steps=cfg.steps.profile)
    return reduce_across_ranks(pw, trial.device)


def _all_reduce(values: list[float], op, device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t


def reduce_meters(trial: Trial, w: Window, meters: TrialMeters) -> MeterResult:
    """The meters' readings of the timed window (collective): energy summed over the nodes'
    owners, GPU-only under NVML (its scope says what it covers); utilisation the mean over the
    trial's devices."""
    result = meters.reduce(trial.device)
    if w.state.restarts and result.energy.source != "none":
        result.energy = EnergyReading(NAN, 0.0, source="none",
                                      reason="trial restarted mid-window: the meter saw only part of it")
    return result


def reduce_steps(trial: Trial, w: Window) -> tuple[list[float], list[float], MemoryPeaks]:
    """One reduction after the windows: the slowest rank sets each step's time, losses average
    over the ranks that compute one (all; a pipeline's last-stage ranks), each memory figure is
    the fullest rank's."""
    device, world = trial.device, getattr(trial, "loss_ranks", dist.get_world_size())
    losses = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device) for x in w.losses])
    dist.all_reduce(losses, op=dist.ReduceOp.SUM)
    step_times = _all_reduce(w.state.step_times_s, dist.ReduceOp.MAX, device).cpu().tolist()
    memory = MemoryPeaks.of(reduce_memory_across_ranks(memory_reading(device), device))
    return step_times, (losses / world).cpu().tolist(), memory


def _gather_shard_shapes(module) -> list[dict[str, list[int]]]:
    """Per rank, the local shape of a column-split and a row-split weight (ZeRO-3 keeps the
    unpartitioned local shape in `ds_shape`)."""
    mine = {}
    for name, p in module.named_parameters():
        for probe in SHARD_PROBES:
            if name.endswith(probe):
                mine[probe] = list(getattr(p, "ds_shape", p.shape))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def summary_of(trial: Trial, w: Window, meters: MeterResult, profiled: ProfiledWindow | None,
               extra: dict[str, Any]) -> TrialSummary:
    """The trial's summary (collective: every rank builds it, rank 0's is reported)."""
    lay, state = trial.layout, w.state
    # A pipeline's stages, each with its rank's own memory peak, before the ranks' peaks are reduced.
    pipeline = (trial.reading(trial.timed, memory_reading(trial.device).allocated_gib)
                if trial.cfg.pp > 1 else None)
    step_times, losses, memory = reduce_steps(trial, w)
    return TrialSummary(
        step_times_s=step_times, losses=losses, memory=memory,
        world_size=lay.world_size, grad_accum=lay.grad_accum, segments=state.segments,
        restarts=state.restarts, time_lost_s=state.time_lost_s, restores=state.restores,
        first_measured_step_wall=state.first_measured_wall,
        meters=meters, profiled=profiled,
        shard_shapes=_gather_shard_shapes(trial.engine.module) if trial.engine is not None else [],
        deepspeed_config=trial.ds_config, pipeline=pipeline,
        timing=timing.marks(),  # rank 0's wall-clock marks of this trial (train/timing.py)
        **extra,
    )


def fault_step(spec: str | None, run_name: str) -> int | None:
    """'RUN_NAME@STEP' (or '*@STEP'), comma-separated -> STEP when one names this trial."""
    for item in (spec or "").split(","):
        name, _, step = item.partition("@")
        if item and name in (run_name, "*"):
            return int(step or 0)
    return None


def run_body(cfg: TrialConfig, reporter: Reporter, *, fault: str | None = None,
             instrument: bool = True) -> TrialSummary | None:
    """Run the trial on this rank (torch.distributed is up, see train/process.py). Every rank
    reports; rank 0 returns the summary, the others None. `fault` makes rank 0 raise at a step
    (the failure-path tests fail a real trial with it)."""
    trial = build(cfg, device_for(cfg, reporter.local_rank))
    meters = make_meters(trial, instrument)
    injected = fault_step(fault, cfg.run_name) if trial.rank == 0 else None
    w = warmup_and_timed_window(trial, reporter, meters, injected)
    meter_readings = reduce_meters(trial, w, meters)
    profiled = profiled_window(trial) if instrument and cfg.steps.profile else None
    timing.mark("windows_done")
    # An adapter may add what only it knows (the Ray adapter: each rank's node).
    summary = summary_of(trial, w, meter_readings, profiled, getattr(reporter, "summary_extra", {}))
    mine = summary if trial.rank == 0 else None
    reporter.report_summary(mine)
    return mine
