"""Shared pieces of the figure functions: skipping, series grouping, styling, labels.

Every figure draws from completed trials only and groups them into series by the config axes that
actually vary in the study, so the same function serves a 2-trial quick-start and a 200-trial sweep.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import matplotlib

matplotlib.use("Agg")  # reports are rendered headless; never pick an interactive backend

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from scalestudy import metrics as M  # noqa: E402
from scalestudy.spec.trial import trial_name  # noqa: E402
from scalestudy_analysis.load import MEASURED, PREDICTED, completed  # noqa: E402

# Lines carry a gid so tests (and notebook users) can tell data series from guides.
GID_DATA, GID_IDEAL, GID_GUIDE = "data", "ideal", "guide"
# Axes that can split a figure into series, in the order their labels are written. global_batch is
# last: under weak scaling it follows from micro_batch and dp and then adds nothing to the label.
SERIES_AXES = ("model", "hardware", "world_size", "tp", "pp", "zero_stage", "micro_batch",
               "seq_len", "precision", "activation_checkpointing", "global_batch")
AXIS_LABELS = {
    "world_size": "ws{}", "tp": "TP{}", "pp": "PP{}", "zero_stage": "ZeRO-{}",
    "micro_batch": "mb{}", "seq_len": "seq{}", "global_batch": "gb{}",
    "activation_checkpointing": "ckpt={}",
}
# Known accelerator generations, oldest first; anything else sorts after them by name.
GENERATIONS = ("v100", "a100", "h100", "h200", "b200", "gb200")
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
           "#17becf", "#7f7f7f", "#bcbd22")
SOURCE_STYLE = {MEASURED: dict(linestyle="-", marker="o"), PREDICTED: dict(linestyle="--", marker="x")}
# Bars: predicted ones hatched (and said so in the legend), measured ones plain.
SOURCE_HATCH = {MEASURED: None, PREDICTED: "//"}
SOURCE_COLOUR = {MEASURED: PALETTE[0], PREDICTED: PALETTE[1]}
CHOSEN_ATTR = "chosen_profiles"  # df.attrs: {hardware: profiles.ChosenProfile}
METER_DEVICE = {"nvml": "GPU", "rapl": "CPU package"}  # energy_source -> what it measures


class FigureSkipped(ValueError):
    """The study lacks what this figure needs; ``str(err)`` is the note the report shows."""


def finite(df: pd.DataFrame, *columns: str) -> pd.DataFrame:
    """Completed rows with a finite value in every column; skips the figure when none is left."""
    missing = [c for c in columns if c not in df]
    if missing:
        raise FigureSkipped(f"the study has no {', '.join(missing)} column")
    done = completed(df)
    out = done.dropna(subset=list(columns))
    if out.empty:
        raise FigureSkipped(f"no completed trial has {' and '.join(columns)}")
    return out


def need_values(df: pd.DataFrame, column: str, n: int = 2) -> list:
    values = sorted(df[column].dropna().unique())
    if len(values) < n:
        raise FigureSkipped(f"needs at least {n} values of {column}; the study has "
                            f"{', '.join(map(str, values)) or 'none'}")
    return values


def series_keys(df: pd.DataFrame, x: str | Iterable[str], exclude: Iterable[str] = ()) -> list[str]:
    """The axes that still vary once x (and the source) is fixed: each combination is a series.
    An axis determined by the keys already chosen (global_batch under weak scaling) is left out."""
    fixed = [x] if isinstance(x, str) else list(x)
    keys: list[str] = []
    for axis in SERIES_AXES:
        if axis in fixed or axis in exclude or axis not in df:
            continue
        by = fixed + keys + ["source"]
        if df.groupby(by, dropna=False)[axis].nunique(dropna=False).max() > 1:
            keys.append(axis)
    return keys


def label_of(keys: list[str], values: tuple) -> str:
    parts = [AXIS_LABELS.get(k, "{}").format(v) for k, v in zip(keys, values)]
    return " ".join(parts)


def iter_series(df: pd.DataFrame, x: str | Iterable[str], exclude: Iterable[str] = ()
                ) -> Iterator[tuple[str, str, dict, pd.DataFrame]]:
    """(label, source, matplotlib style, rows sorted by x) per series; colour follows the config
    (so measured and predicted of one config share it), line style follows the source."""
    keys = series_keys(df, x, exclude)
    sort_by = [x] if isinstance(x, str) else list(x)
    both_sources = df["source"].nunique() > 1
    configs = sorted({tuple(r) for r in df[keys].itertuples(index=False)}, key=str) if keys else [()]
    for source in (MEASURED, PREDICTED, *sorted(set(df["source"]) - {MEASURED, PREDICTED})):
        part = df[df["source"] == source]
        if part.empty:
            continue
        groups = part.groupby(keys, dropna=False, sort=True) if keys else [((), part)]
        for values, rows in groups:
            values = values if isinstance(values, tuple) else (values,)
            label = label_of(keys, values) if keys else ""
            if both_sources or not label:
                label = f"{label} ({source})" if label else source
            colour = PALETTE[configs.index(tuple(values)) % len(PALETTE)] if keys else PALETTE[0]
            style = dict(SOURCE_STYLE.get(source, SOURCE_STYLE[MEASURED]), color=colour)
            yield label, source, style, rows.sort_values(sort_by)


def primary(df: pd.DataFrame) -> pd.DataFrame:
    """The rows a sentence speaks about: measured ones when the study has any, else predicted."""
    meas = df[df["source"] == MEASURED]
    return meas if not meas.empty else df


def log2_x(ax: Axes, values: Iterable[float]) -> None:
    """World sizes are powers of two in every study; label the ticks with the sizes themselves."""
    ticks = sorted({int(v) for v in values})
    ax.set_xscale("log", base=2)
    if len(ticks) > 12:  # keep labels readable on wide sweeps
        ticks = ticks[:: math.ceil(len(ticks) / 12)]
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()


def generation_order(names: Iterable[str]) -> list[str]:
    def key(name: str) -> tuple[int, str]:
        low = name.lower()
        for i, gen in enumerate(GENERATIONS):
            if low.startswith(gen):
                return i, low
        return len(GENERATIONS), low

    return sorted(set(names), key=key)


def trial_label(row: pd.Series | dict, with_model: bool = False) -> str:
    """Short trial name (ws2-tp1-z3-mb4), as run names are written (spec/trial.py)."""
    name = trial_name(dict(row))
    if with_model:
        name = f"{row['model']}/{row['hardware']} {name}"
    return name


def varies(df: pd.DataFrame, column: str) -> bool:
    return column in df and df[column].nunique(dropna=False) > 1


# Mantissas tried per decade, coarsest first, until a log axis gets three labelled ticks (or two).
LOG_MANTISSAS = ((1,), (1, 2, 5), (1, 2, 3, 5, 7), (1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9))
MAX_LOG_TICKS = 8


def tick_text(v: float) -> str:
    """13000 -> 13k, 0.05 -> 0.05: tick labels as the sentences write numbers."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.4g}{suffix}"
    return f"{v:.4g}"


