"""The report's plan figure (analysis/scalestudy_analysis/figures_plan.py): every layout a
`scalestudy plan` measured, predicted when chosen, by the last refit and measured, from the record
the plan leaves beside the ledger; no record, no figure."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from scalestudy.cli_plan_rounds import _nan_to_none
from scalestudy.plan.rounds import PLAN_RECORD
from scalestudy_analysis.base import GID_DATA, FigureSkipped
from scalestudy_analysis.figures import BY_NAME, draw
from scalestudy_analysis.figures_plan import PLAN_ATTR, describe, plan_rounds
from scalestudy_analysis.report import plan_record

RECORD = {
    "model": "llama2-tiny", "hardware": "cpu-local", "devices": 2, "objective": "tokens_per_s",
    "recommended": "ws2-z1-mb4", "stop_reason": "budget spent", "spent_trials": 3,
    "spent_device_hours": 0.01,
    "rounds": [{"index": 1, "in_sample_error": 0.02, "heldout_error": None},
               {"index": 2, "in_sample_error": 0.03, "heldout_error": 0.1}],
    "layouts": [
        {"round": 1, "trial": "ws2-z1-mb4", "family": "data", "predicted": 900.0,
         "predicted_now": 1010.0, "measured": 1000.0},
        {"round": 1, "trial": "ws2-z3-mb4", "family": "zero3", "predicted": 800.0,
         "predicted_now": 620.0, "measured": 600.0},
        {"round": 2, "trial": "ws2-tp2-mb4", "family": "tp", "predicted": 950.0,
         "predicted_now": None, "measured": 500.0},
        {"round": 2, "trial": "ws2-z0-mb8", "family": "data", "predicted": 990.0,
         "predicted_now": None, "measured": None},  # failed: not drawn
    ],
}


def _frame(record=None) -> pd.DataFrame:
    df = pd.DataFrame({"hardware": ["cpu-local"]})
    if record is not None:
        df.attrs[PLAN_ATTR] = record
    return df


def test_every_completed_layout_in_three_series_the_recommended_marked():
    fig = plan_rounds(_frame(RECORD))
    (ax,) = fig.axes
    series = [c for c in ax.collections if c.get_gid() == GID_DATA]
    # measured, predicted when chosen in rounds 1 and 2, predicted by the last refit
    assert len(series) == 4
    assert [len(c.get_offsets()) for c in series] == [3, 2, 1, 3]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[-1] == "* ws2-z1-mb4 (data)"  # sorted by measured: the best on top
    assert "stopped: budget spent" in ax.get_title()


def test_sentences_say_what_it_spent_and_both_errors():
    text = " ".join(describe(_frame(RECORD)))
    assert "3 layouts in 2 rounds (3 trials" in text
    assert "Recommended: ws2-z1-mb4 (data), measured 1k tokens/s" in text
    # |900/1000-1| + |800/600-1| + |950/500-1| over 3; the refit over the 2 it predicts
    assert "out of sample): 44% mean absolute" in text
    assert "in sample): 2.2%" in text


def test_no_plan_no_figure():
    with pytest.raises(FigureSkipped, match="no `scalestudy plan` measured this study"):
        plan_rounds(_frame())
    assert draw(_frame(), BY_NAME["plan_rounds"]).note is not None


def test_the_record_round_trips_through_the_results_root(tmp_path):
    record = {**RECORD, "layouts": [{**RECORD["layouts"][0], "error_now": math.nan}]}
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / PLAN_RECORD).write_text(json.dumps(_nan_to_none(record)))
    assert plan_record("s", tmp_path)["layouts"][0]["error_now"] is None  # strict JSON: null
    assert plan_record("other", tmp_path) is None
