"""The simulate backend's sweep: a grid predicts every runnable point; a random or Optuna search
predicts num_samples drawn points (it predicted the whole grid, whatever the search said)."""

from __future__ import annotations

import pytest

from scalestudy.metrics import Status
from scalestudy.spec.load import plan, validate_spec
from scalestudy.sweep.driver import run_sweep
from scalestudy.sweep.feasibility import check_all
from scalestudy.sweep.progress import SweepProgress
from scalestudy.sweep.simulate import simulate_sweep

SPEC = {"name": "sim", "model": "llama2-7b", "hardware": "h100-80gb", "backend": "simulate",
        "seq_len": 4096, "world_size": [8, 16, 32, 64], "zero_stage": [1, 2, 3],
        "micro_batch": [1, 2, 4], "global_batch": 512}


def _sweep(search: dict | None, done: frozenset = frozenset()):
    spec = validate_spec({**SPEC, **({"search": search} if search else {})})
    planned = check_all(plan(spec))
    recorded = []
    with SweepProgress(len(planned), enabled=False) as progress:
        simulate_sweep(spec, planned, set(done), recorded.append, progress)
    return planned, recorded


@pytest.mark.parametrize("algorithm", ["random", "optuna"])
def test_a_search_predicts_num_samples_drawn_points(algorithm):
    planned, recorded = _sweep({"algorithm": algorithm, "num_samples": 6, "metric":
                                "tokens_per_s_per_device", "mode": "max"})
    assert len(recorded) == 6 < len(planned)
    ids = {p.config.trial_id: p for p in planned}
    assert all(r.trial_id in ids for r in recorded)
    for r in recorded:  # an infeasible draw is recorded with the reason the grid gives it
        assert (r.status is Status.infeasible) == (not ids[r.trial_id].feasible)
    again = _sweep({"algorithm": algorithm, "num_samples": 6})[1]
    assert [r.trial_id for r in again] == [r.trial_id for r in recorded]  # seeded


def test_a_search_skips_what_the_ledger_has_and_defaults_to_the_runnable_count():
    planned, recorded = _sweep({"algorithm": "random"})
    assert len(recorded) == sum(p.feasible for p in planned)
    done = frozenset(r.trial_id for r in recorded)
    assert not _sweep({"algorithm": "random", "num_samples": 20}, done)[1]


def test_a_grid_predicts_each_runnable_point_once():
    planned, recorded = _sweep(None)
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
