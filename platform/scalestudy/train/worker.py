"""The per-worker training loop that Ray Train runs in every rank.

Warm-up steps, then the timed window. Nothing in the timed window syncs the host except the one
device synchronisation that closes each step's timer; losses stay on the device until the end.
Rank 0 reports one summary, reduced across ranks, through a checkpoint (Ray Train v2 only returns
metrics that came with a checkpoint).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

SUMMARY_FILE = "summary.json"


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _mean_over_ranks(value: float, device) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item()) / dist.get_world_size()


def _check_tp_group(grid, rank: int) -> None:
    """DeepSpeed builds its own TP groups; refuse to measure if they differ from our grid."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    ours = next(g for g in grid.tp_groups() if rank in g)
    theirs = dist.get_process_group_ranks(groups.get_tensor_model_parallel_group())
    if sorted(theirs) != ours:
        raise RuntimeError(f"DeepSpeed TP group {theirs} differs from the grid's {ours}")


SHARD_PROBES = ("layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight")


def _gather_shard_shapes(module) -> list[dict[str, list[int]]]:
    """Per rank, the local shape of a column-split and a row-split weight (ZeRO-3 keeps the
    unpartitioned local shape in `ds_shape`)."""
    import torch.distributed as dist

    mine = {}
    for name, p in module.named_parameters():
        for probe in SHARD_PROBES:
            if name.endswith(probe):
                mine[probe] = list(getattr(p, "ds_shape", p.shape))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _fault_step(spec: str | None, run_name: str) -> int | None:
    """'RUN_NAME@STEP' (or '*@STEP') -> STEP when it names this trial."""
    if not spec:
        return None
    for item in spec.split(","):
        name, _, step = item.partition("@")
        if name in (run_name, "*"):
            return int(step or 0)
    return None


