"""A pipeline trial (pp > 1) as the trial body runs it: the same windows, steps and summary as a
DeepSpeed trial (train/body.py), on the stages of train/pipeline.py under the schedule of
train/schedules.py.

    trial = build_pipeline_trial(cfg, device)    # what body.build returns when cfg.pp > 1
    trial.step(step)                             # one optimizer step; this rank's loss tensor
    trial.profiled(first_step, n_steps)          # the profiled window: whole steps
    trial.summary_fields(timed_steps, memory)    # collective: what TrialSummary carries for it

It quacks like body.Trial where the body's loop touches a trial (cfg, layout, device, rank,
dp_rank, stage, step, staged, ds_config); what differs is said here:
  * losses: only a last-stage rank computes its pipeline's loss (0 elsewhere); ``loss_ranks`` is
    how many ranks report one (dp x tp), by which the body's sum over ranks is divided;
  * the profiled window traces whole steps (measure/profiled_window.run_profiled_window): a
    pipeline step cannot be cut into micro-batches, its schedule interleaves them;
  * no DeepSpeed engine, so no DeepSpeed checkpoint: the planner refuses fault tolerance and
    elastic sizes with pp > 1 (spec/study.py check_pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from scalestudy.parallel.layout import Layout
from scalestudy.train.pipeline_summary import PipelineReading
from scalestudy.train.schedules import PipelineTrainer, process_groups


@dataclass
class PipelineTrial:
    cfg: Any  # TrialConfig
    layout: Layout
    trainer: PipelineTrainer
    device: torch.device
    rank: int
    ds_config: dict[str, Any] = field(default_factory=dict)  # no DeepSpeed engine
    staged: dict[int, torch.Tensor] = field(default_factory=dict)
    timed: range = range(0)  # the timed window's steps (stage() is told them)
    engine: Any = None

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def loss_ranks(self) -> int:
        """Ranks whose step loss is their pipeline's (the last stage of each dp x tp replica)."""
        return self.layout.dp * self.layout.tp

    def stage(self, steps: range) -> None:
        """The timed window's batches of this rank, on the device before the window starts; the
        activation tracker stops here (its hooks stay out of the timed steps: the warm-up held
        what every step holds)."""
        self.staged = {s: self.trainer.batch(s) for s in steps}
        self.timed = steps
        self.trainer.tracker.on = False

    def step(self, step: int) -> torch.Tensor:
        return self.trainer.step(step, self.staged.get(step))

    def profiled(self, first_step: int, n_steps: int):
        """The profiled window of whole pipeline steps, reduced across ranks (collective)."""
        from scalestudy.measure.profiled_window import reduce_across_ranks, run_profiled_window

        pw = run_profiled_window(self.step, n_steps, world_size=self.layout.world_size,
                                 device=self.device, first_step=first_step)
        return reduce_across_ranks(pw, self.device)

    def reading(self, timed_steps: list[int] | range, peak_memory_gib: float) -> PipelineReading:
        return self.trainer.reading(timed_steps, peak_memory_gib)


def build_pipeline_trial(cfg: Any, device: torch.device) -> PipelineTrial:
    """This rank's stages, schedule and optimizer at the trial's layout (every rank, collective)."""
    from scalestudy.train import timing

    layout = cfg.layout
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"a pipeline trial of world size {layout.world_size} started on "
                           f"{dist.get_world_size()} ranks (pipelines are not elastic)")
    trainer = PipelineTrainer(cfg, layout, device, process_groups(layout, device.type))
    timing.mark("model_built")
    timing.mark("engine_ready")
    return PipelineTrial(cfg, layout, trainer, device, dist.get_rank())
