"""The report's ensemble figure and finding (analysis/scalestudy_analysis/figures_ensemble.py):
measured and predicted on one plot with the single model marked, and a sentence per comparison
saying where the members overtake the single model and by how much."""

from __future__ import annotations

import pandas as pd
import pytest

from scalestudy import metrics as M
from scalestudy.metrics import Status, TrialResult
from scalestudy.perfmodel.ensemble import compare
from scalestudy.plan import plan_study
from scalestudy.plan.ensemble import plan_ensemble
from scalestudy.spec.load import validate_spec
from scalestudy_analysis.base import GID_DATA, FigureSkipped
from scalestudy_analysis.figures import BY_NAME, draw
from scalestudy_analysis.figures_ensemble import describe, ensemble_comparison
from scalestudy_analysis.load import results_frame

from tests.unit.test_ensemble_predict import SPEC as PAPER_70B_7B

CPU = {"name": "ens", "model": "llama2-tiny", "hardware": "cpu-local", "world_size": 2,
       "micro_batch": 4, "ensemble": {"members": [1, 2]}}


def _predicted(data) -> pd.DataFrame:
    spec = validate_spec(data)
    return results_frame([r for c in plan_ensemble(spec, plan_study(spec)) for r in c.predict()])


def _measured(member_tps: float) -> pd.DataFrame:
    """The CPU comparison as a sweep records it, throughput given, no energy meter."""
    spec = validate_spec(CPU)
    [c] = plan_ensemble(spec, plan_study(spec))
    rows = []
    for group, tps in ((c.runs[0], 1000.0), (c.runs[1], member_tps)):
        results = [s.tag(TrialResult.from_config(
            s.entry.config, Status.completed, tokens_per_s=tps,
            model_tflops_per_device=tps * 3e6 / 1e12 / s.entry.config.world_size,
            timed_window_start_epoch_s=10.0 + s.member_index,
            timed_window_end_epoch_s=20.0 + s.member_index,
            missing={M.ENERGY_J: "no RAPL here"}), c) for s in group]
        rows += compare(results)
    return results_frame(rows)


def test_the_predicted_finding_states_the_crossover_and_its_terms():
    df = _predicted(PAPER_70B_7B)
    [sentence] = describe(df)
    assert sentence.startswith("Predicted, 2,048 devices: llama2-7b members overtake one "
                               "llama2-70b in model FLOPs per joule from k = 16 (")
    assert "the single model computes" in sentence and "MFU" in sentence
    assert " W per device" in sentence


def test_measured_and_predicted_on_one_plot_with_the_single_model_marked():
    df = _measured(member_tps=600.0)
    fig = ensemble_comparison(df)
    ax_t, ax_e, ax_r = fig.axes
    labels = [ln.get_label() for ln in ax_t.lines if ln.get_gid() == GID_DATA]
    assert {"measured: llama2-tiny single (N=2)", "predicted: llama2-tiny single (N=2)",
            "measured: llama2-tiny members (N=2)",
            "predicted: llama2-tiny members (N=2)"} == set(labels)
    singles = [ln for ln in ax_t.lines if "single" in ln.get_label()]
    assert all(ln.get_marker() == "*" and list(ln.get_xdata()) == [1] for ln in singles)
    measured = next(ln for ln in ax_t.lines
                    if ln.get_label() == "measured: llama2-tiny members (N=2)")
    assert list(measured.get_xdata()) == [2] and list(measured.get_ydata()) == [1200.0]
    ratio = next(ln for ln in ax_r.lines if ln.get_label().startswith("measured"))
    assert "FLOPs/device-s" in ratio.get_label()  # no energy meter: the fallback, named so
    assert list(ratio.get_ydata()) == pytest.approx([1.2])
    assert "no energy meter" in ax_e.get_title()


def test_the_measured_finding_says_what_it_compares_and_how_far_members_overlapped():
    sentences = describe(_measured(member_tps=400.0))
    measured = next(s for s in sentences if s.startswith("Measured"))
    assert "no count of llama2-tiny members up to k = 2 reaches one llama2-tiny" in measured
    assert "model FLOPs per device-second (no energy meter" in measured and "0.80x" in measured
    assert measured.endswith("the members' timed windows overlapped 90%.")
    assert any(s.startswith("Predicted, 2 devices") for s in sentences)


def test_registered_and_skipped_with_a_note_outside_an_ensemble_study():
    plain = {k: v for k, v in CPU.items() if k != "ensemble"}
    spec = validate_spec({**plain, "backend": "simulate"})
    from scalestudy.perfmodel.predict import predict_many

    df = results_frame(predict_many(plan_study(spec)))
    with pytest.raises(FigureSkipped, match="no ensemble"):
        ensemble_comparison(df)
    panel = draw(df, BY_NAME["ensemble_comparison"])
    assert not panel.drawn and "ensemble" in panel.note
