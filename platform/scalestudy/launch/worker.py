"""The Ray Train adapter of the trial body: Ray Train's context -> process group -> body -> report.

`train_loop_per_worker` runs in every Ray Train worker. Ray Train has started torch.distributed;
checkpoints go through Ray Train (a checkpoint per `ray.train.report`, persisted to the run's
storage), rank 0's summary through the launcher's TrialChannel actor (launch/channel.py), so a trial
that does not checkpoint never needs storage that every node can see.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import ray.train

from scalestudy.launch.channel import send
from scalestudy.train.checkpoint_store import StoredCheckpoint

if TYPE_CHECKING:
    from scalestudy.train.summary import TrialSummary


class RayReporter:
    """The body's Reporter (train/body.py) on Ray Train."""

    keeps_checkpoints = True

    def __init__(self, channel) -> None:
        self.local_rank = ray.train.get_context().get_local_rank()
        self.channel = channel

    def save_checkpoint(self, directory: str, step: int) -> None:
        ray.train.report({"checkpoint_step": step},
                         checkpoint=ray.train.Checkpoint.from_directory(directory))

    @contextmanager
    def latest_checkpoint(self) -> Iterator[StoredCheckpoint | None]:
        """Where Ray Train keeps the checkpoint, not a download of it: each rank fetches only the
        files it loads (train/checkpoint_store.py), where `as_directory()` would copy all of it."""
        checkpoint = ray.train.get_checkpoint()
        yield None if checkpoint is None else StoredCheckpoint(checkpoint.filesystem, checkpoint.path)

    def report_summary(self, summary: TrialSummary | None) -> None:
        if summary is not None:
            send(self.channel, summary)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    from scalestudy.spec.trial import TrialConfig
    from scalestudy.train import timing
    from scalestudy.train.process import init_process_group, prepare_process

    timing.start()
    timing.mark("worker_entry")
    cfg = TrialConfig.model_validate(config["trial"])
    prepare_process(cfg)
    reporter = RayReporter(config["channel"])
    from scalestudy.launch.storage_probe import check_visible

    check_visible(config.get("storage_marker"), ray.util.get_node_ip_address())
    init_process_group(cfg, reporter.local_rank)
    from scalestudy.launch.placement import check_tp_nodes

    # Before anything is built: a TP group across nodes fails the trial with its reason.
    reporter.summary_extra = {"worker_node_ids": check_tp_nodes(cfg)}

    from scalestudy.train.body import run_body

    run_body(cfg, reporter, fault=config.get("fault"), instrument=config.get("instrument", True))
