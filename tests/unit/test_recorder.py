"""The sweep's recorder (sweep/driver.py): a measured trial is one ledger part and one MLflow run,
the run id patched in; a trial MLflow refused is tried again when the sweep closes, and the
ledger is exported once, then."""

from __future__ import annotations

import pyarrow.parquet as pq

from scalestudy.metrics import Status, TrialResult
from scalestudy.spec.load import validate_spec
from scalestudy.sweep.driver import Recorder
from scalestudy.track.ledger import Ledger, ledger_path
from scalestudy.track.mlflow_writer import MlflowWriter
from tests.conftest import trial

SPEC = {"name": "rec", "model": "llama2-tiny", "hardware": "cpu-local", "world_size": [1, 2]}


def _results() -> list[TrialResult]:
    return [TrialResult.from_config(trial([f"world_size={w}", "zero_stage=0", "micro_batch=1"]),
                                    Status.completed, step_time_s=0.1 * w) for w in (1, 2)]


def test_a_refused_run_is_logged_at_close_and_the_ledger_exported(tmp_path, monkeypatch):
    writer = MlflowWriter(f"sqlite:///{tmp_path / 'mlflow.db'}", "rec")
    parent = writer.create_parent("s1", "sweep")
    log_trial, calls = writer._log_trial, []

    def first_fails(*args):
        calls.append(args[2])
        if len(calls) == 1:
            raise ConnectionError("502 bad gateway")
        return log_trial(*args)

    monkeypatch.setattr(writer, "_log_trial", first_fails)
    ledger = Ledger(ledger_path("rec", tmp_path))
    rec = Recorder(validate_spec(SPEC), ledger, writer, "s1", parent, None)
    first, second = _results()
    rec.record(first)
    rec.record(second)
    rec.record(second)  # a retried Tune result: no second row, no second run
    by_id = {r["trial_id"]: r for r in ledger.rows()}
    assert by_id[first.trial_id]["mlflow_run_id"] is None and by_id[second.trial_id]["mlflow_run_id"]
    assert not ledger.path.exists()  # no export per trial
    assert rec.close() is None  # the refused run went through on the second try
    assert calls[0] == calls[2] != calls[1]  # the same result id both times
    rows = ledger.rows()
    assert len(rows) == 2 and all(r["mlflow_run_id"] for r in rows)
    assert len(pq.read_table(ledger.path)) == 2
    children = writer.client.search_runs([writer.experiment_id],
                                         filter_string="tags.`scalestudy.role` = 'trial'")
    assert len(children) == 2


def test_close_reports_what_mlflow_never_got(tmp_path, monkeypatch):
    writer = MlflowWriter(f"sqlite:///{tmp_path / 'mlflow.db'}", "rec")

    def down(*args):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(writer, "_log_trial", down)
    ledger = Ledger(ledger_path("rec", tmp_path))
    rec = Recorder(validate_spec(SPEC), ledger, writer, "s1", None, None)
    for r in _results():
        rec.record(r)
    assert "connection refused" in rec.close()
    assert [r["mlflow_run_id"] for r in ledger.rows()] == [None, None]