def log_ticks(lo: float, hi: float) -> list[float]:
    """Two to eight round ticks inside [lo, hi] on a log scale: decades, else 1-2-5, finer when
    the range is short (15-29 W: 15, 20, 25), the range's ends when even that leaves one."""
    lo, hi = min(lo, hi), max(lo, hi)
    if not (lo > 0 and np.isfinite(hi)):
        return []
    decades = range(int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi))) + 1)
    def inside(mantissas: tuple[float, ...]) -> list[float]:
        ticks = [float(f"{m * 10.0 ** d:.6g}") for d in decades for m in mantissas]
        return [t for t in ticks if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)]

    # The coarsest set giving three ticks, else the first giving two, else the range's ends.
    sets = [inside(m) for m in LOG_MANTISSAS]
    ticks = next((t for t in sets if len(t) >= 3), None) or next((t for t in sets if len(t) >= 2),
                                                                 None)
    if ticks is None:  # a range too short for round numbers: its own ends
        ticks = [lo, hi] if hi > lo else [lo]
    if len(ticks) > MAX_LOG_TICKS:
        ticks = ticks[:: int(np.ceil(len(ticks) / MAX_LOG_TICKS))]
    return ticks


def readable_log(ax: Axes, axis: str, values: Iterable[float]) -> None:
    """Log scale on `axis` ("x" or "y") labelled with round numbers inside the data's range, so
    a 15-29 W range reads 15, 20, 25 rather than one unlabelled decade."""
    vals = [float(v) for v in values if v == v and v > 0]
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    if not vals:
        return
    ticks = log_ticks(min(vals), max(vals))
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_ticks(ticks, [tick_text(t) for t in ticks])
    target.set_minor_formatter(NullFormatter())  # matplotlib labels minor ticks on short ranges


