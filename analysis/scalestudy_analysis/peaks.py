"""One peak per hardware and precision for every MFU and HFU of a report.

A measured trial's MFU is recorded against the peak of the profile it ran with (the catalogue's,
for `hardware: cpu-local`), a prediction's against the profile that predicted it (a calibrated one
after `scalestudy calibrate`). Side by side, two peaks read as a model error: on the quick-start a
trial's measured 0.19 against a predicted 0.019 while their tokens/s differ 1.4x. So the report
recomputes both from model TFLOP/s per device (recorded on every completed row, a function of
tokens/s alone) against the peak of the one profile that speaks for the hardware
(profiles.choose_profiles), and names that peak wherever MFU is shown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

from scalestudy import metrics as M
from scalestudy.spec.catalog import Precision
from scalestudy_analysis.profiles import ChosenProfile, measured_against

PEAKS_ATTR = "mfu_peaks"  # df.attrs: {(hardware, precision): Peak}
REL_TOL = 1e-6


@dataclass(frozen=True)
class Peak:
    hardware: str
    precision: str
    tflops: float
    origin: str  # "calibrated cpu-local profile results/calibrated-cpu-local.yaml", ...

    @property
    def text(self) -> str:
        return f"{self.tflops:.3g} TFLOP/s {self.precision}"


def _origin(choice: ChosenProfile | None, hardware: str) -> str:
    if choice is None or choice.profile is None:
        return "as recorded"
    kind = measured_against(choice.profile).split(" (")[0]
    if kind.startswith("UNCALIBRATED"):
        return f"catalogue {hardware}, uncalibrated"
    return f"{kind} {hardware} profile" + (f" {choice.path}" if choice.path else "")


def one_peak(df: pd.DataFrame, choices: Mapping[str, ChosenProfile]) -> pd.DataFrame:
    """df with MFU and HFU of every row recomputed against its hardware's chosen profile's peak at
    the row's precision; df.attrs[PEAKS_ATTR] records each peak. A hardware with no profile keeps
    its recorded values. HFU keeps its recorded ratio to MFU (recomputed FLOPs over model FLOPs)."""
    out = df.copy()
    peaks: dict[tuple[str, str], Peak] = {}
    if M.MFU not in out or M.MODEL_TFLOPS_PER_DEVICE not in out:
        return out
    for (hw, prec), idx in out.groupby(["hardware", "precision"], dropna=False).groups.items():
        choice = choices.get(hw)
        try:
            tflops = choice.profile.peak_tflops[Precision(prec)] if choice and choice.profile \
                else None
        except (ValueError, KeyError):  # a precision the profile has no peak for
            tflops = None
        if tflops is None:
            continue
        old_mfu = out.loc[idx, M.MFU]
        mfu = out.loc[idx, M.MODEL_TFLOPS_PER_DEVICE] / tflops
        if M.HFU in out:
            out.loc[idx, M.HFU] = mfu * (out.loc[idx, M.HFU] / old_mfu)
        out.loc[idx, M.MFU] = mfu
        peaks[(str(hw), str(prec))] = Peak(str(hw), str(prec), float(tflops), _origin(choice, hw))
    out.attrs[PEAKS_ATTR] = peaks
    return out


def implied_peaks(rows: pd.DataFrame) -> dict[tuple[str, str], list[float]]:
    """The peaks (TFLOP/s) the rows' MFU values are relative to, per (hardware, precision), read
    back from the data (model TFLOP/s per device / MFU): what a label may truthfully say."""
    out: dict[tuple[str, str], list[float]] = {}
    if M.MFU not in rows or M.MODEL_TFLOPS_PER_DEVICE not in rows:
        return out
    ok = rows[(rows[M.MFU] > 0) & rows[M.MODEL_TFLOPS_PER_DEVICE].notna()]
    for (hw, prec), part in ok.groupby(["hardware", "precision"]):
        values: list[float] = []
        for v in part[M.MODEL_TFLOPS_PER_DEVICE] / part[M.MFU]:
            if not any(math.isclose(v, u, rel_tol=REL_TOL) for u in values):
                values.append(float(v))
        out[(str(hw), str(prec))] = values
    return out


def shown_peaks(df: pd.DataFrame, rows: pd.DataFrame | None = None) -> list[Peak | str]:
    """The peak of each (hardware, precision) among the rows (default: all of df) as the data says
    it (implied_peaks), with its origin where df.attrs knows it; a str for a hardware whose rows
    disagree (recorded against several peaks)."""
    known: dict = df.attrs.get(PEAKS_ATTR) or {}
    out: list[Peak | str] = []
    for (hw, prec), values in sorted(implied_peaks(df if rows is None else rows).items()):
        if len(values) > 1:
            out.append(f"{hw} {prec}: MIXED peaks ({', '.join(f'{v:.3g}' for v in values)} "
                       "TFLOP/s) as recorded per trial")
            continue
        peak = known.get((hw, prec))
        if peak is None or not math.isclose(peak.tflops, values[0], rel_tol=1e-3):
            peak = Peak(hw, prec, values[0], "as recorded")
        out.append(peak)
    return out


def peak_notes(df: pd.DataFrame, rows: pd.DataFrame | None = None) -> list[str]:
    """'cpu-local: 1.17 TFLOP/s bf16 per device (calibrated cpu-local profile results/x.yaml)'."""
    return [p if isinstance(p, str) else f"{p.hardware}: {p.text} per device ({p.origin})"
            for p in shown_peaks(df, rows)]


def _short(origin: str) -> str:
    """The origin without its path: axis labels stay one line."""
    return origin.split(" /")[0].split(" results")[0] if " profile " in origin else origin


def mfu_label(df: pd.DataFrame, rows: pd.DataFrame | None = None, unit: str = "%") -> str:
    """Axis label naming the one peak the plotted MFU values are relative to, or pointing to the
    figure's title when several hardware types (each with its own peak) share the axis."""
    peaks = shown_peaks(df, rows)
    if len(peaks) == 1 and isinstance(peaks[0], Peak):
        return f"MFU ({unit}; peak {peaks[0].text}, {_short(peaks[0].origin)})"
    return f"MFU ({unit} of each hardware's own peak, see title)" if peaks else f"MFU ({unit})"


def peaks_title(df: pd.DataFrame, rows: pd.DataFrame | None = None) -> str | None:
    """A figure title line listing the peaks when more than one shares an MFU axis."""
    peaks = shown_peaks(df, rows)
    if len(peaks) < 2:
        return None
    return "MFU peaks: " + "; ".join(p if isinstance(p, str) else f"{p.hardware} {p.text}"
                                     for p in peaks)


__all__ = ["PEAKS_ATTR", "Peak", "implied_peaks", "mfu_label", "one_peak", "peak_notes",
           "peaks_title", "shown_peaks"]
