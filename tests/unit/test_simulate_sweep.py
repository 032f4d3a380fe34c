"""The simulate backend's sweep: a grid predicts every runnable point; a random or Optuna search
predicts num_samples drawn points (it predicted the whole grid, whatever the search said)."""

from __future__ import annotations

import pytest

from scalestudy.metrics import Status
from scalestudy.spec.load import validate_spec
from scalestudy.plan import plan_study
from scalestudy.sweep.driver import run_sweep
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
    planned = plan_study(spec)
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
    # the same seed draws the same sequence: a shorter search's draws are all in the ledger
    assert not _sweep({"algorithm": "random", "num_samples": min(20, draws)}, done)[1]


def test_a_grid_predicts_each_runnable_point_once():
    planned, recorded, _ = _sweep(None)
    assert sorted(r.trial_id for r in recorded) == sorted(
        p.config.trial_id for p in planned if p.feasible)
    assert {r.status for r in recorded} == {Status.completed}


def test_run_sweep_records_a_searched_simulate_study_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    spec = validate_spec({**SPEC, "search": {"algorithm": "random", "num_samples": 4}})
    out = run_sweep(spec, plan_study(spec), "spec", results_root=tmp_path, show_progress=False)
    assert len(out.results) == len({r.trial_id for r in out.results}) <= 4
    again = run_sweep(spec, plan_study(spec), "spec", resume=True, results_root=tmp_path,
                      show_progress=False)
    assert not again.results and again.skipped == len(out.results)



def _runs(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id], max_results=1000)


def test_a_simulate_sweep_is_one_mlflow_run_with_its_predictions_as_a_table(tmp_path, monkeypatch):
    """Not one run per prediction (a 5,000-point sweep made 5,000 runs); the ledger gets batch
    parts and every row the parent's run id; sync-mlflow uploads the table to a store without it,
    once."""
    import pyarrow.parquet as pq

    from scalestudy.track.ledger import Ledger, ledger_path
    from scalestudy.track.mlflow_writer import PREDICTIONS_ARTIFACT, PREDICTIONS_TAG
    from scalestudy.track.sync import sync_mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    spec = validate_spec(SPEC)
    planned = plan_study(spec)
    out = run_sweep(spec, planned, "spec", results_root=tmp_path, show_progress=False)
    assert out.mlflow_error is None and len(out.results) == len(planned)
    client, runs = _runs(uri, "sim")
    (parent,) = runs
    assert parent.data.tags["scalestudy.role"] == "sweep"
    assert parent.data.tags[PREDICTIONS_TAG] == str(len(planned))
    table = pq.read_table(client.download_artifacts(parent.info.run_id, PREDICTIONS_ARTIFACT,
                                                    str(tmp_path)))
    assert sorted(table.column("trial_id").to_pylist()) == sorted(p.config.trial_id for p in planned)
    ledger = Ledger(ledger_path("sim", tmp_path))
    rows = ledger.rows()
    assert {r["mlflow_run_id"] for r in rows} == {parent.info.run_id} and len(rows) == len(planned)
    assert len(ledger.part_names()) == 2  # one batch of rows, one patch with the run id
    assert len(pq.read_table(ledger.path)) == len(planned)  # the export, for pandas

    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert sync_mlflow("sim", other, results_root=tmp_path) == (len(planned), None)
    assert sync_mlflow("sim", other, results_root=tmp_path) == (0, None)  # idempotent
    client, runs = _runs(other, "sim")
    (synced,) = runs
    assert synced.data.tags[PREDICTIONS_TAG] == str(len(planned))
    assert sync_mlflow("sim", uri, results_root=tmp_path) == (0, None)  # the sweep logged it


def test_a_simulate_sweep_with_mlflow_down_keeps_every_row_for_sync(tmp_path, monkeypatch):
    from scalestudy.track.ledger import Ledger, ledger_path
    from scalestudy.track.mlflow_writer import MlflowWriter
    from scalestudy.track.sync import sync_mlflow

    def down(self, *args, **kwargs):
        raise ConnectionError("tracking server down")

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    spec = validate_spec(SPEC)
    with monkeypatch.context() as m:
        m.setattr(MlflowWriter, "_log_predictions", down)
        out = run_sweep(spec, plan_study(spec), "spec", results_root=tmp_path, show_progress=False)
    assert out.mlflow_error and "tracking server down" in out.mlflow_error
    rows = Ledger(ledger_path("sim", tmp_path)).rows()
    assert len(rows) == len(out.results) and {r["mlflow_run_id"] for r in rows} == {None}
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert sync_mlflow("sim", uri, results_root=tmp_path) == (len(rows), None)
    _, runs = _runs(uri, "sim")
    assert len(runs) == 1  # the table went onto the sweep's own parent run