def train_loop_per_worker(config: dict[str, Any]) -> None:
    from scalestudy.spec.study import TrialConfig
    from scalestudy.train.host_memory import retain_freed_memory

    cfg = TrialConfig.model_validate(config["trial"])
    if cfg.hardware_profile.kind == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        retain_freed_memory()

    import deepspeed
    import ray.train
    import torch
    import torch.distributed as dist

    from scalestudy.measure.energy import (EnergyReading, NoMeter, make_meter,
                                          reduce_energy_across_ranks)
    from scalestudy.measure.memory import peak_memory_gib, reset_peak
    from scalestudy.measure.profiled_window import reduce_across_ranks, run_profiled_window
    from scalestudy.measure.utilization import make_utilization
    from scalestudy.parallel.deepspeed_config import deepspeed_config
    from scalestudy.parallel.degrees import derive_degrees
    from scalestudy.parallel.grid import ProcessGrid
    from scalestudy.train.data import global_batch, micro_batch_slice
    from scalestudy.train import resume
    from scalestudy.train.model_factory import build_model

    backend = "nccl" if cfg.hardware_profile.kind == "gpu" else "gloo"
    deepspeed.init_distributed(dist_backend=backend)
    rank = dist.get_rank()
    if backend == "nccl":
        device = torch.device("cuda", ray.train.get_context().get_local_rank())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # one core per worker: the cpu-local "device"

    # The layout of the world Ray Train gave this attempt: the trial's own, or for an elastic trial
    # another size at the same global batch (the spec check made sure it divides).
    world = dist.get_world_size()
    ran = derive_degrees(world, cfg.tp, cfg.pp, cfg.micro_batch, cfg.global_batch)
    dp, grad_accum = ran.dp, ran.grad_accum
    ds_config = deepspeed_config(cfg.model_copy(update={"grad_accum": grad_accum}))
    model = build_model(cfg.model_dims, cfg.seed, cfg.activation_checkpointing)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    grid = ProcessGrid(world, cfg.tp, cfg.pp)
    dp_rank = grid.coords(rank)[0]
    if cfg.tp > 1:
        _check_tp_group(grid, rank)

    def one_step(step: int) -> torch.Tensor:
        batch = global_batch(step, cfg.global_batch, cfg.seq_len, cfg.model_dims.vocab_size, cfg.seed)
        total = torch.zeros((), device=device)
        for k in range(grad_accum):
            ids = micro_batch_slice(batch, k, dp_rank, dp, cfg.micro_batch).to(device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        return total / grad_accum

    fault_step = _fault_step(config.get("fault"), cfg.run_name) if rank == 0 else None
    instrument = config.get("instrument", True)
    local_rank = ray.train.get_context().get_local_rank()
    meter = (make_meter(cfg.hardware_profile.kind, local_rank=local_rank) if instrument
             else NoMeter("instrumentation disabled for this run"))
    util = make_utilization(cfg.hardware_profile.kind)

    n_steps = cfg.steps.warmup + cfg.steps.measure
    checkpoints = resume.wants_checkpoints(cfg)
    state = resume.restore(engine, world) if checkpoints else resume.LoopState(world_size=world)
    start = state.next_step
    losses: list = list(state.losses)  # restored floats, then this attempt's device tensors
    for step in range(start, n_steps):
        if checkpoints and step > start and step % cfg.fault_tolerance.checkpoint_every == 0:
            state.next_step, state.losses = step, [float(x) for x in losses]
            resume.save(engine, state, rank)
        if step == max(cfg.steps.warmup, start):
            reset_peak()
            if state.first_measured_wall is None:
                state.first_measured_wall = time.time()
            # Counters are read once at each end of the window: nothing runs inside it.
            meter.start()
            util.start()
        if step == fault_step and state.restarts == 0:
            raise RuntimeError(f"injected fault at step {step} ({cfg.run_name})")
        _sync(device)
        t = time.perf_counter()
        losses.append(one_step(step))
        _sync(device)
        if step >= cfg.steps.warmup:
            state.step_times_s.append(time.perf_counter() - t)
    step_times = state.step_times_s

    _sync(device)
    energy = reduce_energy_across_ranks(meter.stop(), local_rank, device)
    if state.restarts and energy.source != "none":
        energy = EnergyReading(float("nan"), 0.0, source="none",
                               reason="trial restarted mid-window: the meter saw only part of it")
    util_pct = _mean_over_ranks(_mean(util.stop().values()), device)

    # The profiled window comes after the timed one, so profiling never perturbs throughput.
    profiled = {}
    if instrument and cfg.steps.profile:
        pw = run_profiled_window(lambda s: one_step(n_steps + s), cfg.steps.profile,
                                 world_size=dist.get_world_size(), device=device)
        profiled = reduce_across_ranks(pw, device).summary()

    # One reduction after the loop: the slowest rank sets each step's time, losses average.
    times = torch.tensor(step_times, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    loss_t = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device) for x in losses])
    dist.all_reduce(loss_t, op=dist.ReduceOp.SUM)
    loss_t /= dist.get_world_size()
    peak, source = peak_memory_gib()
    peak_t = torch.tensor([peak], dtype=torch.float64, device=device)
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)

    summary = {
        "step_times_s": times.cpu().tolist(),
        "losses": loss_t.cpu().tolist(),
        "peak_memory_gib": float(peak_t.item()),
        "memory_source": source,
        "first_measured_step_wall": state.first_measured_wall,
        "world_size": world,
        "dp": dp,
        "grad_accum": grad_accum,
        "restarts": state.restarts,
        "resizes": state.resizes,
        "time_lost_s": state.time_lost_s,
        "shard_shapes": _gather_shard_shapes(engine.module),
        "deepspeed_config": ds_config,
        "energy_j": energy.energy_j,
        "power_w": energy.power_w,
        "energy_source": energy.source,
        "energy_reason": energy.reason,
        "utilization": util_pct,
        "utilization_kind": type(util).__name__,
        **profiled,
    }
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            with open(os.path.join(tmp, SUMMARY_FILE), "w") as f:
                json.dump(summary, f)
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"done": 1}, checkpoint=checkpoint)