def hardware_profile(name: str, df: pd.DataFrame | None = None):
    """The profile of a hardware name: the one the report chose for it, else the catalogue's, else
    None (a profile file the report did not see)."""
    from scalestudy.spec.catalog import get_hardware

    chosen = (df.attrs.get(CHOSEN_ATTR) or {}) if df is not None else {}
    profile = getattr(chosen.get(name), "profile", None)
    if profile is not None:
        return profile
    try:
        return get_hardware(str(name))
    except KeyError:
        return None


def device_word(name: str, df: pd.DataFrame | None = None) -> str:
    """What one device of this hardware is called in a title: GPU, CPU, or device when unknown."""
    profile = hardware_profile(name, df)
    return "device" if profile is None else ("GPU" if profile.is_gpu else "CPU")


def cpu_hardware(df: pd.DataFrame) -> list[str]:
    return sorted(str(h) for h in set(df["hardware"].dropna())
                  if (p := hardware_profile(h, df)) is not None and not p.is_gpu)


def power_frame(df: pd.DataFrame) -> tuple[pd.DataFrame, list[tuple[str, str, str]]]:
    """(df without modelled power of CPU hardware, power_columns of that). The power model
    (perfmodel/power.py) prices GPU boards at TDP; a CPU profile's figure is a typed per-core
    guess, so only a meter's reading (RAPL) counts there. Skips with the reason when nothing is
    left."""
    cpus = cpu_hardware(df)
    data = df
    if cpus and M.TOTAL_POWER_W_ESTIMATED in df:
        data = df.copy()
        rows = data["hardware"].isin(cpus)
        data.loc[rows, [M.TOTAL_POWER_W_ESTIMATED, M.POWER_W_ESTIMATED,
                        M.TOKENS_PER_J_ESTIMATED]] = np.nan
    try:
        return data, power_columns(data)
    except FigureSkipped:
        if not cpus:
            raise
    raise FigureSkipped(f"{', '.join(cpus)} is a CPU profile and no trial measured power "
                        "(energy_source none: no RAPL or NVML meter); the power model covers "
                        "GPUs only, so there is no power to plot")


def power_device(data: pd.DataFrame, power: str) -> str:
    """What the plotted power is the power of: GPU boards (NVML, or the GPU power model), CPU
    packages (RAPL), else the hardware's kind; "device" when the rows disagree."""
    if power == M.TOTAL_POWER_W_ESTIMATED:
        return "GPU"
    rows = data.dropna(subset=[power])
    sources = rows["energy_source"] if "energy_source" in rows else pd.Series("", index=rows.index)
    words = {METER_DEVICE.get(str(src)) or device_word(hw, data)
             for src, hw in zip(sources, rows["hardware"])}
    return words.pop() if len(words) == 1 else "device"


def power_columns(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(total power column, tokens-per-joule column, suffix) for measured and for modelled energy,
    those with data only: the two are never mixed into one number."""
    out = []
    for power, tpj, suffix in (("total_power_w", M.TOKENS_PER_J, ""),
                               (M.TOTAL_POWER_W_ESTIMATED, M.TOKENS_PER_J_ESTIMATED,
                                ", modelled (not validated)")):
        if power in df and completed(df)[power].notna().any():
            out.append((power, tpj, suffix))
    if not out:
        raise FigureSkipped("no completed trial has measured or modelled power "
                            "(power_w / power_w_estimated)")
    return out


def power_unit(watts: Iterable[float]) -> tuple[float, str]:
    """(divisor, unit) so the largest total power reads naturally: a CPU study draws watts, a
    2048-GPU study megawatts."""
    top = max((w for w in watts if w == w), default=0.0)
    for div, unit in ((1e6, "MW"), (1e3, "kW")):
        if top >= div:
            return div, unit
    return 1.0, "W"
