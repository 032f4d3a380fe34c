"""Figures that compare configurations: parallel degrees, hardware, workload, prediction vs
measurement, and the throughput-power frontier. Same contract as figures_scaling."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from scalestudy import metrics as M
from scalestudy_analysis.base import (
    GID_DATA,
    GID_GUIDE,
    PALETTE,
    SOURCE_COLOUR,
    SOURCE_HATCH,
    FigureSkipped,
    finite,
    generation_order,
    iter_series,
    log2_x,
    need_values,
    power_device,
    power_frame,
    power_unit,
    readable_log,
    trial_label,
)
from scalestudy_analysis.labels import place_labels
from scalestudy_analysis.load import (MEASURED, PREDICTED, PROFILES_ATTR, completed,
                                      pair_predictions)
from scalestudy_analysis.peaks import mfu_label, peaks_title


def degree_frame(df: pd.DataFrame, world_size: int | None = None) -> tuple[int, pd.DataFrame]:
    """Best per-device throughput per (model, source, TP, PP) at one world size; by default the
    world size with the most TP x PP combinations (the largest on a tie). Infeasible combinations
    stay in as NaN so the figure can mark them."""
    for col in ("tp", "pp", "world_size"):
        if col not in df:
            raise FigureSkipped(f"the study has no {col} column")
    combos = df.groupby("world_size")[["tp", "pp"]].apply(lambda g: len(g.drop_duplicates()))
    if world_size is None:
        world_size = int(combos[combos == combos.max()].index.max())
    if combos.get(world_size, 0) < 2:
        raise FigureSkipped(f"needs at least 2 TP x PP combinations at one world size; "
                            f"the study has at most {int(combos.max())}")
    at = df[df["world_size"] == world_size].copy()
    at["value"] = at[M.TOKENS_PER_S_PER_DEVICE].where(at["status"] == M.Status.completed.value)
    # The best over the remaining axes (ZeRO stage, micro-batch) is what a user would pick.
    best = at.groupby(["model", "source", "tp", "pp"], as_index=False)["value"].max()
    return world_size, best


def parallelism_degrees(df: pd.DataFrame, world_size: int | None = None) -> Figure:
    """Per-device throughput per TP x PP degree at a fixed world size, one panel per model."""
    ws, best = degree_frame(df, world_size)
    if best["value"].notna().sum() == 0:
        raise FigureSkipped(f"no completed trial at world size {ws}")
    done = completed(df[df["world_size"] == ws])
    models = model_order(done) if not done.empty else []
    models += sorted(set(best["model"]) - set(models))  # models with no completed trial last
    n_deg = len(best[["tp", "pp"]].drop_duplicates())
    # Few degrees: panels side by side; many (a 5x5 TP x PP grid): one row per model, wide enough
    # for every label.
    if n_deg <= 8:
        fig = Figure(figsize=(max(6.0, 4.5 * len(models)), 4.4), layout="constrained")
        axes = fig.subplots(1, len(models), squeeze=False)[0]
    else:
        fig = Figure(figsize=(max(8.0, 0.42 * n_deg + 2), 3.4 * len(models)), layout="constrained")
        axes = fig.subplots(len(models), 1, squeeze=False)[:, 0]
    sources = [s for s in (MEASURED, PREDICTED) if s in set(best["source"])]
    for ax, model in zip(axes, models):
        part = best[best["model"] == model]
        degrees = sorted({(int(t), int(p)) for t, p in zip(part["tp"], part["pp"])})
        width = 0.8 / len(sources)
        for i, source in enumerate(sources):
            rows = part[part["source"] == source].set_index(["tp", "pp"])
            heights = [rows["value"].get(d, np.nan) for d in degrees]
            pos = np.arange(len(degrees)) - 0.4 + width * (i + 0.5)
            ax.bar(pos, np.nan_to_num(heights), width * 0.9, label=source,
                   color=SOURCE_COLOUR.get(source, PALETTE[i]), hatch=SOURCE_HATCH.get(source))
            for x, h in zip(pos, heights):
                if not np.isfinite(h):  # a gap would read as "zero throughput"
                    ax.text(x, 0, "infeasible", rotation=90, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(degrees)))
        ax.set_xticklabels([f"TP{t}xPP{p}" for t, p in degrees], rotation=45, ha="right",
                           fontsize=8)
        ax.set(title=f"{model} at {ws} devices", ylabel="tokens/s per device (best)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    return fig


def category_frame(df: pd.DataFrame, axis: str) -> tuple[int | None, pd.DataFrame]:
    """Completed trials of every value of `axis` (hardware, model) at the largest world size they
    all ran, so the categories are compared on the same scale."""
    data = finite(df, M.MFU)
    values = need_values(data, axis)
    sizes = set.intersection(*(set(data[data[axis] == v]["world_size"]) for v in values))
    ws = max(sizes) if sizes else None
    return ws, (data[data["world_size"] == ws] if ws is not None else data)


def hardware_frame(df: pd.DataFrame) -> tuple[int | None, pd.DataFrame]:
    return category_frame(df, "hardware")


def model_order(data: pd.DataFrame) -> list[str]:
    """Models smallest first, by model FLOPs per token (= TFLOP/s per device / tokens/s per
    device), which custom shapes outside the catalogue have too."""
    flops = (data[M.MODEL_TFLOPS_PER_DEVICE] * 1e12 / data[M.TOKENS_PER_S_PER_DEVICE])
    per_model = flops.groupby(data["model"]).median()
    return sorted(per_model.index, key=lambda m: (np.nan_to_num(per_model[m], nan=np.inf), m))


def _category_bars(data: pd.DataFrame, axis: str, order: list[str], ws: int | None,
                   what: str, df: pd.DataFrame) -> Figure:
    """MFU and exposed-communication bars per category, one bar container per series."""
    series = list(iter_series(data, axis, exclude=("world_size",)))
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_m, ax_c = fig.subplots(1, 2)
    width = 0.8 / len(series)
    for i, (label, _source, style, rows) in enumerate(series):
        rows = rows.groupby(axis).median(numeric_only=True)
        pos = np.arange(len(order)) - 0.4 + width * (i + 0.5)
        mfu = [100 * rows[M.MFU].get(h, np.nan) for h in order]
        exp = [100 * rows[M.COMM_EXPOSED_FRACTION].get(h, np.nan) for h in order]
        hatch = "//" if style["linestyle"] == "--" else None
        ax_m.bar(pos, mfu, width * 0.9, color=style["color"], hatch=hatch, label=label)
        ax_c.bar(pos, exp, width * 0.9, color=style["color"], hatch=hatch, label=label)
    where = f" per {what}" + (f" ({ws} devices)" if ws is not None else "")
    ax_m.set_title(f"MFU{where}", fontsize=10)
    ax_c.set_title(f"Exposed communication{where}", fontsize=10)
    ax_m.set_ylabel(mfu_label(df, data))
    if peaks := peaks_title(df, data):
        fig.suptitle(peaks, fontsize=9)
    ax_c.set_ylabel("% of step time")
    for ax in (ax_m, ax_c):
        ax.set_xticks(range(len(order)))
        ax.set_xticklabels(order, rotation=20 if len(order) > 4 else 0, ha="right"
                           if len(order) > 4 else "center", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    if len(series) <= 12:
        ax_m.legend(fontsize=7)
    return fig


def hardware_generations(df: pd.DataFrame) -> Figure:
    """MFU and exposed-communication fraction per hardware generation (bars, oldest first)."""
    ws, data = hardware_frame(df)
    return _category_bars(data, "hardware", generation_order(data["hardware"]), ws,
                          "hardware generation", df)


def model_size(df: pd.DataFrame) -> Figure:
    """MFU and exposed-communication fraction per model, smallest first: how the communication
    share changes with model size at a fixed world size."""
    ws, data = category_frame(df, "model")
    return _category_bars(data, "model", model_order(data), ws, "model", df)


WORKLOAD_AXES = (("micro_batch", "micro-batch (sequences per device)"),
                 ("seq_len", "sequence length (tokens)"))


def workload_utilization(df: pd.DataFrame) -> Figure:
    """MFU vs micro-batch and vs sequence length: one panel per workload axis the study sweeps."""
    data = finite(df, M.MFU)
    axes_swept = [(c, t) for c, t in WORKLOAD_AXES if data[c].nunique() > 1]
    if not axes_swept:
        raise FigureSkipped("the study sweeps neither micro_batch nor seq_len")
    fig = Figure(figsize=(5.5 * len(axes_swept), 4.2), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(axes_swept), squeeze=False)[0])
    if peaks := peaks_title(df, data):
        fig.suptitle(peaks, fontsize=9)
    for ax, (col, title) in zip(axes, axes_swept):
        for label, _source, style, rows in iter_series(data, col):
            rows = rows.groupby(col, as_index=False)[M.MFU].median()
            ax.plot(rows[col], 100 * rows[M.MFU], label=label, gid=GID_DATA, **style)
        log2_x(ax, data[col])
        ax.set(title=f"Utilization vs {col}", xlabel=title, ylabel=mfu_label(df, data))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if len(ax.lines) <= 12:
            ax.legend(fontsize=7)
    return fig


def prediction_parity(df: pd.DataFrame, metric: str = M.TOKENS_PER_S_PER_DEVICE) -> Figure:
    """Predicted vs measured for every configuration that has both, on log axes around y = x,
    each point labelled with its error; next to it the signed error per world size."""
    pairs = pair_predictions(df, metric)
    if pairs.empty:
        raise FigureSkipped("no configuration has both a measured and a predicted result "
                            f"for {metric}")
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    ax_p, ax_e = fig.subplots(1, 2)
    for i, (hw, rows) in enumerate(pairs.groupby("hardware")):
        colour = PALETTE[i % len(PALETTE)]
        ax_p.scatter(rows["measured"], rows["predicted"], color=colour, label=hw, zorder=3)
        ax_e.scatter(rows["world_size"], 100 * rows["rel_error"], color=colour, label=hw,
                     zorder=3)
    lo = float(min(pairs["measured"].min(), pairs["predicted"].min())) / 1.5
    hi = float(max(pairs["measured"].max(), pairs["predicted"].max())) * 1.5
    ax_p.plot([lo, hi], [lo, hi], color="black", linewidth=1, gid=GID_GUIDE, label="y = x")
    for f in (0.8, 1.2):  # a +-20% band: where a planning model is still useful
        ax_p.plot([lo, hi], [lo * f, hi * f], color="grey", linestyle=":", linewidth=1,
                  gid=GID_GUIDE, label="_nolegend_")
    ax_p.set(title=f"Predicted vs measured {metric} (dotted: +-20%)", xlabel="measured",
             ylabel="predicted")
    for axis in ("x", "y"):
        readable_log(ax_p, axis, (lo, hi))
    ax_p.set(xlim=(lo, hi), ylim=(lo, hi))
    # Where the predictions came from, in the figure's own title: a plot of catalogue figures
    # against this machine's measurements must not pass for a test of the calibrated model.
    sources = df.attrs.get(PROFILES_ATTR) or {}
    if sources:
        fig.suptitle("predicted with " + "; ".join(sources[h] for h in sorted(sources)),
                     fontsize=10, color="firebrick" if any(
                         "UNCALIBRATED" in v for v in sources.values()) else "black")
    ax_e.axhline(0, color="black", linewidth=1, gid=GID_GUIDE)
    ax_e.set(title="Prediction error per point", xlabel="world size (devices)",
             ylabel="predicted / measured - 1 (%)")
    if pairs["world_size"].nunique() > 1:
        log2_x(ax_e, pairs["world_size"])
    for ax in (ax_p, ax_e):
        ax.grid(alpha=0.3)
    # A fixed corner: the point labels below are placed around it, so it must not move after.
    ax_p.legend(fontsize=7, loc="upper left")
    ax_e.legend(fontsize=7)
    # Each point's error beside it where there is room; the error panel shows every one anyway.
    left_out = place_labels(ax_p, pairs["measured"], pairs["predicted"],
                            [f"{100 * e:+.0f}%" for e in pairs["rel_error"]])
    if left_out:
        ax_p.set_title(f"{ax_p.get_title()}\n{left_out} crowded labels left out: every error "
                       "is in the right panel", fontsize=9)
    return fig


def pareto_points(df: pd.DataFrame) -> pd.DataFrame:
    """Completed trials with power and throughput, flagged `on_frontier` when no other trial has
    at least the throughput at no more power (measured power preferred, else modelled)."""
    df, kinds = power_frame(df)
    data = completed(df).copy()
    data["power"] = np.nan
    data["power_kind"] = None
    for power, _tpj, suffix in reversed(kinds):  # measured last, so it wins where both exist
        has = data[power].notna()
        data.loc[has, "power"] = data.loc[has, power]
        data.loc[has, "power_kind"] = "modelled" if suffix else "measured"
    data = data.dropna(subset=["power", M.TOKENS_PER_S])
    if data.empty:
        raise FigureSkipped("no completed trial has both throughput and power")
    data = data.sort_values(["power", M.TOKENS_PER_S], ascending=[True, False])
    best = -np.inf
    flags = []
    for tps in data[M.TOKENS_PER_S]:
        flags.append(tps > best)
        best = max(best, tps)
    data["on_frontier"] = flags
    return data


def pareto_frontier(df: pd.DataFrame) -> Figure:
    """Global tokens/s vs total power of every completed trial that has power, with the frontier
    of non-dominated ones; the title counts what is plotted per source."""
    data = pareto_points(df)
    div, unit = power_unit(data["power"])
    fig = Figure(figsize=(7, 4.6), layout="constrained")
    ax = fig.subplots()
    for source, rows in data.groupby("source"):
        ax.scatter(rows["power"] / div, rows[M.TOKENS_PER_S], alpha=0.7,
                   color=SOURCE_COLOUR.get(source, PALETTE[2]),
                   marker="o" if source == MEASURED else "x", label=source)
    front = data[data["on_frontier"]]
    ax.plot(front["power"] / div, front[M.TOKENS_PER_S], color="black", drawstyle="steps-post",
            gid=GID_DATA, label="frontier")
    top = front.iloc[-1]
    ax.annotate(trial_label(top), (top["power"] / div, top[M.TOKENS_PER_S]), fontsize=7,
                textcoords="offset points", xytext=(-10, 6), ha="right")
    done = completed(df)
    counts = ", ".join(f"{int((data['source'] == s).sum())} of {int((done['source'] == s).sum())}"
                       f" {s}" for s in sorted(set(done["source"])))
    words = {power_device(rows, "total_power_w" if kind == "measured" else
                          M.TOTAL_POWER_W_ESTIMATED) for kind, rows in data.groupby("power_kind")}
    device = words.pop() if len(words) == 1 else "device"
    readable_log(ax, "x", data["power"] / div)
    readable_log(ax, "y", data[M.TOKENS_PER_S])
    ax.set(title=f"Throughput vs power (trials with power: {counts})",
           xlabel=f"total {device} power ({unit})", ylabel="tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig
