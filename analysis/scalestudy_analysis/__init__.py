"""Analysis of scalestudy studies: tidy DataFrame -> the paper's figures -> an HTML report.

Notebook use::

    from scalestudy_analysis import load_study, throughput_scaling
    df = load_study("fsdp_scaling")          # ledger results/<study>/trials.parquet, else MLflow
    fig = throughput_scaling(df)             # a matplotlib Figure (FigureSkipped if it can't be)

Command line: ``scalestudy report STUDY [--out DIR]``.
"""

from scalestudy_analysis.base import FigureSkipped
from scalestudy_analysis.figures import FIGURES, Panel, draw_all, save_pngs
from scalestudy_analysis.figures_compare import (
    hardware_generations,
    parallelism_degrees,
    pareto_frontier,
    prediction_parity,
    workload_utilization,
)
from scalestudy_analysis.figures_scaling import (
    power_scaling,
    scaling_efficiency,
    step_time_breakdown,
    throughput_scaling,
)
from scalestudy_analysis.figures_trials import (
    loss_curves,
    memory_per_device,
    step_time_distribution,
    trial_overview,
)
from scalestudy_analysis.load import (
    MEASURED,
    PREDICTED,
    StudyNotFound,
    load_ledger,
    load_mlflow,
    load_study,
    pair_predictions,
    results_frame,
)
from scalestudy_analysis.report import Report, report_study, write_report

__all__ = [
    "FIGURES", "FigureSkipped", "MEASURED", "PREDICTED", "Panel", "Report", "StudyNotFound",
    "draw_all", "hardware_generations", "load_ledger", "load_mlflow", "load_study",
    "loss_curves", "memory_per_device", "pair_predictions", "parallelism_degrees",
    "pareto_frontier", "power_scaling", "prediction_parity", "report_study", "results_frame",
    "save_pngs", "scaling_efficiency", "step_time_breakdown", "step_time_distribution",
    "throughput_scaling", "trial_overview", "workload_utilization", "write_report",
]
