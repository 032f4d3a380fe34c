"""A prediction says what it took from outside its profile's calibration (perfmodel/coverage.py,
issue 34 item 0): in the result, the ledger, and the notes of predict, plan and the report."""

from __future__ import annotations

import pytest

from scalestudy.metrics import Status
from scalestudy.perfmodel import coverage
from scalestudy.perfmodel.predict import predict
from scalestudy.spec import catalog
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand
from scalestudy.track.ledger import result_to_row, row_to_result

CALIBRATED = {  # what a quick fp32 calibration at world 2 writes (keys; figures of the right size)
    "gemm_tflops_fp32": [[7.9e5, 0.06], [3.5e7, 0.09], [9.1e8, 0.09]],
    "attention_s_fp32": [[16.0, 96.0, 16.0, 3e-4, 7e-4], [8.0, 384.0, 32.0, 3e-3, 7e-3]],
    "busbw_gbps_all_reduce": [[4096.0, 0.003], [4194304.0, 1.5]],
    "tp_collective_overhead_s": 0.002, "busbw_gbps_send_recv": [[4096.0, 0.02], [4194304.0, 3.5]],
    "pipeline_compute_factor": 0.9, "reference_step_s_fp32_ws1": 0.1,
}


def _cfg(calibration: dict | None = None, **spec):
    base = {"name": "c", "model": "llama2-tiny", "hardware": "cpu-local", "backend": "simulate",
            "precision": "fp32", "seq_len": 128, "micro_batch": 1, **spec}
    cfg = expand(validate_spec(base))[0].config
    if calibration is None:
        return cfg
    hw = cfg.hardware_profile.model_copy(update={"calibration": calibration})
    return cfg.model_copy(update={"hardware_profile": hw})


def test_a_catalogue_profile_says_so_once():
    assert coverage.uncalibrated(_cfg()) == [coverage.NOT_CALIBRATED]
    h100 = _cfg(hardware="h100-80gb", model="llama2-7b", seq_len=4096, precision="bf16")
    assert coverage.uncalibrated(h100) == [coverage.NOT_CALIBRATED]  # published efficiencies only


def test_what_the_calibration_covered_leans_on_nothing():
    assert coverage.uncalibrated(_cfg(CALIBRATED)) == []
    assert coverage.uncalibrated(_cfg(CALIBRATED, world_size=2, tp=2)) == []
    assert coverage.uncalibrated(_cfg(CALIBRATED, world_size=2, pp=2, global_batch=4,
                                      micro_batch=1)) == []


@pytest.mark.parametrize("drop, spec, expected", [
    ("gemm_tflops_fp32", {}, "fp32 not calibrated"),
    ("busbw_gbps_all_reduce", {"world_size": 2}, "data-parallel collectives not calibrated"),
    ("tp_collective_overhead_s", {"world_size": 2, "tp": 2}, "tp path not calibrated"),
    ("busbw_gbps_send_recv", {"world_size": 2, "pp": 2, "global_batch": 4}, "pp path not calibrated"),
    ("pipeline_compute_factor", {"world_size": 2, "pp": 2, "global_batch": 4},
     "pp path not calibrated"),
])
def test_each_missing_path_is_named(drop, spec, expected):
    cal = {k: v for k, v in CALIBRATED.items() if k != drop}
    lines = coverage.uncalibrated(_cfg(cal, **spec))
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_the_other_precision_and_shapes_far_outside_are_named():
    assert coverage.uncalibrated(_cfg(CALIBRATED, precision="bf16"))[0].startswith(
        "bf16 not calibrated")
    big = coverage.uncalibrated(_cfg(CALIBRATED, model="llama2-7b", seq_len=4096))
    assert any(line.startswith("GEMMs of") for line in big), big
    assert any(line.startswith("attention tile (sequence 4096, head dim 128)") for line in big), big


def test_the_result_and_the_ledger_carry_it_and_the_note_counts_it():
    r = predict(_cfg(CALIBRATED, precision="bf16"))
    assert r.status is Status.completed and r.uncalibrated[0].startswith("bf16 not calibrated")
    assert row_to_result(result_to_row(r)).uncalibrated == r.uncalibrated
    assert predict(_cfg(CALIBRATED)).uncalibrated == []
    note = coverage.summary([r.uncalibrated, [], r.uncalibrated])
    assert note.startswith("2 of 3 predictions lean on") and "(2)" in note
    assert coverage.summary([[], []]) is None
