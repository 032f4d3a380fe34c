"""Two sentences per figure saying what the data shows, computed from the same frame the figure
draws. They speak about measured trials when the study has any (predicted ones otherwise) and
about the series with the most points, named as in the legend."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from scalestudy import metrics as M
from scalestudy_analysis.base import (
    FigureSkipped,
    finite,
    generation_order,
    iter_series,
    power_device,
    power_frame,
    trial_label,
    varies,
)
from scalestudy_analysis.figures_compare import (
    WORKLOAD_AXES,
    category_frame,
    degree_frame,
    hardware_frame,
    model_order,
    pareto_points,
)
from scalestudy_analysis.figures_scaling import breakdown_frame, efficiency_frame
from scalestudy_analysis.figures_trials import _measured_lists, memory_axis, overview_frame
from scalestudy_analysis.load import MEASURED, pair_predictions


def fmt_num(x: float) -> str:
    """3 significant digits with a k/M/G suffix: 13173.8 -> 13.2k, 0.0389 -> 0.0389."""
    if not math.isfinite(x):
        return "n/a"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def fmt_power(watts: float) -> str:
    return f"{watts / 1e6:.3g} MW" if watts >= 1e6 else (
        f"{watts / 1e3:.3g} kW" if watts >= 1e3 else f"{watts:.3g} W")


def change(a: float, b: float, up: str = "above", down: str = "below") -> str:
    """'41% below' for b = 0.59 a."""
    rel = b / a - 1.0
    return f"{abs(rel):.0%} {up if rel >= 0 else down}"


def pct(fraction: float) -> str:
    """Whole percent, but one decimal below 10% so small shares do not all read "1%" or "0%"."""
    return f"{fraction:.1%}" if abs(fraction) < 0.095 else f"{fraction:.0%}"


def devices(n: int) -> str:
    return f"{n} device" if n == 1 else f"{n} devices"


def _label(label: str) -> str:
    return f" ({label})" if label else ""


def _pick(df: pd.DataFrame, x: str, exclude=()) -> tuple[str, pd.DataFrame]:
    """The series the sentences speak about: the one with the most distinct x values, measured
    preferred on a tie; returned as (legend label, its rows sorted by x)."""
    series = [(lab, src, rows) for lab, src, _st, rows in iter_series(df, x, exclude)]
    label, _src, rows = max(series, key=lambda s: (s[2][x].nunique(), s[1] == MEASURED))
    return label, rows


def _ends(rows: pd.DataFrame, x: str, col: str) -> tuple[float, float, float, float]:
    """(first x, last x, median of col at the first x, at the last x)."""
    med = rows.groupby(x)[col].median()
    return med.index[0], med.index[-1], float(med.iloc[0]), float(med.iloc[-1])


def _source_with_most(df: pd.DataFrame, column: str) -> str:
    counts = df.groupby("source")[column].nunique()
    return max(counts.index, key=lambda s: (counts[s], s == MEASURED))


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def throughput_scaling(df: pd.DataFrame) -> list[str]:
    data = finite(df, M.TOKENS_PER_S, M.TOKENS_PER_S_PER_DEVICE)
    label, rows = _pick(data, "world_size")
    w0, w1, g0, g1 = _ends(rows, "world_size", M.TOKENS_PER_S)
    *_, d0, d1 = _ends(rows, "world_size", M.TOKENS_PER_S_PER_DEVICE)
    w0, w1 = int(w0), int(w1)
    return [
        f"Global throughput goes from {fmt_num(g0)} to {fmt_num(g1)} tokens/s between {w0} and "
        f"{devices(w1)}, {g1 / g0:.3g}x for {w1 / w0:.3g}x the devices{_label(label)}.",
        f"Per-device throughput at {devices(w1)} is {change(d0, d1)} {devices(w0)} "
        f"({fmt_num(d1)} vs {fmt_num(d0)} tokens/s per device).",
    ]


def scaling_efficiency(df: pd.DataFrame) -> list[str]:
    eff = efficiency_frame(df)
    source = MEASURED if (eff["source"] == MEASURED).any() else eff["source"].iloc[0]
    eff = eff[eff["source"] == source]
    counts = eff.groupby("label")["world_size"].nunique()
    label = counts.idxmax()
    rows = eff[eff["label"] == label].sort_values("world_size")
    w1, e1 = int(rows["world_size"].iloc[-1]), rows["efficiency"].iloc[-1]
    first = [f"Scaling efficiency at {devices(w1)} is {e1:.0%} of linear{_label(label)}."]
    last = eff.sort_values("world_size").groupby("label").tail(1)
    if len(last) > 1:
        lo, hi = last.loc[last["efficiency"].idxmin()], last.loc[last["efficiency"].idxmax()]
        return first + [f"Across the {len(last)} series, efficiency at their largest world size "
                        f"ranges from {lo['efficiency']:.0%} ({lo['label']}) to "
                        f"{hi['efficiency']:.0%} ({hi['label']})."]
    above = rows[rows["efficiency"] >= 0.9]["world_size"]
    below = rows[rows["efficiency"] < 0.9]["world_size"]
    if below.empty:
        return first + [f"It stays at or above 90% at every world size up to {devices(w1)}."]
    if len(above) > 1:
        return first + [f"It stays at or above 90% up to {devices(int(above.max()))}."]
    return first + [f"It falls below 90% already at {devices(int(below.min()))}."]


def step_time_breakdown(df: pd.DataFrame) -> list[str]:
    data = breakdown_frame(df)
    label, rows = _pick(data, "world_size")
    w0, w1, f0, f1 = _ends(rows, "world_size", "exposed_fraction")
    w0, w1 = int(w0), int(w1)
    at = rows[rows["world_size"] == w1]
    compute = (at["compute_s"] / at[M.STEP_TIME_S]).median()
    bubble = (at["bubble_s"] / at[M.STEP_TIME_S]).median()
    first = (f"At {devices(w1)} exposed communication takes {pct(f1)} of the step time, "
             f"against {pct(f0)} at {devices(w0)}{_label(label)}." if w1 != w0 else
             f"At {devices(w1)} exposed communication takes {pct(f1)} of the step time"
             f"{_label(label)}.")
    second = f"Compute accounts for {pct(compute)} of the step at {devices(w1)}"
    second += f" and the pipeline bubble for {pct(bubble)}." if bubble > 0 else "."
    return [first, second]


def power_scaling(df: pd.DataFrame) -> list[str]:
    df, kinds = power_frame(df)
    power, tpj, suffix = kinds[0]  # measured energy when the study has it
    data = finite(df, M.TOKENS_PER_S, power)
    label, rows = _pick(data, "world_size")
    w0, w1, p0, p1 = _ends(rows, "world_size", power)
    *_, t0, t1 = _ends(rows, "world_size", M.TOKENS_PER_S)
    *_, e0, e1 = _ends(rows, "world_size", tpj)
    w0, w1 = int(w0), int(w1)
    kind = " (modelled, not validated)" if suffix else ""
    return [
        f"From {w0} to {devices(w1)} total {power_device(data, power)} power{kind} grows "
        f"{p1 / p0:.3g}x ({fmt_power(p0)} to "
        f"{fmt_power(p1)}) while global throughput grows {t1 / t0:.3g}x{_label(label)}.",
        f"Tokens per joule {'rise' if e1 >= e0 else 'fall'} by {abs(e1 / e0 - 1):.0%} "
        f"({fmt_num(e0)} to {fmt_num(e1)} tokens/J).",
    ]


def parallelism_degrees(df: pd.DataFrame) -> list[str]:
    ws, best = degree_frame(df)
    source = _source_with_most(best.dropna(subset=["value"]).assign(
        combo=lambda b: b["tp"].astype(str) + "x" + b["pp"].astype(str)), "combo")
    best = best[best["source"] == source]
    parts = []
    for model, rows in list(best.groupby("model"))[:3]:
        ok = rows.dropna(subset=["value"])
        if ok.empty:
            parts.append(f"no TP x PP degree of {model} completes")
            continue
        hi, lo = ok.loc[ok["value"].idxmax()], ok.loc[ok["value"].idxmin()]
        parts.append(f"the fastest degree for {model} is TP{hi['tp']}xPP{hi['pp']} at "
                     f"{fmt_num(hi['value'])} tokens/s per device, {hi['value'] / lo['value']:.3g}x "
                     f"the slowest completed one (TP{lo['tp']}xPP{lo['pp']})")
    n_bad, n = int(best["value"].isna().sum()), len(best)
    return [f"At {devices(ws)} ({source}), " + "; ".join(parts) + ".",
            f"{n_bad} of {n} TP x PP combinations at this world size did not complete "
            "(infeasible, failed or timed out)."]


def hardware_generations(df: pd.DataFrame) -> list[str]:
    ws, data = hardware_frame(df)
    source = _source_with_most(data, "hardware")
    med = data[data["source"] == source].groupby("hardware").median(numeric_only=True)
    order = [h for h in generation_order(med.index)]
    at = f" at {devices(ws)}" if ws is not None else ""
    at += f" ({source})"
    first = f"MFU{at} is " + ", ".join(f"{med.loc[h, M.MFU]:.0%} on {h}" for h in order) + "."
    exposed = med[M.COMM_EXPOSED_FRACTION].dropna()
    if not exposed.empty:
        hs = [h for h in order if h in exposed.index]
        return [first, "Exposed communication takes " + ", ".join(
            f"{pct(exposed[h])} of the step on {h}" for h in hs) + "."]
    old, new = order[0], order[-1]
    ratio = med.loc[new, M.TOKENS_PER_S_PER_DEVICE] / med.loc[old, M.TOKENS_PER_S_PER_DEVICE]
    return [first, f"{new} delivers {ratio:.3g}x the per-device throughput of {old}."]


def model_size(df: pd.DataFrame) -> list[str]:
    ws, data = category_frame(df, "model")
    source = _source_with_most(data, "model")
    rows = data[data["source"] == source]
    med = rows.groupby("model").median(numeric_only=True)
    order = model_order(rows)
    small, big = order[0], order[-1]
    at = f" at {devices(ws)}" if ws is not None else ""
    exp = med[M.COMM_EXPOSED_FRACTION]
    first = (f"Exposed communication{at} ({source}) goes from {pct(exp[small])} of the step for "
             f"{small} to {pct(exp[big])} for {big}." if exp.notna().all() else
             f"The study has no exposed-communication figures for {small} or {big}.")
    return [first, f"MFU goes from {pct(med.loc[small, M.MFU])} for {small} to "
                   f"{pct(med.loc[big, M.MFU])} for {big}."]


def workload_utilization(df: pd.DataFrame) -> list[str]:
    data = finite(df, M.MFU)
    out = []
    for col, _title in WORKLOAD_AXES:
        if data[col].nunique() < 2:
            continue
        label, rows = _pick(data, col)
        v0, v1, m0, m1 = _ends(rows, col, M.MFU)
        out.append(f"MFU goes from {m0:.0%} at {col} {v0} to {m1:.0%} at {col} {v1}"
                   f"{_label(label)}.")
    if not out:
        raise FigureSkipped("the study sweeps neither micro_batch nor seq_len")
    if len(out) == 1:
        top = data.loc[data[M.MFU].idxmax()]
        out.append(f"The highest MFU in the study is {top[M.MFU]:.0%} ({trial_label(top)}, "
                   f"seq_len {top['seq_len']}).")
    return out


def prediction_parity(df: pd.DataFrame) -> list[str]:
    pairs = pair_predictions(df)
    if pairs.empty:
        raise FigureSkipped("no configuration has both a measured and a predicted result")
    err = pairs["rel_error"]
    worst = pairs.loc[err.abs().idxmax()]
    return [
        f"Over {len(pairs)} configurations both measured and predicted, the median absolute "
        f"error of the predicted tokens/s per device is {err.abs().median():.0%} (worst "
        f"{worst['rel_error']:+.0%} at {trial_label(worst)}).",
        f"The model over-predicts {int((err > 0).sum())} of {len(pairs)} points; "
        f"{int((err.abs() <= 0.2).sum())} lie within +-20%.",
    ]


def pareto_frontier(df: pd.DataFrame) -> list[str]:
    pts = pareto_points(df)
    wide = varies(pts, "model") or varies(pts, "hardware")
    front = pts[pts["on_frontier"]]
    top = front.iloc[-1]
    tpj = front[M.TOKENS_PER_S] / front["power"]
    eff = front.loc[tpj.idxmax()]
    modelled = (front["power_kind"] == "modelled").any()
    return [
        f"{len(front)} of {len(pts)} trials lie on the throughput-power frontier (no other trial "
        "is faster at no more power).",
        f"The fastest, {trial_label(top, wide)}, reaches {fmt_num(top[M.TOKENS_PER_S])} tokens/s at "
        f"{fmt_power(top['power'])}; the most energy-efficient frontier point, "
        f"{trial_label(eff, wide)}, delivers {fmt_num(tpj.max())} tokens/J"
        + (" (GPU power modelled, not validated)." if modelled else
           f" ({power_device(front, 'total_power_w')} power measured)."),
    ]


def trial_overview(df: pd.DataFrame) -> list[str]:
    parts = []
    for source, rows in sorted(df.groupby("source"), key=lambda g: g[0] != MEASURED):
        statuses = ", ".join(f"{n} {s}" for s, n in rows["status"].value_counts().items())
        noun = f"{len(rows)} {source} trial" + ("" if len(rows) == 1 else "s")
        parts.append(f"{noun}: {statuses}" if df["source"].nunique() == 1 else f"{noun} ({statuses})")
    first = " and ".join(parts) + "."
    ok = overview_frame(df).dropna(subset=["value"])
    if ok.empty:
        return [first, "No trial completed, so none has a throughput."]
    hi, lo = ok.iloc[0], ok.iloc[-1]
    if len(ok) == 1:
        return [first, f"The only completed trial, {hi['label']}, reaches "
                       f"{fmt_num(hi['value'])} tokens/s per device."]
    return [first, f"The fastest per device is {hi['label']} at {fmt_num(hi['value'])} tokens/s, "
                   f"{hi['value'] / lo['value']:.3g}x the slowest completed trial ({lo['label']})."]


def memory_per_device(df: pd.DataFrame) -> list[str]:
    data = finite(df, M.PEAK_MEMORY_GIB)
    x = memory_axis(data)
    label, rows = _pick(data, x)
    v0, v1, m0, m1 = _ends(rows, x, M.PEAK_MEMORY_GIB)
    top = data.loc[data[M.PEAK_MEMORY_GIB].idxmax()]
    second = f"The largest footprint is {top[M.PEAK_MEMORY_GIB]:.3g} GiB ({trial_label(top)})"
    try:
        from scalestudy.spec.catalog import get_hardware

        cap = float(get_hardware(str(top["hardware"])).hbm_gib)
        second += f", {top[M.PEAK_MEMORY_GIB] / cap:.0%} of the {cap:g} GiB of one {top['hardware']} device"
    except Exception:  # noqa: BLE001 - a profile outside the catalogue: no capacity to compare to
        pass
    return [f"Peak memory per device goes from {m0:.3g} GiB at {x} {v0} to {m1:.3g} GiB at {x} "
            f"{v1} ({m1 / m0 - 1:+.0%}){_label(label)}.", second + "."]


def step_time_distribution(df: pd.DataFrame) -> list[str]:
    data = _measured_lists(df, "step_times_s", "per-step times")
    med = np.array([np.median(v) for v in data["step_times_s"]])
    spread = np.array([np.percentile(v, 90) / np.median(v) - 1 for v in data["step_times_s"]])
    labels = list(data["label"])
    i_lo, i_hi, i_sp = int(med.argmin()), int(med.argmax()), int(spread.argmax())
    return [f"Median step time ranges from {fmt_ms(med[i_lo])} ({labels[i_lo]}) to "
            f"{fmt_ms(med[i_hi])} ({labels[i_hi]}).",
            f"The widest spread is in {labels[i_sp]}, whose 90th-percentile step is "
            f"{spread[i_sp]:.0%} slower than its median."]


def loss_curves(df: pd.DataFrame) -> list[str]:
    data = _measured_lists(df, "losses", "losses")
    first = np.array([v[0] for v in data["losses"]])
    last = np.array([v[-1] for v in data["losses"]])
    return [f"Loss falls in {int((last < first).sum())} of {len(data)} measured trials, median "
            f"from {np.median(first):.4g} to {np.median(last):.4g}.",
            f"Final losses range from {last.min():.4g} to {last.max():.4g} across trials."]
