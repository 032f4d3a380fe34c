"""`scalestudy plan`'s rounds in the report of the study it measured: every measured layout, its
throughput as the model predicted it when the plan chose it, as the last refit predicts it (in
sample: that refit saw the measurement) and as measured; the recommended layout marked. Read from
the plan's record beside the ledger (plan_rounds.json, cli_plan_rounds.write_plan_record), which
report_study puts in the frame's attrs; a study that no plan measured has no such figure."""

from __future__ import annotations

import math

import pandas as pd
from matplotlib.figure import Figure

from scalestudy.plan.rounds import PLAN_RECORD
from scalestudy_analysis.base import GID_DATA, PALETTE, FigureSkipped, readable_log
from scalestudy_analysis.sentences import fmt_num, pct

PLAN_ATTR = "plan_record"  # df.attrs: the plan's record (dict), when a plan measured the study
PLAN_FILE = PLAN_RECORD


def _layouts(df: pd.DataFrame) -> tuple[dict, pd.DataFrame]:
    record = df.attrs.get(PLAN_ATTR)
    if not record or not record.get("layouts"):
        raise FigureSkipped("no `scalestudy plan` measured this study (no plan_rounds.json)")
    rows = pd.DataFrame(record["layouts"])
    rows = rows[pd.to_numeric(rows["measured"], errors="coerce").gt(0)]
    if rows.empty:
        raise FigureSkipped("the plan measured no layout to completion")
    return record, rows.sort_values("measured").reset_index(drop=True)


def plan_rounds(df: pd.DataFrame) -> Figure:
    record, rows = _layouts(df)
    fig = Figure(figsize=(10, 1.2 + 0.42 * len(rows)), layout="constrained")
    ax = fig.subplots()
    y = range(len(rows))
    ax.scatter(rows["measured"], y, color="black", s=40, zorder=4, label="measured", gid=GID_DATA)
    for i, (rnd, part) in enumerate(rows.groupby("round")):
        ax.scatter(part["predicted"], part.index, facecolors="none", s=60, zorder=3,
                   edgecolors=PALETTE[i % len(PALETTE)],
                   label=f"predicted when chosen (round {rnd})", gid=GID_DATA)
    now = pd.to_numeric(rows["predicted_now"], errors="coerce")
    ax.scatter(now, y, marker="x", color="grey", zorder=3, label="predicted by the last refit "
               "(in sample)", gid=GID_DATA)
    labels = [f"{'* ' if t == record.get('recommended') else ''}{t} ({f})"
              for t, f in zip(rows["trial"], rows["family"])]
    ax.set_yticks(list(y), labels, fontsize=8)
    values = pd.concat([rows["measured"], rows["predicted"], now]).dropna()
    lo, hi = float(values.min()) / 1.3, float(values.max()) * 1.3
    readable_log(ax, "x", (lo, hi))
    ax.set(xlim=(lo, hi), xlabel="tokens/s",
           title=(f"plan: {record.get('model')} on {record.get('devices')} x "
                  f"{record.get('hardware')} (* recommended; stopped: {record.get('stop_reason')})"))
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="lower right")
    return fig


def _mape(predicted: pd.Series, measured: pd.Series) -> float:
    err = (pd.to_numeric(predicted, errors="coerce") / measured - 1).abs().dropna()
    return float(err.mean()) if len(err) else math.nan


def describe(df: pd.DataFrame) -> list[str]:
    record, rows = _layouts(df)
    out = [f"The plan measured {len(rows)} layouts in {len(record.get('rounds') or [])} rounds "
           f"({record.get('spent_trials')} trials, {record.get('spent_device_hours', 0):.3f} "
           f"device-hours) and stopped: {record.get('stop_reason')}."]
    best = rows[rows["trial"] == record.get("recommended")]
    if not best.empty:
        b = best.iloc[0]
        out.append(f"Recommended: {b['trial']} ({b['family']}), measured {fmt_num(b['measured'])} "
                   f"tokens/s; predicted {fmt_num(b['predicted'])} when the plan chose it.")
    when_chosen = _mape(rows["predicted"], rows["measured"])
    refit = _mape(rows["predicted_now"], rows["measured"])
    if math.isfinite(when_chosen):
        out.append(f"Prediction error when chosen (out of sample): {pct(when_chosen)} mean absolute; "
                   + (f"after the last refit (in sample): {pct(refit)}." if math.isfinite(refit)
                      else "no refit prediction."))
    return out
