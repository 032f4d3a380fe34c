"""Loading a study: ledger and MLflow rows become one tidy frame in the TrialResult schema."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from scalestudy.metrics import TrialResult
from scalestudy.track.ledger import Ledger, ledger_path
from scalestudy_analysis.load import (
    MEASURED,
    PREDICTED,
    StudyNotFound,
    find_spec,
    load_study,
    pair_predictions,
    results_frame,
    runs_to_rows,
)
from tests.fixtures.synthetic import synthetic_results


def test_frame_has_the_trial_result_schema_and_sources():
    rows = synthetic_results(world_sizes=(8, 16), backends=("measure", "simulate"))
    df = results_frame(rows)
    assert set(TrialResult.model_fields) - {"comm"} <= set(df.columns)
    assert sorted(df["source"].unique()) == [MEASURED, PREDICTED]
    assert df["world_size"].dtype.kind == "i" and df["mfu"].dtype.kind == "f"
    assert df["status"].tolist() == ["completed"] * 4
    # modelled power stays apart from measured power (never mixed into one column)
    pred = df[df["source"] == PREDICTED]
    assert pred["total_power_w"].isna().all() and pred["total_power_w_estimated"].notna().all()


def test_missing_metrics_stay_nan_not_zero():
    df = results_frame(synthetic_results(comm=False, power=False))
    assert df["comm_exposed_s"].isna().all() and df["power_w"].isna().all()


def test_ledger_round_trip(tmp_path):
    results = synthetic_results(world_sizes=(8, 16, 32))
    ledger = Ledger(ledger_path("syn", tmp_path))
    for r in results:
        ledger.append(r)
    df = load_study("syn", results_root=tmp_path, source="ledger")
    assert len(df) == 3
    assert df["tokens_per_s"].tolist() == pytest.approx([r.tokens_per_s for r in results])
    assert df["step_times_s"].iloc[0] == pytest.approx(results[0].step_times_s)
    assert isinstance(df["missing"].iloc[0], dict)


def test_unknown_study_names_both_stores(tmp_path):
    uri = f"sqlite:///{tmp_path / 'absent.db'}"
    with pytest.raises(StudyNotFound, match="no ledger at .* and no trial runs"):
        load_study("nope", results_root=tmp_path, tracking_uri=uri)
    assert not (tmp_path / "absent.db").exists()  # reading never creates a store


def test_mlflow_columns_are_cast_back_and_newest_run_wins():
    runs = pd.DataFrame([
        {"run_id": "new", "params.world_size": "16", "params.activation_checkpointing": "False",
         "params.learning_rate": "0.001", "params.model": "llama2-7b", "metrics.mfu": 0.4,
         "metrics.comm/all_gather/bytes": 1e9, "tags.status": "completed", "tags.reason": "",
         "tags.backend": "measure", "tags.trial_id": "t1"},
        {"run_id": "old", "params.world_size": "16", "metrics.mfu": 0.1,
         "tags.status": "failed", "tags.trial_id": "t1"},
        {"run_id": "x", "params.world_size": "8", "metrics.mfu": math.nan,
         "tags.status": "infeasible", "tags.reason": "needs 93.1 GiB", "tags.trial_id": "t2"},
    ])
    rows = runs_to_rows(runs)
    assert [r["trial_id"] for r in rows] == ["t1", "t2"]
    first = rows[0]
    assert first["world_size"] == 16 and isinstance(first["world_size"], int)
    assert first["activation_checkpointing"] is False
    assert first["mfu"] == 0.4 and first["mlflow_run_id"] == "new"
    assert first["comm/all_gather/bytes"] == 1e9
    assert "reason" not in first  # an empty tag is no reason
    assert rows[1]["reason"] == "needs 93.1 GiB" and rows[1]["mfu"] is None


def test_pairs_match_configurations_across_backends():
    meas = synthetic_results(world_sizes=(8, 16, 32))
    pred = synthetic_results(world_sizes=(8, 16), backends=("simulate",))
    pairs = pair_predictions(results_frame(meas + pred))
    assert pairs["world_size"].tolist() == [8, 16]
    assert pairs["rel_error"].tolist() == pytest.approx([0.1, 0.1])  # synthetic: +10%


def test_a_ledger_older_than_a_layout_option_still_pairs():
    """A measured row written before a layout option existed has NaN in its column; the option's
    default is what it ran, so it pairs with a prediction that records the default."""
    from scalestudy.spec.trial import LAYOUT_DEFAULTS

    df = results_frame(synthetic_results(world_sizes=(8, 16), backends=("measure", "simulate")))
    old = df["source"] == MEASURED
    for name in LAYOUT_DEFAULTS:
        if name in df:
            df[name] = df[name].astype(object)
            df.loc[old, name] = math.nan
    pairs = pair_predictions(df)
    assert pairs["world_size"].tolist() == [8, 16]


def test_find_spec_by_study_name(tmp_path):
    (tmp_path / "a.yaml").write_text("name: other\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("name: mine\nmodel: llama2-tiny\n")
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    assert find_spec("mine", [tmp_path]) == tmp_path / "sub" / "b.yaml"
    assert find_spec("absent", [tmp_path]) is None


def test_predicted_twins_of_measured_catalogue_trials():
    pytest.importorskip("scalestudy.perfmodel.predict")
    from scalestudy_analysis.predictions import with_predictions

    (r,) = synthetic_results(world_sizes=(8,), models=("llama2-7b",), hardware=("a100-80gb",))
    df, note = with_predictions(results_frame([r]))
    assert df["source"].tolist() == [MEASURED, PREDICTED]
    assert "1 predicted rows were computed now" in note
    twin = df.iloc[1]
    assert (twin["world_size"], twin["zero_stage"], twin["backend"]) == (8, 3, "simulate")
    again, note = with_predictions(df)  # a configuration that has a prediction gets no second
    assert len(again) == 2 and note is None


def test_predicted_twin_of_a_measured_tp_trial_prices_the_autotp_it_ran():
    """A catalogue GPU profile prices TP as the published Megatron runs did; the twin of a measured
    trial is priced as that trial ran, with AutoTP's all-reduce per column-parallel Linear."""
    pytest.importorskip("scalestudy.perfmodel.predict")
    from scalestudy.perfmodel.params import params_for
    from scalestudy.perfmodel.predict import predict
    from scalestudy.spec.trial import Backend, config_from_row
    from scalestudy_analysis.predictions import with_predictions

    (r,) = synthetic_results(world_sizes=(8,), zero_stages=(1,), tp_pp=((8, 1),))
    df, _ = with_predictions(results_frame([r]))
    twin = df[df["source"] == PREDICTED].iloc[0]
    cfg = config_from_row(r).model_copy(update={"backend": Backend.simulate})
    megatron = predict(cfg)
    autotp = predict(cfg, params=params_for(cfg.hardware_profile, tp_all_reduce_per_linear=True))
    assert autotp.comm["all_reduce"].count > megatron.comm["all_reduce"].count
    assert twin["tokens_per_s"] == pytest.approx(autotp.tokens_per_s)
    assert twin["tokens_per_s"] < megatron.tokens_per_s
