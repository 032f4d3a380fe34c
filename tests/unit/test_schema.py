"""One owner for the schema: config columns from TrialConfig, one way back from a row, one
trial-identity key, names that tell every swept trial apart, one bus-bandwidth factor."""

from __future__ import annotations

import math

import pytest

from scalestudy import metrics as M
from scalestudy.metrics import Status, TrialResult
from scalestudy.perfmodel.predict import predict
from scalestudy.spec.load import load_spec, validate_spec
from scalestudy.plan import plan_study
from scalestudy.spec.study import expand
from scalestudy.spec.trial import (TRIAL_KEY, TrialConfig, config_columns, config_from_row,
                                   name_axes_of, trial_key, trial_name)
from scalestudy.track.ledger import result_to_row, row_to_result
from scalestudy.track.mlflow_writer import CONFIG_PARAMS
from tests.conftest import QUICKSTART

# The ledger's config columns before the schema was derived, plus the requested precision.
LEDGER_CONFIG_COLUMNS = [
    "study", "trial_id", "backend", "model", "hardware", "world_size", "nodes", "dp", "tp", "pp",
    "schedule", "virtual_stages", "first_stage_fewer_layers", "last_stage_fewer_layers",
    "zero_stage", "micro_batch", "grad_accum", "global_batch", "seq_len", "precision",
    "precision_requested", "activation_checkpointing", "recompute_granularity",
    "sequence_parallel", "cp", "gather_granularity", "tp_comm_overlap", "fp8", "seed",
    "learning_rate", "trial_timeout_s", "steps_warmup", "steps_measure", "steps_profile",
]


def _configs(**spec):
    base = {"name": "s", "model": "llama2-tiny", "hardware": "cpu-local", "backend": "simulate"}
    return [p.config for p in expand(validate_spec({**base, **spec}))]


def test_result_config_columns_are_trial_configs():
    assert list(config_columns()) == LEDGER_CONFIG_COLUMNS
    fields = list(TrialResult.model_fields)
    assert fields[:len(LEDGER_CONFIG_COLUMNS)] == LEDGER_CONFIG_COLUMNS
    assert set(CONFIG_PARAMS) == set(LEDGER_CONFIG_COLUMNS)  # MLflow params: the same columns
    cfg = _configs()[0]
    assert list(cfg.config_fields()) == LEDGER_CONFIG_COLUMNS
    assert TrialResult.from_config(cfg, Status.completed).precision == cfg.precision.value


def test_a_field_added_to_trial_config_becomes_a_column():
    # placement_timeout_s: how long a trial may wait for nodes, not what it measures (no column)
    extra = TrialConfig.model_fields.keys() - {"model_dims", "hardware_profile", "steps",
                                               "fault_tolerance", "elastic", "name_axes",
                                               "placement_timeout_s"}
    assert extra == set(config_columns()) - {"trial_id", "steps_warmup", "steps_measure",
                                             "steps_profile"}


@pytest.mark.parametrize("via", ["result", "ledger row", "frame row"])
def test_config_from_row_round_trips(via):
    cfg = _configs(world_size=4, tp=2, micro_batch=2, global_batch=8, seq_len=256,
                   activation_checkpointing=True, precision="fp32")[0]
    result = predict(cfg)
    if via == "result":
        row = result
    elif via == "ledger row":
        row = result_to_row(result, result_id="x")
    else:
        from scalestudy_analysis.load import results_frame

        row = results_frame([result]).to_dict("records")[0]
    back = config_from_row(row)
    assert back.trial_id == cfg.trial_id
    assert back.config_fields() == cfg.config_fields()
    assert back.layout == cfg.layout


def test_config_from_row_refuses_what_the_catalogue_cannot_rebuild():
    row = result_to_row(predict(_configs()[0]))
    from scalestudy.errors import SpecError

    with pytest.raises(SpecError, match="catalogue"):
        config_from_row({**row, "model": "custom-llama-h64-l2"})
    with pytest.raises(SpecError, match="hardware"):
        config_from_row({**row, "hardware": "my-profile"})


def test_trial_key_tells_global_batch_and_checkpointing_apart():
    assert "global_batch" in TRIAL_KEY and "activation_checkpointing" in TRIAL_KEY
    cfgs = _configs(world_size=2, global_batch=[2, 4], activation_checkpointing=[False, True])
    keys = {trial_key(c) for c in cfgs}
    assert len(keys) == 4
    # the same point measured and predicted shares its key, however it is held
    assert trial_key(cfgs[0]) == trial_key(predict(cfgs[0])) == trial_key(result_to_row(
        predict(cfgs[0])))
    row = row_to_result(result_to_row(predict(cfgs[0])))
    assert trial_key(row) == trial_key(cfgs[0])


def test_run_names_show_every_swept_axis():
    cfgs = _configs(world_size=4, micro_batch=1, global_batch=8,
                    activation_checkpointing=[False, True])
    names = [c.run_name for c in cfgs]
    assert names == ["ws4-tp1-z0-mb1-ga2-ac0", "ws4-tp1-z0-mb1-ga2-ac1"]
    results = [predict(c) for c in cfgs]
    assert [trial_name(r, name_axes_of(results)) for r in results] == names
    two = _configs(model=["llama2-tiny", "llama2-small"], seq_len=[128, 256], precision=["bf16",
                                                                                      "fp32"])
    assert len({c.run_name for c in two}) == len(two) == 8
    assert two[0].run_name == "llama2-tiny-ws1-tp1-z0-mb1-s128-bf16"


def test_quickstart_names_stay_short():
    names = [p.config.run_name for p in plan_study(load_spec(QUICKSTART))]
    assert names[:2] == ["ws1-tp1-z0-mb4", "ws1-tp1-z1-mb4"] and len(set(names)) == 8


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_busbw_factor_is_nccl_tests(n):
    assert M.busbw_factor(M.ALL_REDUCE, n) == pytest.approx(2 * (n - 1) / n)
    assert M.busbw_factor(M.ALL_GATHER, n) == M.busbw_factor(M.REDUCE_SCATTER, n) == (n - 1) / n
    assert M.busbw_factor(M.SEND_RECV, n) == M.busbw_factor(M.BROADCAST, n) == 1.0
    assert M.busbw_factor("barrier", n) == 1.0  # no payload: bus bytes stay 0, not NaN
    with pytest.raises(ValueError):
        M.busbw_factor(M.ALL_REDUCE, 0)


def test_the_default_search_metric_is_a_metric():
    from scalestudy.spec.sections import Search

    assert M.search_metric(Search().metric) in M.SCALAR_METRICS


def test_a_result_with_nan_collective_figures_crosses_json_and_back():
    """A trial's result reaches the driver as JSON (sweep/trainable.py); a collective whose groups
    are unknown has NaN bus figures, which must read back as NaN, not fail as null."""
    cfg = expand(validate_spec(load_spec(QUICKSTART)))[0].config
    result = predict(cfg)
    result = result.model_copy(update={"comm": {"all_gather": M.CollectiveStats(
        count=2.0, bytes=1e6, time_s=0.01)}})
    back = TrialResult.model_validate_json(result.model_dump_json())
    assert math.isnan(back.comm["all_gather"].bus_bytes) and back.comm["all_gather"].count == 2.0
