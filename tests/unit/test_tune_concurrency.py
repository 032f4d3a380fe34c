"""A sweep's concurrency follows the cluster (sweep/concurrency.py): the pure limit, how often it is
re-read, and Tune's own concurrency checks reading it live for grid, random and Optuna search,
with no trial skipped or made twice. No Ray instance: Tune's search algorithms run in-process."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from ray import tune
from ray.tune.experiment import Experiment
from ray.tune.search import BasicVariantGenerator, SearchGenerator, Searcher

from scalestudy.sweep.concurrency import (GROWTH_HEADROOM, ClusterLimit, FixedLimit,
                                          LiveConcurrencyLimiter, LiveVariantGenerator,
                                          concurrency_limit)

# tests/conftest.py's, not imported: plain `pytest` (not `python -m pytest`) has no repo root on
# sys.path
QUICKSTART = Path(__file__).parents[2] / "experiments" / "quickstart.yaml"


class Dial:
    """A limit the test turns by hand."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


def _noop(config):
    pass


def _take(alg, live: list) -> int:
    """Ask for trials the way TuneController._maybe_update_trial_queue does, until refused."""
    taken = 0
    while (trial := alg.next_trial()) is not None:
        live.append(trial)
        taken += 1
    return taken


def _complete(alg, live: list, n: int, done: list) -> None:
    for trial in live[:n]:
        alg.on_trial_complete(trial.trial_id, result={"loss": 1.0})
        done.append(trial)
    del live[:n]


@pytest.mark.parametrize("devices, world_size, can_grow, expected", [
    (0, 1, True, 1 + GROWTH_HEADROOM),   # a GPU-less head at submission: one trial, one to grow for
    (0, 4, False, 1),                    # nothing holds a trial yet: still one, never none
    (8, 2, True, 4 + GROWTH_HEADROOM),
    (8, 2, False, 4),                    # a Ray of our own: none waits for nodes that never come
    (7, 2, False, 3),                    # a part of a trial's devices runs nothing
    (2.5, 1, False, 2),                  # fractional resources round down
])
def test_limit_is_the_trials_the_devices_hold_plus_headroom_where_the_cluster_grows(
        devices, world_size, can_grow, expected):
    assert concurrency_limit(devices, world_size, can_grow) == expected


def test_headroom_is_a_parameter():
    assert concurrency_limit(8, 2, True, headroom=3) == 7
    assert concurrency_limit(8, 2, False, headroom=3) == 4


def test_cluster_limit_rereads_the_devices_at_most_every_refresh():
    resources, now, reads = {"CPU": 2.0}, [0.0], []

    def read():
        reads.append(now[0])
        return dict(resources)

    limit = ClusterLimit("GPU", 2, can_grow=True, refresh_s=5.0, read=read, clock=lambda: now[0])
    assert limit() == 1 + GROWTH_HEADROOM  # no GPU on the head: the CPU does not count
    resources["GPU"] = 8.0                 # two 4-GPU workers join
    now[0] = 4.9
    assert limit() == 1 + GROWTH_HEADROOM  # not re-read yet
    now[0] = 5.0
    assert limit() == 4 + GROWTH_HEADROOM
    resources["GPU"] = 4.0                 # one goes
    now[0] = 10.0
    assert limit() == 2 + GROWTH_HEADROOM
    assert reads == [0.0, 5.0, 10.0]


def test_fixed_and_cluster_limits_pickle_as_tune_saves_them():
    # Tune pickles its search algorithm (tuner.pkl, experiment checkpoints); the default reader is
    # a module-level function, so a limit that has read once still pickles.
    limit = ClusterLimit("CPU", 1, can_grow=False, read=lambda: {"CPU": 3.0})
    assert limit() == 3
    fresh = ClusterLimit("CPU", 1, can_grow=False)
    assert pickle.loads(pickle.dumps(fresh)).resource == "CPU"
    assert pickle.loads(pickle.dumps(FixedLimit(4)))() == 4


def test_grid_follows_a_raised_then_lowered_limit_and_yields_each_point_once():
    points = list(range(7))
    dial = Dial(1)
    gen = LiveVariantGenerator(dial)
    gen.add_configurations([Experiment("e", _noop, config={"point": tune.grid_search(points)})])
    live, done = [], []
    assert _take(gen, live) == 1
    dial.value = 3                  # the cluster grew
    assert _take(gen, live) == 2
    dial.value = 1                  # it shrank: running trials go on, none starts
    _complete(gen, live, 1, done)
    assert _take(gen, live) == 0
    _complete(gen, live, 2, done)
    assert _take(gen, live) == 1
    dial.value = 5
    assert _take(gen, live) == 3    # 4 points left, 4 live now
    _complete(gen, live, 4, done)
    assert _take(gen, live) == 0 and gen.is_finished()
    assert sorted(t.config["point"] for t in done) == points


