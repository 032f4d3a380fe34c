"""Figures against world size: throughput, scaling efficiency, step-time breakdown, power.

Each function takes the tidy study frame and returns a matplotlib Figure, or raises FigureSkipped
with the reason when the study lacks the columns or the spread of world sizes it needs.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from matplotlib.patches import Patch

from scalestudy import metrics as M
from scalestudy_analysis.base import (
    GID_DATA,
    GID_GUIDE,
    GID_IDEAL,
    SOURCE_HATCH,
    FigureSkipped,
    finite,
    iter_series,
    log2_x,
    need_values,
    power_device,
    power_frame,
    power_unit,
    readable_log,
)


MAX_BAR_SERIES = 6


def _legend(ax, n_max: int = 12) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles and len(handles) <= n_max:
        ax.legend(fontsize=7, loc="best")


def throughput_scaling(df: pd.DataFrame) -> Figure:
    """Global and per-device tokens/s vs world size, each series with its ideal linear scaling
    (anchored at the series' smallest world size) drawn dotted."""
    data = finite(df, M.TOKENS_PER_S, M.TOKENS_PER_S_PER_DEVICE)
    sizes = need_values(data, "world_size")
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_g, ax_d = fig.subplots(1, 2)
    for label, _source, style, rows in iter_series(data, "world_size"):
        ws = rows["world_size"].to_numpy(float)
        base_ws = ws[0]
        for ax, col in ((ax_g, M.TOKENS_PER_S), (ax_d, M.TOKENS_PER_S_PER_DEVICE)):
            y = rows[col].to_numpy(float)
            ax.plot(ws, y, label=label, gid=GID_DATA, **style)
            # Linear scaling: global grows with devices, per-device stays at its first value.
            ideal = y[0] * ws / base_ws if col == M.TOKENS_PER_S else np.full_like(ws, y[0])
            ax.plot(ws, ideal, color=style["color"], linestyle=":", linewidth=1, gid=GID_IDEAL,
                    label="_nolegend_")
    readable_log(ax_g, "y", [v for ln in ax_g.lines for v in ln.get_ydata()])
    ax_g.set(title="Global throughput (dotted: ideal linear)", xlabel="world size (devices)",
             ylabel="tokens/s")
    ax_d.set(title="Per-device throughput (dotted: ideal)", xlabel="world size (devices)",
             ylabel="tokens/s per device")
    ax_d.set_ylim(bottom=0)
    for ax in (ax_g, ax_d):
        log2_x(ax, sizes)
        ax.grid(alpha=0.3)
    _legend(ax_d)
    return fig


def efficiency_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Scaling efficiency per series: per-device throughput relative to the series' smallest
    world size (1.0 = linear scaling). Columns: label, source, world_size, efficiency."""
    data = finite(df, M.TOKENS_PER_S_PER_DEVICE)
    need_values(data, "world_size")
    out = []
    for label, source, _style, rows in iter_series(data, "world_size"):
        rows = rows.groupby("world_size", as_index=False)[M.TOKENS_PER_S_PER_DEVICE].median()
        base = rows[M.TOKENS_PER_S_PER_DEVICE].iloc[0]
        for ws, tps in zip(rows["world_size"], rows[M.TOKENS_PER_S_PER_DEVICE]):
            out.append(dict(label=label, source=source, world_size=int(ws), efficiency=tps / base))
    return pd.DataFrame(out)


def scaling_efficiency(df: pd.DataFrame) -> Figure:
    data = finite(df, M.TOKENS_PER_S_PER_DEVICE)
    sizes = need_values(data, "world_size")
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for label, _source, style, rows in iter_series(data, "world_size"):
        rows = rows.groupby("world_size", as_index=False)[M.TOKENS_PER_S_PER_DEVICE].median()
        eff = rows[M.TOKENS_PER_S_PER_DEVICE] / rows[M.TOKENS_PER_S_PER_DEVICE].iloc[0]
        ax.plot(rows["world_size"], 100 * eff, label=label, gid=GID_DATA, **style)
    ax.axhline(100, color="grey", linestyle=":", linewidth=1, gid=GID_GUIDE)
    ax.set(title="Scaling efficiency (100% = linear from the smallest world size)",
           xlabel="world size (devices)", ylabel="efficiency (%)")
    ax.set_ylim(bottom=0)
    log2_x(ax, sizes)
    ax.grid(alpha=0.3)
    _legend(ax)
    return fig


def breakdown_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Per completed trial: compute, exposed communication and pipeline bubble seconds per step.

    Compute and bubble come from the model's own fields when it reports them; otherwise compute is
    what remains of the step once exposed communication (and any bubble) is taken out.
    """
    data = finite(df, M.STEP_TIME_S, M.COMM_EXPOSED_S).copy()
    bubble = data[M.BUBBLE_TIME_S].fillna(0.0) if M.BUBBLE_TIME_S in data else 0.0
    data["bubble_s"] = bubble
    data["exposed_s"] = data[M.COMM_EXPOSED_S]
    rest = (data[M.STEP_TIME_S] - data["exposed_s"] - data["bubble_s"]).clip(lower=0.0)
    if M.COMPUTE_TIME_S in data:
        data["compute_s"] = data[M.COMPUTE_TIME_S].fillna(rest)
    else:
        data["compute_s"] = rest
    frac = data[M.COMM_EXPOSED_FRACTION] if M.COMM_EXPOSED_FRACTION in data else np.nan
    data["exposed_fraction"] = pd.Series(frac, index=data.index).fillna(
        data["exposed_s"] / data[M.STEP_TIME_S])
    return data


def step_time_breakdown(df: pd.DataFrame) -> Figure:
    """Stacked bars (compute / exposed comm / bubble) per world size and series; next to them the
    exposed-communication fraction vs world size."""
    data = breakdown_frame(df)
    sizes = sorted(data["world_size"].unique())
    has_bubble = M.BUBBLE_TIME_S in data and bool((data["bubble_s"] > 0).any())
    series = list(iter_series(data, "world_size"))
    # Bars of more than a few series per world size are unreadable: keep those with the most
    # world sizes (the fraction panel still shows every series).
    bars = sorted(series, key=lambda s: -s[3]["world_size"].nunique())[:MAX_BAR_SERIES]
    fig = Figure(figsize=(12, 4.4), layout="constrained")
    ax_b, ax_f = fig.subplots(1, 2, width_ratios=(1.4, 1))
    width = 0.8 / len(bars)
    # Pale fills, so the series' edge colours (the palette's strong ones) stand out against them.
    parts = [("compute_s", "compute", "#c6d4e8"), ("exposed_s", "exposed comm", "#f4a6a6")]
    if has_bubble:
        parts.append(("bubble_s", "pipeline bubble", "#e3e3e3"))
    series_handles = []
    for i, (label, source, style, rows) in enumerate(bars):
        rows = rows.groupby("world_size", as_index=False)[[p for p, _, _ in parts]].median()
        # Shares, not seconds: under strong scaling the step shrinks 100x across the sweep and
        # absolute bars would hide exactly the growing communication share at the large end.
        total = rows[[p for p, _, _ in parts]].sum(axis=1).to_numpy(float)
        pos = np.array([sizes.index(w) for w in rows["world_size"]]) - 0.4 + width * (i + 0.5)
        bottom = np.zeros(len(rows))
        hatch = SOURCE_HATCH.get(source)
        for col, name, colour in parts:
            share = 100 * rows[col].to_numpy(float) / total
            ax_b.bar(pos, share, width * 0.9, bottom=bottom, color=colour, hatch=hatch,
                     edgecolor=style["color"], linewidth=2, label=name if i == 0 else "_nolegend_")
            bottom += share
        # The edge colour (and hatch, for predictions) tells the series apart: a legend says which.
        series_handles.append(Patch(facecolor="white", edgecolor=style["color"], linewidth=2,
                                    hatch=hatch, label=label or source))
    for label, _source, style, rows in series:
        rows = rows.groupby("world_size", as_index=False)["exposed_fraction"].median()
        ax_f.plot(rows["world_size"], 100 * rows["exposed_fraction"], label=label, gid=GID_DATA,
                  **style)
    ax_b.set_xticks(range(len(sizes)))
    ax_b.set_xticklabels([str(s) for s in sizes])
    shown = "one bar per series" if len(bars) == len(series) else \
        f"{len(bars)} of {len(series)} series"
    ax_b.set(title=f"Step time breakdown ({shown}, median)",
             xlabel="world size (devices)", ylabel="% of step time")
    ax_b.set_ylim(0, 100)
    fill = [Patch(facecolor=colour, label=name) for _, name, colour in parts]
    edge = series_handles if len(series_handles) > 1 or any(h.get_hatch() for h in series_handles) \
        else []
    ax_b.legend(handles=fill + edge, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                title="fill: part; edge: series" if edge else None, title_fontsize=7)
    ax_f.set(title="Exposed communication fraction", xlabel="world size (devices)",
             ylabel="% of step time")
    ax_f.set_ylim(bottom=0)
    if len(sizes) > 1:
        log2_x(ax_f, sizes)
    ax_f.grid(alpha=0.3)
    _legend(ax_f)
    return fig


def power_scaling(df: pd.DataFrame) -> Figure:
    """Total power and tokens per joule vs world size: power grows with the devices even where
    throughput stops doing so. Measured (NVML boards or RAPL packages) and modelled (GPU boards,
    not validated) energy are separate series; CPU hardware has only measured power."""
    df, kinds = power_frame(df)
    data = finite(df, M.TOKENS_PER_S)
    sizes = need_values(data, "world_size")
    div, unit = power_unit(data[[p for p, _, _ in kinds]].to_numpy().ravel())
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_p, ax_e = fig.subplots(1, 2)
    devices = set()
    for power, tpj, suffix in kinds:
        part = data.dropna(subset=[power])
        if part.empty:
            continue
        devices.add(power_device(part, power))
        for label, _source, style, rows in iter_series(part, "world_size"):
            ax_p.plot(rows["world_size"], rows[power] / div, label=label + suffix, gid=GID_DATA,
                      **style)
            ax_e.plot(rows["world_size"], rows[tpj], label=label + suffix, gid=GID_DATA, **style)
    if not ax_p.lines:
        raise FigureSkipped("no completed trial has both throughput and power")
    device = devices.pop() if len(devices) == 1 else "device"
    readable_log(ax_p, "y", [v for ln in ax_p.lines for v in ln.get_ydata()])
    ax_p.set(title=f"Total {device} power", xlabel="world size (devices)", ylabel=unit)
    ax_e.set(title="Energy efficiency", xlabel="world size (devices)", ylabel="tokens per joule")
    ax_e.set_ylim(bottom=0)
    for ax in (ax_p, ax_e):
        log2_x(ax, sizes)
        ax.grid(alpha=0.3)
    _legend(ax_e)
    return fig
