"""The simulate backend's sweep: a grid predicts every runnable point; a random or Optuna search
predicts num_samples drawn points (it predicted the whole grid, whatever the search said)."""

from __future__ import annotations

import pytest

from scalestudy.metrics import Status
from scalestudy.spec.load import plan, validate_spec
from scalestudy.sweep.driver import run_sweep
from scalestudy.sweep.feasibility import check_all
from scalestudy.sweep.simulate import simulate_sweep

SPEC = {"name": "sim", "model": "llama2-7b", "hardware": "h100-80gb", "backend": "simulate",
        "seq_len": 4096, "world_size": [8, 16, 32, 64], "zero_stage": [1, 2, 3],
        "micro_batch": [1, 2, 4], "global_batch": 512}


class Progress:
    """The bar's side of a sweep: counts every draw (SweepProgress.done advances by one)."""

    def __init__(self):
        self.draws = 0

    def running(self, name):
        pass

    def done(self, result, name):
        self.draws += 1


def _sweep(search: dict | None, done: frozenset = frozenset()):
    """(planned, recorded, draws): what the driver's Recorder would get, and the bar's count."""
    spec = validate_spec({**SPEC, **({"search": search} if search else {})})
    planned = check_all(plan(spec))
    recorded, progress = [], Progress()

    def record(result):  # as the driver's Recorder: a row, then the bar
        recorded.append(result)
        progress.done(result, result.trial_id)

    simulate_sweep(spec, planned, set(done), record, progress)
    return planned, recorded, progress.draws


@pytest.mark.parametrize("algorithm", ["random", "optuna"])
def test_a_search_predicts_num_samples_drawn_points(algorithm):
    planned, recorded, draws = _sweep({"algorithm": algorithm, "num_samples": 6, "metric":
                                       "tokens_per_s_per_device", "mode": "max"})
    assert draws == 6 >= len(recorded) == len({r.trial_id for r in recorded}) > 0
    ids = {p.config.trial_id: p for p in planned}
    assert all(r.trial_id in ids for r in recorded)
    for r in recorded:  # an infeasible draw is recorded with the reason the grid gives it
        assert (r.status is Status.infeasible) == (not ids[r.trial_id].feasible)
    again = _sweep({"algorithm": algorithm, "num_samples": 6})[1]  # the same seed
    assert [r.trial_id for r in again] == [r.trial_id for r in recorded]


def test_a_search_skips_what_the_ledger_has_and_defaults_to_the_runnable_count():
    planned, recorded, draws = _sweep({"algorithm": "random"})
    assert draws == sum(p.feasible for p in planned) > len(recorded)
    done = frozenset(r.trial_id for r in recorded)
    assert not _sweep({"algorithm": "random", "num_samples": 20}, done)[1]


def test_a_grid_predicts_each_runnable_point_once():
    planned, recorded, _ = _sweep(None)
    assert sorted(r.trial_id for r in recorded) == sorted(
        p.config.trial_id for p in planned if p.feasible)
    assert {r.status for r in recorded} == {Status.completed}


def test_run_sweep_records_a_searched_simulate_study_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    spec = validate_spec({**SPEC, "search": {"algorithm": "random", "num_samples": 4}})
    out = run_sweep(spec, plan(spec), "spec", results_root=tmp_path, show_progress=False)
    assert len(out.results) == len({r.trial_id for r in out.results}) <= 4
    again = run_sweep(spec, plan(spec), "spec", resume=True, results_root=tmp_path,
                      show_progress=False)
    assert not again.results and again.skipped == len(out.results)