def test_random_search_makes_the_same_trials_as_tunes_own_generator():
    space = {"a": tune.choice([1, 2, 3, 4]), "b": tune.choice(["x", "y"])}
    plain = BasicVariantGenerator(random_state=7)
    plain.add_configurations([Experiment("e", _noop, config=space, num_samples=6)])
    expected = [plain.next_trial().config for _ in range(6)]

    dial = Dial(2)
    gen = LiveVariantGenerator(dial, random_state=7)
    gen.add_configurations([Experiment("e", _noop, config=space, num_samples=6)])
    live, done = [], []
    assert _take(gen, live) == 2
    dial.value = 4
    assert _take(gen, live) == 2
    _complete(gen, live, 4, done)
    assert _take(gen, live) == 2
    _complete(gen, live, 2, done)
    assert _take(gen, live) == 0 and gen.is_finished()
    assert [t.config for t in done] == expected


def test_optuna_follows_the_limit_and_stops_at_num_samples():
    from ray.tune.search.optuna import OptunaSearch

    dial = Dial(1)
    limiter = LiveConcurrencyLimiter(OptunaSearch(metric="loss", mode="min", seed=0), dial)
    alg = SearchGenerator(limiter)  # what tune.run wraps a Searcher in (tune.py)
    space = {"a": tune.choice([1, 2, 3, 4])}
    assert alg.set_search_properties("loss", "min", space)
    alg.add_configurations([Experiment("e", _noop, config=space, num_samples=5)])
    live, done = [], []
    assert _take(alg, live) == 1
    dial.value = 3
    assert _take(alg, live) == 2
    dial.value = 1
    _complete(alg, live, 2, done)
    assert _take(alg, live) == 0    # one still live
    _complete(alg, live, 1, done)
    assert _take(alg, live) == 1
    dial.value = 4
    assert _take(alg, live) == 1    # num_samples reached
    _complete(alg, live, 2, done)
    assert alg.is_finished() and len({t.trial_id for t in done}) == 5
    assert limiter.max_concurrent == 4


def test_tunes_setter_fixes_the_limit():
    gen = LiveVariantGenerator(Dial(3))
    gen.max_concurrent = 2  # ConcurrencyLimiter.set_max_concurrency and the bases' __init__ do this
    assert gen.max_concurrent == 2 and isinstance(gen._limit, FixedLimit)


def test_a_searcher_that_limits_itself_is_refused():
    class SelfLimited(Searcher):
        def set_max_concurrency(self, max_concurrent: int) -> bool:
            return True

        def suggest(self, trial_id):
            return {}

    with pytest.raises(TypeError, match="limits its own concurrency"):
        LiveConcurrencyLimiter(SelfLimited(), Dial(2))


def test_search_algorithms_save_their_state_with_a_live_limit(tmp_path):
    # TuneController.checkpoint saves the search algorithm; the limit goes along in its state.
    from ray.tune.search.optuna import OptunaSearch

    gen = LiveVariantGenerator(ClusterLimit("CPU", 1, can_grow=True, read=dict))
    gen.add_configurations([Experiment("e", _noop, config={"p": tune.grid_search([1, 2])})])
    gen.save_to_dir(str(tmp_path), session_str="s")
    alg = SearchGenerator(LiveConcurrencyLimiter(
        OptunaSearch(metric="loss", mode="min", seed=0),
        ClusterLimit("GPU", 2, can_grow=False, read=lambda: {"GPU": 4.0})))
    alg.set_search_properties("loss", "min", {"a": tune.choice([1, 2])})
    alg.add_configurations([Experiment("e", _noop, config={}, num_samples=2)])
    alg.save_to_dir(str(tmp_path), session_str="s")
    assert gen.has_checkpoint(str(tmp_path)) and alg.has_checkpoint(str(tmp_path))


def test_sweep_limit_is_fixed_when_given_else_follows_the_cluster():
    from scalestudy.plan import plan_study
    from scalestudy.spec.load import load_spec
    from scalestudy.sweep.tune_runner import sweep_limit

    cpu = load_spec(QUICKSTART)
    assert sweep_limit(cpu, plan_study(cpu), 3, can_grow=True) == FixedLimit(3)
    live = sweep_limit(cpu, plan_study(cpu), None, can_grow=True)
    assert (live.resource, live.largest_world_size, live.can_grow) == ("CPU", 2, True)
    gpu = load_spec(QUICKSTART, ["hardware=a100-80gb", "world_size=[1, 2, 4]"])
    live = sweep_limit(gpu, plan_study(gpu), None, can_grow=False)
    assert (live.resource, live.largest_world_size, live.can_grow) == ("GPU", 4, False)


def test_default_concurrency_is_what_the_cluster_holds_now(monkeypatch):
    import ray

    from scalestudy.plan import plan_study
    from scalestudy.spec.load import load_spec
    from scalestudy.sweep.tune_runner import default_concurrency

    spec = load_spec(QUICKSTART)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 5.0})
    assert default_concurrency(spec, plan_study(spec)) == 2  # world sizes 1 and 2

