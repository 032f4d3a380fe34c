"""A trial's MLflow run: every config column a param (the precision it ran at included), its
metrics and per-step series under metrics.py's names, in a local sqlite store; retries (one failed
call is not the end of MLflow for the study); a sweep's predictions as one table on its parent."""

from __future__ import annotations

from scalestudy import metrics as M
from scalestudy.metrics import Status, TrialResult
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand
from scalestudy.spec.trial import config_columns
from scalestudy.track.mlflow_writer import (
    BEST_PREFIX, COUNT_PREFIX, HTTP_RETRY_ENV, MAX_FAILURES_IN_A_ROW, PREDICTIONS_ARTIFACT,
    PREDICTIONS_TAG, MlflowWriter,
)


def test_log_trial_writes_config_params_and_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALESTUDY_CPU_NATIVE_BF16", "0")
    (p,) = expand(validate_spec({"name": "mlf", "model": "llama2-tiny", "hardware": "cpu-local",
                                 "precision": "auto"}))
    result = TrialResult.from_config(p.config, Status.completed, step_time_s=0.5,
                                     losses=[2.0, 1.5], step_times_s=[0.5, 0.5])
    writer = MlflowWriter(f"sqlite:///{tmp_path / 'mlflow.db'}", "mlf")
    run_id = writer.log_trial(result, None, "result-1", p.config.run_name)
    assert writer.error is None and run_id
    run = writer.client.get_run(run_id)
    assert set(run.data.params) == set(config_columns())
    assert (run.data.params["precision"], run.data.params["precision_requested"]) == ("fp32", "auto")
    assert run.data.metrics[M.STEP_TIME_S] == 0.5
    history = writer.client.get_metric_history(run_id, M.TRAIN_LOSS)
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == [2.0, 1.5]


def _result(world_size: int = 1) -> TrialResult:
    (p,) = expand(validate_spec({"name": "mlf", "model": "llama2-tiny", "hardware": "cpu-local",
                                 "world_size": world_size}))
    return TrialResult.from_config(p.config, Status.completed, step_time_s=0.5)


def test_one_failed_call_does_not_turn_mlflow_off(tmp_path, monkeypatch, caplog):
    """A blip (after MLflow's own HTTP retries) costs that call only; the next call logs. Only
    MAX_FAILURES_IN_A_ROW failures in a row take the store as down for the rest of the command."""
    writer = MlflowWriter(f"sqlite:///{tmp_path / 'mlflow.db'}", "mlf")
    create_run = writer.client.create_run
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("503 from the tracking server")
        return create_run(*args, **kwargs)

    monkeypatch.setattr(writer.client, "create_run", flaky)
    result = _result()
    assert writer.log_trial(result, None, "r1", "t") is None
    assert "503" in writer.error and writer.enabled and "tries again" in caplog.text
    assert writer.log_trial(result, None, "r2", "t")  # the next call goes through
    assert writer.failures_in_a_row == 0

    def down(*args, **kwargs):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(writer.client, "create_run", down)
    for _ in range(MAX_FAILURES_IN_A_ROW):
        assert writer.enabled and writer.log_trial(result, None, "r3", "t") is None
    assert not writer.enabled and "off for the rest" in caplog.text
    monkeypatch.setattr(writer.client, "create_run", create_run)
    assert writer.log_trial(result, None, "r4", "t") is None  # off: no more tries


def test_http_retries_back_off_within_seconds(tmp_path, monkeypatch):
    for name in HTTP_RETRY_ENV:
        monkeypatch.delenv(name, raising=False)
    MlflowWriter(f"sqlite:///{tmp_path / 'mlflow.db'}", "mlf")
    from mlflow.environment_variables import (
        MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR, MLFLOW_HTTP_REQUEST_MAX_RETRIES,
    )

    assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 3 > 0  # retried, not failed at once
    assert MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.get() == 1
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")  # a user's setting wins
    MlflowWriter(f"sqlite:///{tmp_path / 'mlflow.db'}", "mlf")
    assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 5


def test_predictions_are_one_table_on_the_parent_run(tmp_path):
    import pyarrow.parquet as pq

    from scalestudy.track.ledger import result_to_row

    writer = MlflowWriter(f"sqlite:///{tmp_path / 'mlflow.db'}", "mlf")
    parent = writer.create_parent("sweep-1", "sweep")
    rows = [result_to_row(_result(1), result_id="a"),
            result_to_row(_result(2).model_copy(update={"tokens_per_s_per_device": 7.0}),
                          result_id="b")]
    assert writer.has_predictions(parent) is False
    assert writer.log_predictions(parent, rows) and writer.has_predictions(parent)
    run = writer.client.get_run(parent)
    assert run.data.tags[PREDICTIONS_TAG] == "2"
    assert run.data.metrics[f"{BEST_PREFIX}{M.TOKENS_PER_S_PER_DEVICE}"] == 7.0
    assert run.data.metrics[f"{COUNT_PREFIX}completed"] == 2
    table = pq.read_table(writer.client.download_artifacts(parent, PREDICTIONS_ARTIFACT, str(tmp_path)))
    assert table.column("result_id").to_pylist() == ["a", "b"]
    assert {a.path for a in writer.client.list_artifacts(parent)} >= {PREDICTIONS_ARTIFACT,
                                                                      "predictions.csv"}


def test_sync_uploads_missing_measured_rows_once_and_patches_the_ledger(tmp_path):
    """The ledger is the truth: rows MLflow never got become child runs under their sweep's parent;
    the ledger gets their run ids (patch parts) and a fresh export; a second sync logs nothing."""
    import pyarrow.parquet as pq

    from scalestudy.track.ledger import Ledger, ledger_path
    from scalestudy.track.sync import sync_mlflow

    ledger = Ledger(ledger_path("mlf", tmp_path))
    for i, world in enumerate((1, 2)):
        ledger.append(_result(world), result_id=f"res-{i}", sweep_id="sw1", experiment="mlf",
                      mlflow_run_id=None)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert sync_mlflow("mlf", uri, results_root=tmp_path) == (2, None)
    assert sync_mlflow("mlf", uri, results_root=tmp_path) == (0, None)
    writer = MlflowWriter(uri, "mlf")
    runs = writer.client.search_runs([writer.experiment_id])
    children = [r for r in runs if r.data.tags.get("scalestudy.role") == "trial"]
    (parent,) = [r for r in runs if r.data.tags.get("scalestudy.role") == "sweep"]
    assert sorted(r.data.tags["scalestudy.result_id"] for r in children) == ["res-0", "res-1"]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    ids = {r["mlflow_run_id"] for r in ledger.rows()}
    assert ids == {r.info.run_id for r in children}
    assert set(pq.read_table(ledger.path).column("mlflow_run_id").to_pylist()) == ids
