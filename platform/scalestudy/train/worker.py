"""The Ray Train adapter of the trial body: Ray Train's context -> process group -> body -> report.

`train_loop_per_worker` runs in every Ray Train worker. Ray Train has started torch.distributed;
checkpoints and the summary go back through Ray Train: a checkpoint per `ray.train.report` (Ray
Train v2 only returns metrics that came with a checkpoint), rank 0's summary in SUMMARY_FILE.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray.train

SUMMARY_FILE = "summary.json"


class RayReporter:
    """The body's Reporter (train/body.py) on Ray Train."""

    keeps_checkpoints = True

    def __init__(self) -> None:
        self.local_rank = ray.train.get_context().get_local_rank()

    def save_checkpoint(self, directory: str, step: int) -> None:
        ray.train.report({"checkpoint_step": step},
                         checkpoint=ray.train.Checkpoint.from_directory(directory))

    @contextmanager
    def latest_checkpoint(self) -> Iterator[str | None]:
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as d:
            yield d

    def report_summary(self, summary: dict[str, Any] | None) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if summary is not None:
                with open(os.path.join(tmp, SUMMARY_FILE), "w") as f:
                    json.dump(summary, f)
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report({"done": 1}, checkpoint=checkpoint)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    from scalestudy.spec.trial import TrialConfig
    from scalestudy.train.process import init_process_group, prepare_process

    cfg = TrialConfig.model_validate(config["trial"])
    prepare_process(cfg)
    reporter = RayReporter()
    init_process_group(cfg, reporter.local_rank)
    from scalestudy.train.placement import check_tp_nodes

    # Before anything is built: a TP group across nodes fails the trial with its reason.
    reporter.summary_extra = {"worker_node_ids": check_tp_nodes(cfg)}

    from scalestudy.train.body import run_body

    run_body(cfg, reporter, fault=config.get("fault"), instrument=config.get("instrument", True))
