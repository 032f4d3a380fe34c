"""Checkpoint and resume of a trial's training loop: Ray Train fault tolerance and elastic resizes.

Every `fault_tolerance.checkpoint_every` steps (between timed steps, never inside one) every rank
saves its DeepSpeed checkpoint (its own ZeRO shards), staged on the node's staging disk
(train/checkpoint_store.py), and hands it to the trial's reporter with the loop's state: the next
step, the step times and losses so far, restarts, segments and time lost. Under Ray Train the
reporter reports it as a Ray Train checkpoint; when Ray Train restarts the worker group
(FailureConfig) or resizes an elastic one, the new workers get it back from the reporter as a file
system and a path, and each rank reads only the files it loads, so the timed window ends up with
exactly `steps.measure` steps. No Ray here: the reporter is the adapter's (train/body.py).

On a world-size change a ZeRO-3 checkpoint is re-partitioned (train/zero3_resize.py: weights and
Adam moments, no rank holding the full state). Under ZeRO 0-2 the module is loaded (module-only:
the optimizer partitions are laid out for the old data-parallel size) and the optimizer restarts
from the saved weights, which a throughput study can afford and the result records as a resize.
Every restore is recorded (`LoopState.restores`): per rank the bytes it read of the checkpoint and
the bytes of the files it wrote at the save (its shard), from each rank's manifest.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from scalestudy.train import checkpoint_store, zero3_resize

STATE_FILE = "loop_state.json"
TAG = "trial"


def manifest_name(rank: int) -> str:
    return f"manifest-rank{rank}.json"


@dataclass
class LoopState:
    next_step: int = 0
    world_size: int = 0
    step_times_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    restarts: int = 0
    # The segments at one world size (train/segments.py), where this segment's timed steps start
    # and where the loop ends (later after a resize: each new segment warms up again).
    segments: list[dict[str, int]] = field(default_factory=list)
    timed_from: int = 0
    end_step: int = 0
    time_lost_s: float = 0.0
    checkpoint_wall: float = 0.0
    first_measured_wall: float | None = None
    # ZeRO-3: [sum, sum of squares] of the fp32 state at the save, checked after a re-partition.
    zero3_checksum: list[float] | None = None
    # One entry per restore: world sizes and, per rank, bytes read and bytes of its own shard.
    restores: list[dict[str, Any]] = field(default_factory=list)


def wants_checkpoints(cfg) -> bool:
    return cfg.fault_tolerance.max_failures > 0 or cfg.elastic is not None


def _files(directory: str) -> dict[str, int]:
    """Relative path -> size of every file under `directory`."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = os.path.getsize(path)
    return out


def save(engine, state: LoopState, rank: int, reporter) -> None:
    """All ranks: DeepSpeed checkpoint + loop state -> one checkpoint, through the reporter."""
    state.checkpoint_wall = time.time()
    zero3 = zero3_resize.applies(engine)
    state.zero3_checksum = zero3_resize.checksum(engine) if zero3 else None
    with checkpoint_store.staging_dir("save-") as tmp:
        engine.save_checkpoint(tmp, tag=TAG)
        written = _files(tmp)  # this rank's shard: what DeepSpeed had it write
        if rank == 0:
            if zero3:
                zero3_resize.write_layout(engine, tmp)
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(asdict(state), f)
        with open(os.path.join(tmp, manifest_name(rank)), "w") as f:
            json.dump(written, f)
        reporter.save_checkpoint(tmp, state.next_step)


def _own_bytes(reader: checkpoint_store.ShardReader, rank: int) -> int | None:
    """Bytes of the files this rank wrote at the save (its manifest), None if it saved none."""
    path = os.path.join(reader.directory, manifest_name(rank))
    if not os.path.exists(path):
        return None
    with open(reader.fetch(path)) as f:
        return sum(json.load(f).values())


def _load(engine, reader, state: LoopState, world_size: int) -> None:
    same = state.world_size == world_size
    with reader.reading(engine):
        if not same and zero3_resize.applies(engine):
            zero3_resize.repartition(engine, reader, TAG, state.zero3_checksum)
        else:
            engine.load_checkpoint(reader.directory, tag=TAG, load_module_only=not same,
                                   load_optimizer_states=same, load_lr_scheduler_states=same)


def _record(reader, state: LoopState, world_size: int) -> dict[str, Any]:
    """This restore, every rank's figures gathered (collective)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = (reader.bytes_read, _own_bytes(reader, rank) if state.world_size == world_size else None)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"from_world_size": state.world_size, "world_size": world_size,
            "read_bytes": [e[0] for e in everyone], "shard_bytes": [e[1] for e in everyone]}


def restore(engine, world_size: int, reporter) -> LoopState:
    """The saved state when this attempt follows a failure or resize, else a fresh one."""
    with reporter.latest_checkpoint() as stored:
        if stored is None:
            return LoopState(world_size=world_size)
        with checkpoint_store.open_stored(stored) as reader:
            with open(reader.fetch(os.path.join(reader.directory, STATE_FILE))) as f:
                state = LoopState(**json.load(f))
            _load(engine, reader, state, world_size)
            record = _record(reader, state, world_size)
    state.restores.append(record)
    state.restarts += 1
    state.world_size = world_size  # a new size opens a segment (train/segments.py)
    state.time_lost_s += time.time() - state.checkpoint_wall
    return state
