"""docs/headline.md's numbers are computed from the studies, and a missing study is an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from scalestudy.perfmodel.predict import predict_many
from scalestudy.spec.load import load_spec
from scalestudy.plan import plan_study
from scalestudy_analysis.findings import findings, render
from scalestudy_analysis.load import results_frame

PAPER = Path(__file__).parents[2] / "experiments" / "paper"


def _frame(name: str):
    return results_frame(predict_many(plan_study(load_spec(PAPER / f"{name}.yaml"))))


def test_fsdp_numbers_come_from_the_frame():
    df = _frame("fsdp_scaling")
    out = findings({"fsdp_scaling": df})
    rows = df.sort_values("world_size")
    drop = 1 - rows["tokens_per_s_per_device"].iloc[-1] / rows["tokens_per_s_per_device"].iloc[0]
    assert out["fsdp_drop"] == f"{drop:.0%}"
    assert out["fsdp_w1"] == "2,048"
    assert render("{fsdp_w0} -> {fsdp_w1}", {"fsdp_scaling": df}) == "8 -> 2,048"


def test_a_placeholder_of_an_unswept_study_is_an_error():
    with pytest.raises(KeyError, match="mp_70b_best"):
        render("{mp_70b_best}", {})


def test_report_says_modelled_energy_is_not_validated():
    from scalestudy_analysis.html import render as render_html

    df = _frame("fsdp_scaling")
    text = render_html("fsdp_scaling", df, [], spec_text=None, spec_source=None, versions={},
                       data_source="a test")
    assert "modelled, not validated" in text
    assert "node_overhead_power_w_estimated" in text
    assert df["node_overhead_power_w_estimated"].notna().all()  # the separate, named estimate
