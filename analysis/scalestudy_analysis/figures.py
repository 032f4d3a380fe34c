"""The figure registry: every figure of the report, its title, how to draw it and how to say what
it shows. `draw_all` draws each one or records why it was skipped; it never fails as a whole."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from scalestudy_analysis import figures_compare as C
from scalestudy_analysis import figures_ensemble as E
from scalestudy_analysis import figures_plan as P
from scalestudy_analysis import figures_scaling as S
from scalestudy_analysis import figures_trials as T
from scalestudy_analysis import sentences as W
from scalestudy_analysis.base import FigureSkipped

PNG_DPI = 110  # sharp enough on screen, keeps a 13-figure report at a few MB


@dataclass(frozen=True)
class FigureDef:
    name: str
    title: str
    draw: Callable[[pd.DataFrame], Figure]
    describe: Callable[[pd.DataFrame], list[str]]


@dataclass
class Panel:
    """One drawn (or skipped) figure of a report."""

    name: str
    title: str
    figure: Figure | None = None
    sentences: list[str] = field(default_factory=list)
    note: str | None = None  # why the figure was skipped
    _png: bytes | None = field(default=None, repr=False)

    @property
    def drawn(self) -> bool:
        return self.figure is not None

    def png(self) -> bytes:
        """Rendered once: the report embeds the same bytes it writes as the PNG file."""
        if self._png is None:
            buf = io.BytesIO()
            self.figure.savefig(buf, format="png", dpi=PNG_DPI)
            self._png = buf.getvalue()
        return self._png


# Paper figures first (the order of the studies), then the per-trial ones every study has.
FIGURES: tuple[FigureDef, ...] = (
    FigureDef("throughput_scaling", "Throughput vs world size", S.throughput_scaling,
              W.throughput_scaling),
    FigureDef("scaling_efficiency", "Scaling efficiency", S.scaling_efficiency,
              W.scaling_efficiency),
    FigureDef("step_time_breakdown", "Step-time breakdown and exposed communication",
              S.step_time_breakdown, W.step_time_breakdown),
    FigureDef("power_scaling", "Power and energy efficiency vs world size", S.power_scaling,
              W.power_scaling),
    FigureDef("parallelism_degrees", "Throughput per TP x PP degree", C.parallelism_degrees,
              W.parallelism_degrees),
    FigureDef("hardware_generations", "Hardware generations: MFU and exposed communication",
              C.hardware_generations, W.hardware_generations),
    FigureDef("model_size", "Model size: MFU and exposed communication", C.model_size,
              W.model_size),
    FigureDef("workload_utilization", "Utilization vs micro-batch and sequence length",
              C.workload_utilization, W.workload_utilization),
    FigureDef("prediction_parity", "Predicted vs measured", C.prediction_parity,
              W.prediction_parity),
    FigureDef("pareto_frontier", "Throughput vs power frontier", C.pareto_frontier,
              W.pareto_frontier),
    FigureDef("ensemble_comparison", "One large model or several smaller ones at once",
              E.ensemble_comparison, E.describe),
    FigureDef("plan_rounds", "Plan: predicted when chosen, refitted and measured, per layout",
              P.plan_rounds, P.describe),
    FigureDef("trial_overview", "Every trial", T.trial_overview, W.trial_overview),
    FigureDef("memory_per_device", "Peak memory per device", T.memory_per_device,
              W.memory_per_device),
    FigureDef("step_time_distribution", "Step-time distribution", T.step_time_distribution,
              W.step_time_distribution),
    FigureDef("loss_curves", "Training loss", T.loss_curves, W.loss_curves),
)
BY_NAME = {f.name: f for f in FIGURES}


def draw(df: pd.DataFrame, fdef: FigureDef) -> Panel:
    panel = Panel(fdef.name, fdef.title)
    try:
        panel.figure = fdef.draw(df)
    except FigureSkipped as skip:
        panel.note = str(skip)
        return panel
    try:
        panel.sentences = fdef.describe(df)
    except FigureSkipped as skip:  # the figure stands; only its summary lacks data
        panel.sentences = [f"No summary: {skip}."]
    return panel


def draw_all(df: pd.DataFrame, names: list[str] | None = None) -> list[Panel]:
    defs = [BY_NAME[n] for n in names] if names else FIGURES
    return [draw(df, f) for f in defs]


def save_pngs(panels: list[Panel], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for p in panels:
        if p.drawn:
            path = out / f"{p.name}.png"
            path.write_bytes(p.png())
            paths.append(path)
    return paths
