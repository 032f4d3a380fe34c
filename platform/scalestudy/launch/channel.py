"""The way back of a trial's summary: a small Ray actor the launching process creates and rank 0
sends its summary to, so the result travels through Ray (the actor's call, the object store) and a
trial that does not checkpoint needs no storage every node can see.

Checkpoints still go through Ray Train's storage (fault tolerance must restart from them on any
node); only the summary used to ride on a last checkpoint, which made every trial need shared
storage. The actor lives as long as the launcher holds its handle and dies with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from scalestudy.train.summary import TrialSummary


@ray.remote(num_cpus=0, max_restarts=0)
class TrialChannel:
    """Holds rank 0's summary of one trial attempt (a restarted attempt's summary replaces it) and
    the start of the trial's worker group. The summary travels pickled, as the typed model it is."""

    def __init__(self) -> None:
        self._summary: TrialSummary | None = None
        # The trial's start, as its Train controller reports it (launch/deadline.py).
        self._controller: list | None = None
        self._worker_group_starts = 0

    def set_controller(self, handle: list) -> None:
        self._controller = handle  # in a list: a bare handle argument would be resolved

    def mark_started(self) -> None:
        self._worker_group_starts += 1

    def start_state(self) -> tuple[int, list | None]:
        return self._worker_group_starts, self._controller

    def put(self, summary: TrialSummary) -> None:
        self._summary = summary

    def get(self) -> TrialSummary | None:
        return self._summary


def open_channel():
    """A fresh channel's handle (pass it to the workers in the train loop config), on the launcher's
    own node: a node lost mid-trial (elastic shrink) must not take the summary's way back with it.
    It was soft-pinned, which Ray does not hold for an actor that asks for no resources: the likely
    cause of an elastic-shrink test run whose trial failed with "The actor died unexpectedly"."""
    from scalestudy.launch.placement import on_this_node

    return TrialChannel.options(**on_this_node()).remote()


def send(channel, summary: TrialSummary) -> None:
    """Rank 0: wait until the summary is stored, so the trial cannot end before it arrives."""
    ray.get(channel.put.remote(summary))


def receive(channel) -> TrialSummary | None:
    """The launcher, after the trainer returned: the summary, or None when no rank sent one."""
    try:
        return ray.get(channel.get.remote())
    finally:
        ray.kill(channel)
