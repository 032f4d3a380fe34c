"""Checkpoint and resume of a trial's training loop: Ray Train fault tolerance and elastic resizes.

Every `fault_tolerance.checkpoint_every` steps (between timed steps, never inside one) every rank
saves its DeepSpeed checkpoint (ZeRO shards included) and hands it to the trial's reporter with the
loop's state: the next step, the step times and losses so far, restarts, segments and time lost.
Under Ray Train the reporter reports it as a Ray Train checkpoint; when Ray Train restarts the worker
group (FailureConfig) or resizes an elastic one, the new workers get it back from the reporter
(`ray.train.get_checkpoint()`), load it and carry on from the saved step, so the timed window ends up
with exactly `steps.measure` steps. No Ray here: the reporter is the adapter's (train/body.py).

On a world-size change the DeepSpeed checkpoint is loaded module-only (ZeRO optimizer partitions
are laid out for the old data-parallel size); the optimizer restarts from the saved weights, which
a throughput study can afford and the result records as a resize.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field

STATE_FILE = "loop_state.json"
TAG = "trial"


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


def wants_checkpoints(cfg) -> bool:
    return cfg.fault_tolerance.max_failures > 0 or cfg.elastic is not None


def save(engine, state: LoopState, rank: int, reporter) -> None:
    """All ranks: DeepSpeed checkpoint + loop state -> one checkpoint, through the reporter."""
    state.checkpoint_wall = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(tmp, tag=TAG)
        if rank == 0:
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(asdict(state), f)
        reporter.save_checkpoint(tmp, state.next_step)


def restore(engine, world_size: int, reporter) -> LoopState:
    """The saved state when this attempt follows a failure or resize, else a fresh one."""
    with reporter.latest_checkpoint() as d:
        if d is None:
            return LoopState(world_size=world_size)
        with open(os.path.join(d, STATE_FILE)) as f:
            state = LoopState(**json.load(f))
        same = state.world_size == world_size
        engine.load_checkpoint(d, tag=TAG, load_module_only=not same,
                               load_optimizer_states=same, load_lr_scheduler_states=same)
    state.restarts += 1
    state.world_size = world_size  # a new size opens a segment (train/segments.py)
    state.time_lost_s += time.time() - state.checkpoint_wall
    return state
