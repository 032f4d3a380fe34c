"""The sentence generator on hand-made numbers: what it says must follow from the data."""

from __future__ import annotations

import math

import pytest

from scalestudy_analysis import sentences as W
from scalestudy_analysis.load import results_frame
from tests.fixtures.synthetic import synthetic_results


def study(points: dict[int, dict], **kwargs):
    """One measured trial per world size with the given metric values (the rest synthetic)."""
    out = []
    for ws, values in points.items():
        (r,) = synthetic_results(world_sizes=(ws,), **kwargs)
        out.append(r.model_copy(update=values))
    return results_frame(out)


def test_number_formats():
    assert W.fmt_num(13173.8) == "13.2k"
    assert W.fmt_num(2.5e6) == "2.5M"
    assert W.fmt_num(0.0389) == "0.0389"
    assert W.fmt_num(math.nan) == "n/a"
    assert W.fmt_power(614_400) == "614 kW"
    assert W.fmt_power(45) == "45 W"
    assert W.change(100, 59) == "41% below"
    assert W.change(100, 120) == "20% above"
    assert W.pct(0.35) == "35%" and W.pct(0.012) == "1.2%"  # small shares keep a decimal


def test_per_device_drop_is_stated_against_the_smallest_world_size():
    df = study({8: dict(tokens_per_s=800.0, tokens_per_s_per_device=100.0),
                2048: dict(tokens_per_s=2048 * 59.0, tokens_per_s_per_device=59.0)})
    first, second = W.throughput_scaling(df)
    assert second.startswith("Per-device throughput at 2048 devices is 41% below 8 devices")
    assert "from 800 to 121k tokens/s" in first and "151x for 256x the devices" in first


def test_efficiency_threshold_sentence():
    per_dev = {8: 100.0, 16: 95.0, 32: 91.0, 64: 70.0}
    df = study({ws: dict(tokens_per_s=ws * v, tokens_per_s_per_device=v)
                for ws, v in per_dev.items()})
    first, second = W.scaling_efficiency(df)
    assert first == "Scaling efficiency at 64 devices is 70% of linear (measured)."
    assert second == "It stays at or above 90% up to 32 devices."


def test_efficiency_compares_series_when_there_are_several():
    rows = synthetic_results(world_sizes=(8, 64), zero_stages=(1, 3))
    rows = [r.model_copy(update=dict(tokens_per_s_per_device=(
        100.0 if r.world_size == 8 else (80.0 if r.zero_stage == 1 else 50.0)))) for r in rows]
    _, second = W.scaling_efficiency(results_frame(rows))
    assert second == ("Across the 2 series, efficiency at their largest world size ranges "
                      "from 50% (ZeRO-3) to 80% (ZeRO-1).")


def test_breakdown_sentences():
    df = study({8: dict(step_time_s=1.0, comm_exposed_s=0.05, comm_exposed_fraction=0.05),
                2048: dict(step_time_s=2.0, comm_exposed_s=0.7, comm_exposed_fraction=0.35,
                           bubble_time_s=0.1)})
    first, second = W.step_time_breakdown(df)
    assert first == ("At 2048 devices exposed communication takes 35% of the step time, "
                     "against 5.0% at 8 devices (measured).")
    assert second == ("Compute accounts for 60% of the step at 2048 devices and the pipeline "
                      "bubble for 5.0%.")


def test_power_sentences_use_measured_power():
    df = study({8: dict(power_w=300.0, tokens_per_s=8000.0, tokens_per_j=8000.0 / 2400),
                64: dict(power_w=300.0, tokens_per_s=32000.0, tokens_per_j=32000.0 / 19200)},
               power=False)
    first, second = W.power_scaling(df)
    assert first == ("From 8 to 64 devices total GPU power grows 8x (2.4 kW to 19.2 kW) while "
                     "global throughput grows 4x (measured).")
    assert second == "Tokens per joule fall by 50% (3.33 to 1.67 tokens/J)."


def test_parity_sentences():
    meas = synthetic_results(world_sizes=(8, 16, 32))
    pred = synthetic_results(world_sizes=(8, 16, 32), backends=("simulate",))
    factors = {8: 1.1, 16: 0.7, 32: 1.05}  # errors +10%, -30%, +5%
    pred = [p.model_copy(update=dict(tokens_per_s_per_device=m.tokens_per_s_per_device
                                     * factors[m.world_size])) for p, m in zip(pred, meas)]
    first, second = W.prediction_parity(results_frame(meas + pred))
    assert first.startswith("Over 3 configurations both measured and predicted, the median "
                            "absolute error of the predicted tokens/s per device is 10% "
                            "(worst -30% at ws16-")
    assert second == "The model over-predicts 2 of 3 points; 2 lie within +-20%."


def test_overview_counts_statuses():
    rows = synthetic_results(world_sizes=(64,), tp_pp=((1, 1), (2, 1), (4, 1)),
                             infeasible=[(64, 1, 1)])
    first, second = W.trial_overview(results_frame(rows))
    assert first == "3 measured trials: 2 completed, 1 infeasible."
    both = results_frame(rows + synthetic_results(world_sizes=(64,), backends=("simulate",)))
    assert W.trial_overview(both)[0] == ("3 measured trials (2 completed, 1 infeasible) and "
                                         "1 predicted trial (1 completed).")
    assert second.startswith("The fastest per device is ws64-tp4-z3-mb1")


def test_memory_sentence_compares_with_device_capacity():
    rows = synthetic_results(world_sizes=(8,), zero_stages=(0, 3))
    rows = [r.model_copy(update=dict(peak_memory_gib=40.0 if r.zero_stage == 0 else 10.0))
            for r in rows]
    first, second = W.memory_per_device(results_frame(rows))
    assert first == ("Peak memory per device goes from 40 GiB at zero_stage 0 to 10 GiB at "
                     "zero_stage 3 (-75%) (measured).")
    assert second == ("The largest footprint is 40 GiB (ws8-tp1-z0-mb1), 50% of the 80 GiB of "
                      "one a100-80gb device.")


def test_sentences_speak_about_measured_rows_when_there_are_some():
    rows = synthetic_results(world_sizes=(8, 16), backends=("measure", "simulate"))
    first, _ = W.scaling_efficiency(results_frame(rows))
    assert "(measured)" in first


@pytest.mark.parametrize("name", ["throughput_scaling", "loss_curves"])
def test_sentences_need_the_data_too(name):
    from scalestudy_analysis.base import FigureSkipped

    df = study({8: dict(tokens_per_s=math.nan)}, per_step=False)
    with pytest.raises(FigureSkipped):
        getattr(W, name)(df)


def test_model_size_sentences_from_smallest_to_largest():
    rows = synthetic_results(world_sizes=(256,), models=("llama2-70b", "llama2-7b"))
    share = {"llama2-7b": 0.02, "llama2-70b": 0.3}
    rows = [r.model_copy(update=dict(comm_exposed_fraction=share[r.model],
                                     mfu=0.5 - share[r.model])) for r in rows]
    first, second = W.model_size(results_frame(rows))
    assert first == ("Exposed communication at 256 devices (measured) goes from 2.0% of the "
                     "step for llama2-7b to 30% for llama2-70b.")
    assert second == "MFU goes from 48% for llama2-7b to 20% for llama2-70b."
