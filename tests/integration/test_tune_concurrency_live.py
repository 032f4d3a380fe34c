"""A real `tune.Tuner` (trivial function trials, no DeepSpeed) whose concurrency limit changes
while it runs (sweep/concurrency.py): Tune starts more trials when it rises, fewer when it falls,
and each grid point once. ~25 s on 2 cores with Ray's start, so `slow`; the pure parts and each
search algorithm are tested without Ray in tests/unit/test_tune_concurrency.py."""

from __future__ import annotations

import os
import time

import pytest
from ray import tune

from scalestudy.sweep.concurrency import ClusterLimit, LiveVariantGenerator

pytestmark = pytest.mark.slow


class Dial:
    """A limit the test turns by hand (from a Tune callback, in the driver)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


def _max_overlap(spans: list[tuple[float, float]]) -> int:
    """The most spans open at one instant (an end before a start at the same instant)."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    open_, most = 0, 0
    for _, step in events:
        open_ += step
        most = max(most, open_)
    return most


def test_a_real_tuner_follows_a_limit_changed_while_it_runs(ray_session, tmp_path):
    marks = tmp_path / "started"
    marks.mkdir()
    marks_dir = str(marks)
    # A trial holds until the trials the limit should run beside it have started (a new trial
    # actor takes seconds to start on 2 cores, a cached one none: without this the spans would
    # measure actor start-up, not the limit), then ends staggered, so that a limit that failed to
    # drop would show as a trial starting beside the last of its group.
    ran_beside = {0: 1, 1: 4, 2: 4, 3: 4, 4: 5}
    hold_s = {0: 3.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 0.5}

    # Defined here so that it is pickled by value: Ray's workers cannot import this test module.
    def hold(config):
        point = config["point"]
        start = time.time()
        open(os.path.join(marks_dir, str(point)), "w").close()
        deadline = start + 30  # a limit that never rose fails the overlap assertion, not a hang
        while len(os.listdir(marks_dir)) < ran_beside[point] and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(hold_s[point])
        tune.report({"start": start, "end": time.time()})

    class Turn(tune.Callback):
        """Driver side, as the sweep's _RecordCallback: after the first trial the cluster
        "grows" to 3, after the second it "shrinks" to 1."""

        def __init__(self, dial: Dial) -> None:
            self.dial, self.completed = dial, 0

        def on_trial_complete(self, iteration, trials, trial, **info):
            self.completed += 1
            self.dial.value = {1: 3, 2: 1}.get(self.completed, self.dial.value)

    points = sorted(ran_beside)
    dial = Dial(1)
    tuner = tune.Tuner(
        tune.with_resources(hold, {"CPU": 0.1}),
        param_space={"point": tune.grid_search(points)},
        tune_config=tune.TuneConfig(search_alg=LiveVariantGenerator(dial), reuse_actors=True),
        run_config=tune.RunConfig(name="live-limit", storage_path=str(tmp_path), verbose=0,
                                  callbacks=[Turn(dial)]),
    )
    results = tuner.fit()
    assert not results.errors
    spans = {r.config["point"]: (r.metrics["start"], r.metrics["end"]) for r in results}
    assert len(results) == len(points) and sorted(spans) == points  # each point once
    # Limit 1: the first ran alone. Raised to 3: the next three ran at once. Lowered to 1 when
    # the first of them ended: the last started only once the other two had ended.
    assert min(spans[p][0] for p in (1, 2, 3)) >= spans[0][1]
    assert _max_overlap([spans[p] for p in (1, 2, 3)]) == 3
    assert spans[4][0] >= max(spans[p][1] for p in (1, 2, 3))
    assert _max_overlap(list(spans.values())) == 3


def test_the_cluster_limit_reads_this_ray(ray_session):
    from scalestudy.launch.ray_train import fixed_local_resources

    fixed = fixed_local_resources()
    assert fixed is not None  # the session's Ray is this process's own: it cannot grow
    limit = ClusterLimit("CPU", 1, can_grow=fixed is None)
    assert limit() == int(ray_session.cluster_resources()["CPU"])  # and no headroom
