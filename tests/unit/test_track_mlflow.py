"""A trial's MLflow run: every config column a param (the precision it ran at included), its
metrics and per-step series under metrics.py's names, in a local sqlite store."""

from __future__ import annotations

from scalestudy import metrics as M
from scalestudy.metrics import Status, TrialResult
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand
from scalestudy.spec.trial import config_columns
from scalestudy.track.mlflow_writer import MlflowWriter


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
