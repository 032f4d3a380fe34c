"""A trial's two time limits: the wait for its nodes, then its run.

`placement_timeout_s` bounds the time from the trial's start to the start of its first worker group
(its placement group ready, its workers up): on an autoscaling cluster that is the wait for nodes,
which must not eat into the run's own limit. `trial_timeout_s` counts from that start. Either limit
ends the trial as a timeout with its own reason, and aborts the trial's Train controller so its
placement group and workers go with it.

The controller runs in its own actor (Ray Train v2), so it tells the driver through the trial's
TrialChannel actor (launch/channel.py): a callback in the controller hands over the controller's
handle when it starts and marks each worker-group start; the driver polls the channel.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

from scalestudy.spec.trial import TrialConfig

POLL_S = 1.0
ABORT_WAIT_S = 5.0  # a controller waiting for its placement group answers no abort: kill it


class TrialTimeout(Exception):
    """A trial ran past one of its limits; the message is the recorded reason."""


class StartCallback(ControllerCallback, WorkerGroupCallback):
    """Runs in the Train controller: reports the controller's handle and each worker-group start."""

    def __init__(self, channel) -> None:
        self.channel = channel

    def after_controller_start(self, train_run_context) -> None:
        self.channel.set_controller.remote([ray.get_runtime_context().current_actor])

    def after_worker_group_start(self, worker_group) -> None:
        self.channel.mark_started.remote()


def _abort(controller) -> None:
    """Stop the trial's controller: gracefully (workers and placement group released), else kill."""
    try:
        ray.get(controller.abort.remote(), timeout=ABORT_WAIT_S)
    except Exception:  # noqa: BLE001 - killing is the fallback whatever abort ran into
        ray.kill(controller, no_restart=True)


def fit_within_limits(trainer, cfg: TrialConfig, channel, t0: float, waiting_for: str):
    """trainer.fit() under both limits; TrialTimeout(reason) when one is exceeded."""
    box: dict[str, Any] = {}

    def _fit() -> None:
        try:
            box["result"] = trainer.fit()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = err

    thread = threading.Thread(target=_fit, daemon=True, name="trial-fit")
    thread.start()
    started_at = None
    while True:
        thread.join(POLL_S)
        if not thread.is_alive():
            break
        starts, controller = ray.get(channel.start_state.remote())
        now = time.time()
        if starts and started_at is None:
            started_at = now  # the driver's clock: nodes' clocks may differ
        reason = None
        if started_at is None and now - t0 > cfg.placement_timeout_s:
            reason = (f"placement: exceeded placement_timeout_s={cfg.placement_timeout_s:g} "
                      f"waiting for {waiting_for}")
        elif started_at is not None and now - started_at > cfg.trial_timeout_s:
            reason = (f"exceeded trial_timeout_s={cfg.trial_timeout_s:g} "
                      "(counted from the worker group's start)")
        if reason:
            if controller:
                _abort(controller[0])
            raise TrialTimeout(reason)
    if "error" in box:
        raise box["error"]
    return box["result"]
