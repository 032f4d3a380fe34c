"""`scalestudy plan`'s rounds as a Ray Tune searcher: one Tune experiment measures every round.

Tune asks the searcher for a trial whenever a slot is free (sweep/concurrency.py's limit). The
searcher hands out the current batch of plan/rounds.py's PlanLoop one layout at a time, answers
None (wait) while the batch's trials still run, and once the last of them completes gives the loop
their results: the loop refits the model, re-ranks the space and says what to measure next, or that
the plan is over (Searcher.FINISHED). So every round runs on the sweep's warm worker groups, one
ledger and one MLflow parent run hold the whole plan, and a halving window is a per-trial setting
(trainable.WINDOW_KEY) rather than a sweep of its own.

A layout the study's ledger already holds (a plan run again on the same results root) is not run
again: its recorded result completes it, as `--resume` would skip it.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

from ray.tune.search import Searcher

from scalestudy.metrics import Status, TrialResult
from scalestudy.plan.build import plan_point
from scalestudy.plan.entry import PlanEntry
from scalestudy.plan.rounds import Batch, PlanLoop
from scalestudy.spec.study import StudySpec
from scalestudy.sweep.trainable import RESULT_KEY, WINDOW_KEY, trial_point


class PlanSearcher(Searcher):
    """Suggests the PlanLoop's batches; `known` maps trial ids already in the ledger to their
    results. Trials are built from `spec` (the space at the profile the plan started from), so
    their ids do not change as the refitted model re-ranks the space."""

    def __init__(self, loop: PlanLoop, spec: StudySpec,
                 known: dict[str, TrialResult] | None = None,
                 announce: Callable[[Batch, int], None] | None = None) -> None:
        super().__init__(metric=None, mode="max")
        self.loop, self.spec, self.announce = loop, spec, announce
        self.known = dict(known or {})
        self.reused: list[TrialResult] = []  # results taken from the ledger instead of run
        self._queue: list[dict[str, Any]] = []  # configs of the batch not yet handed out
        self._live: dict[str, dict[str, Any]] = {}  # Tune trial id -> config, running
        self._results: list[TrialResult] = []  # the batch's results so far

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # the plan ranks by its own objective; Tune's metric and mode are not used

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if not self._queue and not self._live:
            self._next_batch()
        if self.loop.finished and not self._queue:
            return Searcher.FINISHED
        if not self._queue:
            return None  # the batch still runs: the next one depends on its results
        config = self._queue.pop(0)
        self._live[trial_id] = config
        return config

    def on_trial_complete(self, trial_id: str, result: dict | None = None,
                          error: bool = False) -> None:
        config = self._live.pop(trial_id, None)
        if config is None:
            return
        self._results.append(self._result_of(config, result, error))
        if not self._live and not self._queue:
            done, self._results = self._results, []
            self.loop.complete(done)

    def _next_batch(self) -> None:
        """The loop's next batch into the queue; batches the ledger already holds complete here."""
        while not self._queue:
            batch = self.loop.next_batch()
            if batch is None:
                return
            reused = len(self.reused)
            for entry in batch.entries:
                config = _config(entry, batch)
                recorded = self.known.get(self._trial_of(config).config.trial_id)
                if recorded is not None:
                    self._results.append(recorded)
                    self.reused.append(recorded)
                else:
                    self._queue.append(config)
            if self.announce is not None:  # (batch, how many of it the ledger already held)
                self.announce(batch, len(self.reused) - reused)
            if not self._queue:
                done, self._results = self._results, []
                self.loop.complete(done)

    def _trial_of(self, config: dict[str, Any]) -> PlanEntry:
        return plan_point(*trial_point(self.spec, config))

    def _result_of(self, config: dict[str, Any], result: dict | None, error: bool) -> TrialResult:
        """The trial's reported TrialResult; a failed one (its config, the reason) if it has none.
        The sweep's recording callback writes the same failure to the ledger."""
        if result and RESULT_KEY in result:
            return TrialResult.model_validate_json(result[RESULT_KEY])
        reason = ("the trial's actor failed (the ledger row has Tune's error)" if error
                  else "the trial reported no result")
        return TrialResult.from_config(self._trial_of(config).config, Status.failed, reason=reason)

    # Tune checkpoints its search algorithm with the experiment; the plan resumes from the
    # ledger instead, but a searcher that can save keeps Tune from warning on every checkpoint.
    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))


def _config(entry: PlanEntry, batch: Batch) -> dict[str, Any]:
    """A layout as a Tune trial's config: its axes by name (the trainable resolves them against
    the spec), and the batch's timed steps where they differ from the spec's."""
    config: dict[str, Any] = {"point": dict(entry.axes)}
    if batch.steps is not None:
        config[WINDOW_KEY] = batch.steps
    return config
