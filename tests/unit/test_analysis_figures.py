"""Each figure function on a small synthetic study: the right number of series, or a skip note.

Series are counted on the matplotlib objects (lines by gid, bar containers, scatter collections),
never on pixels.
"""

from __future__ import annotations

import pandas as pd
import pytest

from scalestudy.metrics import Status
from scalestudy_analysis import figures_compare as C
from scalestudy_analysis import figures_scaling as S
from scalestudy_analysis import figures_trials as T
from scalestudy_analysis.base import GID_DATA, GID_IDEAL, FigureSkipped
from scalestudy_analysis.figures import FIGURES, draw_all, save_pngs
from scalestudy_analysis.load import results_frame, tidy
from tests.fixtures.synthetic import synthetic_results, synthetic_study


def data_lines(ax, gid=GID_DATA):
    return [ln for ln in ax.lines if ln.get_gid() == gid]


@pytest.fixture(scope="module")
def scaling():
    """ws 8..64, two ZeRO stages, measured and predicted: 4 series (2 stages x 2 sources)."""
    return synthetic_study(zero_stages=(1, 3), backends=("measure", "simulate"))


def test_throughput_scaling_draws_each_series_with_its_ideal(scaling):
    fig = S.throughput_scaling(scaling)
    ax_global, ax_device = fig.axes
    for ax in (ax_global, ax_device):
        assert len(data_lines(ax)) == 4
        assert len(data_lines(ax, GID_IDEAL)) == 4
        assert ax.get_xscale() == "log"
    # ideal global scaling of a series ends at 8x its first point (64 / 8 devices)
    ideal = data_lines(ax_global, GID_IDEAL)[0].get_ydata()
    assert ideal[-1] == pytest.approx(8 * ideal[0])
    labels = {ln.get_label() for ln in data_lines(ax_device)}
    assert labels == {"ZeRO-1 (measured)", "ZeRO-3 (measured)", "ZeRO-1 (predicted)",
                      "ZeRO-3 (predicted)"}


def test_scaling_efficiency_starts_at_100_percent(scaling):
    (ax,) = S.scaling_efficiency(scaling).axes
    lines = data_lines(ax)
    assert len(lines) == 4
    for ln in lines:
        assert ln.get_ydata()[0] == pytest.approx(100.0)
        assert ln.get_ydata()[-1] < 100.0  # the synthetic study loses efficiency with scale


def test_step_time_breakdown_stacks_compute_and_exposed(scaling):
    ax_bars, ax_frac = S.step_time_breakdown(scaling).axes
    # 4 series x 2 parts (no bubble in the synthetic study) = 8 stacked bar containers
    assert len(ax_bars.containers) == 8
    assert len(data_lines(ax_frac)) == 4


def test_step_time_breakdown_adds_bubble_when_reported(scaling):
    df = scaling.copy()
    df["bubble_time_s"] = 0.1 * df["step_time_s"]
    ax_bars, _ = S.step_time_breakdown(df).axes
    assert len(ax_bars.containers) == 12


def test_power_scaling_keeps_measured_and_modelled_apart(scaling):
    ax_power, ax_tpj = S.power_scaling(scaling).axes
    lines = data_lines(ax_power)
    assert len(lines) == 4 and len(data_lines(ax_tpj)) == 4
    assert sum("modelled" in ln.get_label() for ln in lines) == 2


def test_power_scaling_skips_without_power():
    with pytest.raises(FigureSkipped, match="power"):
        S.power_scaling(synthetic_study(power=False))


def test_parallelism_degrees_one_panel_per_model():
    df = synthetic_study(world_sizes=(64,), models=("llama2-7b", "llama2-70b"),
                         tp_pp=((1, 1), (2, 1), (4, 2), (8, 8)), infeasible=[(64, 1, 1)])
    fig = C.parallelism_degrees(df)
    assert [ax.get_title() for ax in fig.axes] == ["llama2-7b at 64 devices",
                                                   "llama2-70b at 64 devices"]  # smallest first
    for ax in fig.axes:
        assert len(ax.containers) == 1  # measured only
        assert len(ax.containers[0]) == 4  # one bar per TP x PP degree
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts.count("infeasible") == 2  # TP1xPP1 of both models


def test_parallelism_degrees_skips_a_single_degree(scaling):
    with pytest.raises(FigureSkipped, match="TP x PP"):
        C.parallelism_degrees(scaling)


def test_hardware_generations_in_generation_order():
    df = synthetic_study(world_sizes=(8, 16), hardware=("h100-80gb", "v100-32gb", "a100-80gb"),
                         backends=("measure", "simulate"))
    ax_mfu, ax_comm = C.hardware_generations(df).axes
    assert [t.get_text() for t in ax_mfu.get_xticklabels()] == ["v100-32gb", "a100-80gb",
                                                                "h100-80gb"]
    assert len(ax_mfu.containers) == 2 and len(ax_comm.containers) == 2  # measured, predicted
    assert "16 devices" in ax_mfu.get_title()  # the largest world size all generations ran


