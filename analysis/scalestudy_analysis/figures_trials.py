"""Per-trial figures: every trial at a glance, memory per device, step-time spread, loss curves.

These make sense for any study, the small measured ones included (the quick-start sweeps world size
and ZeRO stage only). Same contract as figures_scaling.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from scalestudy import metrics as M
from scalestudy_analysis.base import (
    GID_DATA,
    PALETTE,
    SOURCE_HATCH,
    FigureSkipped,
    finite,
    iter_series,
    trial_label,
    varies,
)
from scalestudy_analysis.load import MEASURED

STATUS_COLOURS = {"completed": "#4c72b0", "failed": "#c44e52", "infeasible": "#999999",
                  "timeout": "#dd8452"}
MAX_OVERVIEW_TRIALS = 60  # beyond this the bars are unreadable; the table lists them all


def overview_frame(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty:
        raise FigureSkipped("the study has no trials")
    with_model = varies(df, "model") or varies(df, "hardware")
    out = df.copy()
    out["label"] = [trial_label(r, with_model) + ("" if s == MEASURED else f" ({s})")
                    for r, s in zip(out.to_dict("records"), out["source"])]
    ok = out["status"] == M.Status.completed.value
    out["value"] = out[M.TOKENS_PER_S_PER_DEVICE].where(ok)
    # Completed trials fastest first, then the rest: the ones a reader acts on come first.
    out = out.sort_values(["value"], ascending=False, na_position="last")
    return out.head(MAX_OVERVIEW_TRIALS)


def trial_overview(df: pd.DataFrame) -> Figure:
    """Per-device tokens/s of every trial (fastest first), coloured by status; trials without a
    throughput are listed with their status instead of a bar."""
    data = overview_frame(df)
    fig = Figure(figsize=(8, 1.2 + 0.28 * len(data)), layout="constrained")
    ax = fig.subplots()
    y = np.arange(len(data))[::-1]
    both = data["source"].nunique() > 1
    # Colour says the status; a hatch (named in the legend) says predicted, so a prediction never
    # passes for a measurement of the same colour.
    for status, colour in STATUS_COLOURS.items():
        for source in sorted(set(data["source"]), key=lambda s: s != MEASURED):
            mask = ((data["status"] == status) & (data["source"] == source)).to_numpy()
            if mask.any():
                ax.barh(y[mask], np.nan_to_num(data["value"].to_numpy(float)[mask]),
                        color=colour, hatch=SOURCE_HATCH.get(source), edgecolor="white",
                        label=f"{status}, {source}" if both else status)
    for yi, (v, status) in zip(y, zip(data["value"], data["status"])):
        if not np.isfinite(v):
            ax.text(0, yi, f" {status}", va="center", fontsize=7, color="#444444")
    ax.set_yticks(y)
    ax.set_yticklabels(data["label"], fontsize=7)
    ax.set(title="Every trial: per-device throughput", xlabel="tokens/s per device")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return fig


def memory_axis(data: pd.DataFrame) -> str:
    for x in ("zero_stage", "world_size", "tp"):
        if data[x].nunique() > 1:
            return x
    raise FigureSkipped("needs at least 2 values of zero_stage, world_size or tp")


# What each memory_source counts: a measured process's resident set is not the model's tensors.
MEMORY_SOURCES = {"process_peak_rss": "peak process RSS (the whole process)",
                  "cuda_allocator": "peak CUDA allocator bytes",
                  "model": "the model's tensor estimate (params, grads, optimizer, activations)"}


def memory_sources(data: pd.DataFrame) -> list[str]:
    """'measured: peak process RSS (...); predicted: the model's tensor estimate (...)'."""
    parts = []
    for source, rows in sorted(data.groupby("source"), key=lambda g: g[0] != MEASURED):
        kinds = sorted({str(k) for k in rows.get("memory_source", pd.Series(dtype=object))
                        if isinstance(k, str) and k})
        what = ", ".join(MEMORY_SOURCES.get(k, k) for k in kinds) or "source not recorded"
        parts.append(f"{source}: {what}")
    return parts


def memory_per_device(df: pd.DataFrame) -> Figure:
    """Peak memory per device against the axis that shards it (ZeRO stage, else world size, else
    TP); the title says what each source counts (a process's RSS, a model's tensors)."""
    data = finite(df, M.PEAK_MEMORY_GIB)
    x = memory_axis(data)
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for label, _source, style, rows in iter_series(data, x):
        rows = rows.groupby(x, as_index=False)[M.PEAK_MEMORY_GIB].median()
        ax.plot(rows[x], rows[M.PEAK_MEMORY_GIB], label=label, gid=GID_DATA, **style)
    if x == "world_size":
        ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(data[x].unique()))
    ax.set_xticklabels([str(v) for v in sorted(data[x].unique())])
    ax.minorticks_off()
    ax.set(xlabel=x, ylabel="GiB per device")
    ax.set_title("\n".join([f"Peak memory per device vs {x}", *memory_sources(data)]), fontsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if len(ax.lines) <= 12:
        ax.legend(fontsize=7)
    return fig


def _measured_lists(df: pd.DataFrame, column: str, what: str) -> pd.DataFrame:
    done = df[(df["status"] == M.Status.completed.value) & (df["source"] == MEASURED)]
    done = done[[len(v) > 0 for v in done[column]]] if column in done else done.iloc[0:0]
    if done.empty:
        raise FigureSkipped(f"no measured trial recorded {what} ({column}); MLflow keeps them "
                            "as artifacts, the ledger as a column")
    with_model = varies(done, "model") or varies(done, "hardware")
    done = done.copy()
    done["label"] = [trial_label(r, with_model) for r in done.to_dict("records")]
    return done.sort_values(["world_size", "tp", "pp", "zero_stage", "micro_batch"])


def step_time_distribution(df: pd.DataFrame) -> Figure:
    """Box plot of the timed steps of every measured trial: the spread behind each median."""
    data = _measured_lists(df, "step_times_s", "per-step times")
    fig = Figure(figsize=(max(6.0, 0.6 * len(data) + 2), 4.2), layout="constrained")
    ax = fig.subplots()
    ax.boxplot([np.asarray(v, float) * 1e3 for v in data["step_times_s"]],
               tick_labels=list(data["label"]), showfliers=True)
    ax.set(title="Step time of every timed step (box: quartiles)", ylabel="ms per step")
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    return fig


def loss_curves(df: pd.DataFrame) -> Figure:
    """Training loss per step of every measured trial (warm-up and timed steps): the trials train,
    and configurations that should agree (ZeRO stages, same seed) do."""
    data = _measured_lists(df, "losses", "losses")
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for i, (label, losses) in enumerate(zip(data["label"], data["losses"])):
        ax.plot(np.arange(1, len(losses) + 1), losses, label=label, gid=GID_DATA,
                color=PALETTE[i % len(PALETTE)], linewidth=1.2, alpha=0.85)
    ax.set(title="Training loss per step", xlabel="step", ylabel="loss")
    ax.grid(alpha=0.3)
    if len(ax.lines) <= 12:
        ax.legend(fontsize=7)
    return fig

