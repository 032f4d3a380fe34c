"""The report predicts measured trials with the profile it is given (`scalestudy report --profile`,
what `make demo` passes after its quick calibration), and the parity figure's title says which
profile that was, in red when it is the uncalibrated catalogue's."""

from __future__ import annotations

import pytest

from scalestudy.spec import catalog
from scalestudy_analysis.figures_compare import prediction_parity
from scalestudy_analysis.load import PREDICTED, PROFILES_ATTR, results_frame
from scalestudy_analysis.predictions import is_calibrated, with_predictions
from tests.fixtures.synthetic import synthetic_results

pytest.importorskip("scalestudy.perfmodel.predict")


def _measured():
    return results_frame(synthetic_results(world_sizes=(1, 2), models=("llama2-tiny",),
                                           hardware=("cpu-local",), zero_stages=(0,),
                                           seq_lens=(128,), micro_batches=(4,)))


def _calibrated():
    base = catalog.get_hardware("cpu-local")
    cal = {**base.calibration, "gemm_tflops_fp32": [[1e6, 0.01], [1e9, 0.05]],
           "gemm_tflops_bf16": [[1e6, 0.01], [1e9, 0.05]], "in_step_slowdown": 3.0}
    return base.model_copy(update={"calibration": cal,
                                   "description": "test (calibrated 2026-12-04T14:00:00Z)"})


def _suptitle(fig) -> str:
    return fig._suptitle.get_text() if fig._suptitle else ""


def test_uncalibrated_predictions_say_so_in_the_title():
    assert not is_calibrated(catalog.get_hardware("cpu-local"))
    df, note = with_predictions(_measured())
    assert "UNCALIBRATED" in note
    assert df.attrs[PROFILES_ATTR] == {"cpu-local": "cpu-local, UNCALIBRATED catalogue figures"}
    assert "UNCALIBRATED" in _suptitle(prediction_parity(df))


def test_a_calibrated_profile_predicts_the_trials_of_its_hardware():
    plain, _ = with_predictions(_measured())
    calibrated, note = with_predictions(_measured(), _calibrated())
    assert "calibrated (2026-12-04T14:00:00Z)" in note
    title = _suptitle(prediction_parity(calibrated))
    assert "calibrated" in title and "UNCALIBRATED" not in title
    slow = calibrated[calibrated["source"] == PREDICTED]["step_time_s"].to_numpy()
    fast = plain[plain["source"] == PREDICTED]["step_time_s"].to_numpy()
    assert len(slow) == 2 and (slow > 1.5 * fast).all()