def test_model_size_orders_models_smallest_first():
    df = synthetic_study(world_sizes=(64, 128), models=("llama2-70b", "llama2-7b", "llama2-13b"))
    ax_mfu, ax_comm = C.model_size(df).axes
    assert [t.get_text() for t in ax_mfu.get_xticklabels()] == ["llama2-7b", "llama2-13b",
                                                                "llama2-70b"]
    assert len(ax_mfu.containers) == 1 and len(ax_mfu.containers[0]) == 3
    assert "128 devices" in ax_comm.get_title()
    with pytest.raises(FigureSkipped, match="model"):
        C.model_size(synthetic_study())


def test_workload_utilization_one_panel_per_swept_axis():
    df = synthetic_study(world_sizes=(8,), micro_batches=(1, 2, 4), seq_lens=(1024, 4096))
    ax_mb, ax_seq = C.workload_utilization(df).axes
    assert len(data_lines(ax_mb)) == 2  # one line per sequence length
    assert len(data_lines(ax_seq)) == 3  # one line per micro-batch
    only_mb = synthetic_study(world_sizes=(8,), micro_batches=(1, 2, 4))
    assert len(C.workload_utilization(only_mb).axes) == 1
    with pytest.raises(FigureSkipped, match="micro_batch"):
        C.workload_utilization(synthetic_study(world_sizes=(8,)))


def test_prediction_parity_one_point_per_pair(scaling):
    ax_parity, ax_err = C.prediction_parity(scaling).axes
    (points,) = ax_parity.collections
    assert len(points.get_offsets()) == 8  # 4 world sizes x 2 ZeRO stages
    # The synthetic ZeRO stages run at one speed: 4 distinct spots, each labelled once
    assert len(ax_parity.texts) == 4 and ax_parity.texts[0].get_text() == "+10%"
    assert len(ax_err.collections) == 1


def test_prediction_parity_skips_without_predictions():
    with pytest.raises(FigureSkipped, match="both a measured and a predicted"):
        C.prediction_parity(synthetic_study())


def test_pareto_frontier_marks_non_dominated_trials(scaling):
    pts = C.pareto_points(scaling)
    front = pts[pts["on_frontier"]]
    # on the frontier, more power always buys more throughput
    assert front["power"].is_monotonic_increasing
    assert front["tokens_per_s"].is_monotonic_increasing
    (ax,) = C.pareto_frontier(scaling).axes
    assert len(ax.collections) == 2  # measured, predicted scatter
    assert len(data_lines(ax)) == 1  # the frontier


def test_trial_overview_lists_every_trial_by_status():
    df = synthetic_study(world_sizes=(64,), tp_pp=((1, 1), (2, 1)), infeasible=[(64, 1, 1)])
    (ax,) = T.trial_overview(df).axes
    assert len(ax.get_yticklabels()) == 2
    assert {c.get_label() for c in ax.containers} == {"completed", "infeasible"}


def test_memory_per_device_against_zero_stage(scaling):
    (ax,) = T.memory_per_device(scaling).axes
    assert "zero_stage" in ax.get_title()
    assert len(data_lines(ax)) == 8  # 4 world sizes x 2 sources
    y = data_lines(ax)[0].get_ydata()
    assert y[-1] < y[0]  # ZeRO-3 shards what ZeRO-1 replicates


def test_step_time_distribution_and_losses_use_measured_lists(scaling):
    (ax,) = T.step_time_distribution(scaling).axes
    assert len(ax.get_xticklabels()) == 8  # measured trials only
    (ax,) = T.loss_curves(scaling).axes
    assert len(data_lines(ax)) == 8
    with pytest.raises(FigureSkipped, match="per-step"):
        T.step_time_distribution(synthetic_study(per_step=False))


def test_missing_columns_skip_with_a_note():
    df = synthetic_study().drop(columns=["peak_memory_gib"])
    with pytest.raises(FigureSkipped, match="no peak_memory_gib column"):
        T.memory_per_device(df)


def test_only_completed_trials_are_drawn():
    df = synthetic_study(world_sizes=(8, 16, 32))
    df.loc[df["world_size"] == 32, "status"] = "failed"
    (ax,) = S.scaling_efficiency(df).axes
    assert list(data_lines(ax)[0].get_xdata()) == [8, 16]


def test_draw_all_never_fails_and_writes_pngs(tmp_path):
    df = tidy(pd.concat([synthetic_study(backends=("measure", "simulate")),
                         synthetic_study(world_sizes=(8,), micro_batches=(1, 2))]))
    panels = draw_all(df)
    assert [p.name for p in panels] == [f.name for f in FIGURES]
    drawn = [p for p in panels if p.drawn]
    assert all(len(p.sentences) == 2 for p in drawn), [(p.name, p.sentences) for p in drawn]
    assert all(p.note for p in panels if not p.drawn)
    paths = save_pngs(panels, tmp_path)
    assert len(paths) == len(drawn) >= 10
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_a_study_where_nothing_completed_still_reports():
    rows = synthetic_results(world_sizes=(8, 16))
    failed = [r.model_copy(update=dict(status=Status.failed, reason="oom", tokens_per_s=float("nan"),
                                       tokens_per_s_per_device=float("nan")))
              for r in rows]
    panels = {p.name: p for p in draw_all(results_frame(failed))}
    assert panels["trial_overview"].drawn
    assert panels["trial_overview"].sentences[1] == "No trial completed, so none has a throughput."
    assert not panels["throughput_scaling"].drawn
    assert "no completed trial" in panels["throughput_scaling"].note
