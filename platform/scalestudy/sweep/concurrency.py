"""How many trials a sweep runs at once, re-read while it runs.

On an autoscaled cluster the head has no GPU, so a limit fixed at submission from
`ray.cluster_resources()` is 1 for the whole sweep. The autoscaler adds nodes only for pending
demand, so a limit equal to today's capacity never makes it grow either. Here the limit is a
callable, re-read (at most every few seconds) each time Tune asks for a new trial: the cluster's
trials plus a little headroom of pending ones where the cluster can grow.

The seam is Tune's own concurrency checks, which read `max_concurrent` on every request for a
trial: `BasicVariantGenerator.next_trial` (grid and random search) and `ConcurrencyLimiter.suggest`
(any `Searcher`, e.g. Optuna). The two subclasses below turn that attribute into a property backed
by the callable and change nothing else, so each trial is still made once, by the same code, and a
slot is freed by the same `on_trial_complete` calls as for a fixed limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter, Searcher

# Trials allowed beyond what the cluster holds now, where it can grow: their placement groups stay
# pending, which is what the autoscaler scales up for. One keeps the wait bounded, as a pending
# trial ends as a timeout after the trial's placement_timeout_s.
GROWTH_HEADROOM = 1
# `ray.cluster_resources()` asks the GCS; Tune asks for trials many times a second.
REFRESH_S = 5.0

Limit = Callable[[], int]


def concurrency_limit(devices: float, largest_world_size: int, can_grow: bool,
                      headroom: int = GROWTH_HEADROOM) -> int:
    """Trials to run at once: as many of the largest world size as `devices` hold (at least one,
    so a sweep on a cluster with no such device yet still starts), plus `headroom` pending ones
    when the cluster can grow (none on a Ray of fixed resources: nothing would come for them)."""
    fits = max(1, int(devices // max(1, largest_world_size)))
    return fits + (max(0, headroom) if can_grow else 0)


def device_resource(is_gpu_study: bool) -> str:
    """The Ray resource a study's trials are sized in."""
    return "GPU" if is_gpu_study else "CPU"


def _cluster_resources() -> dict[str, float]:
    import ray

    return ray.cluster_resources()


@dataclass
class FixedLimit:
    """A limit that never changes (`--max-concurrent N`). A class, not a lambda: Tune pickles its
    search algorithm into the experiment state."""

    value: int

    def __call__(self) -> int:
        return self.value


@dataclass
class ClusterLimit:
    """`concurrency_limit` of the cluster's devices as they are now, read at most every
    `refresh_s` seconds. `read` stands in for `ray.cluster_resources` in tests."""

    resource: str
    largest_world_size: int
    can_grow: bool
    refresh_s: float = REFRESH_S
    read: Callable[[], Mapping[str, float]] = _cluster_resources
    clock: Callable[[], float] = time.monotonic
    _value: int = field(default=1, init=False)
    _read_at: float = field(default=-math.inf, init=False)

    def __call__(self) -> int:
        now = self.clock()
        if now - self._read_at >= self.refresh_s:
            devices = float(self.read().get(self.resource, 0.0))
            self._value = concurrency_limit(devices, self.largest_world_size, self.can_grow)
            self._read_at = now
        return self._value


class _LiveMaxConcurrent:
    """`max_concurrent` read from a callable each time the base class's own check reads it.

    A data descriptor wins over the instance attribute the base `__init__` assigns; assigning it
    (the base's `__init__`, `ConcurrencyLimiter.set_max_concurrency`) fixes the limit there."""

    _limit: Limit

    @property
    def max_concurrent(self) -> int:
        return self._limit()

    @max_concurrent.setter
    def max_concurrent(self, value: int) -> None:
        self._limit = FixedLimit(value)


class LiveVariantGenerator(_LiveMaxConcurrent, BasicVariantGenerator):
    """Grid and random search: `BasicVariantGenerator.next_trial` returns None while its live
    trials reach `max_concurrent`, before it takes the next point, so none is skipped."""

    def __init__(self, limit: Limit, **kwargs) -> None:
        super().__init__(**kwargs)  # assigns max_concurrent=0 ("no limit") through the setter
        self._limit = limit


class LiveConcurrencyLimiter(_LiveMaxConcurrent, ConcurrencyLimiter):
    """Any `Searcher` that leaves concurrency to its limiter (Optuna does): `suggest` returns None
    while the live trials reach `max_concurrent`, before the searcher is asked."""

    def __init__(self, searcher: Searcher, limit: Limit) -> None:
        super().__init__(searcher, max_concurrent=1)
        if not self._limit_concurrency:
            # The searcher took the limit over (HEBO, BOHB): it would keep this first value.
            raise TypeError(f"{type(searcher).__name__} limits its own concurrency; "
                            "a live limit cannot reach it")
        self._limit = limit
