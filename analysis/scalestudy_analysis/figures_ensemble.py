"""One large model or several smaller ones at once (spec `ensemble:`): aggregate tokens/s, tokens
per joule and efficiency relative to the single model against the member count k, measured and
predicted on one plot, the single model marked; and the finding: where the members overtake the
single model and by how much, measured where measured and predicted where predicted.

Predicted rows: a simulated study's own; for a measured study, each measured trial's configuration
predicted now (catalogue profile) in its measured place in the comparison and compared as the sweep
compares (perfmodel/ensemble.py), so the measured and predicted curves are the same comparison.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterator

import pandas as pd
from matplotlib.figure import Figure

from scalestudy import metrics as M
from scalestudy.errors import SpecError
from scalestudy.metrics import EnsembleRole, TrialResult
from scalestudy.perfmodel.ensemble import Crossover, compare, crossover
from scalestudy.spec.trial import Backend, config_from_row
from scalestudy_analysis.base import (GID_DATA, GID_GUIDE, PALETTE, SOURCE_STYLE, FigureSkipped,
                                      log2_x, readable_log)
from scalestudy_analysis.load import FIELD_KINDS, MEASURED, completed

GROUP_KEY = (M.ENSEMBLE_ID, M.ENSEMBLE_ROLE, "model", M.ENSEMBLE_K)
SINGLE = EnsembleRole.single.value
# List and mapping fields of a result (per-step series, comm, resizes, missing, extra): unused here.
_SERIES = frozenset(n for n, f in TrialResult.model_fields.items()
                    if typing.get_origin(f.annotation) in (list, dict))


def _result(row: dict) -> TrialResult:
    """A tidy frame's row back as a TrialResult, its scalars only (what a crossover reads)."""
    fields = {}
    for name, kind in FIELD_KINDS.items():
        v = row.get(name)
        nan = isinstance(v, float) and math.isnan(v)
        if name in _SERIES or v is None or (nan and kind is not float):
            continue
        fields[name] = v
    return TrialResult(**fields)


def _predicted_twins(measured: pd.DataFrame) -> list[TrialResult]:
    """Each measured trial predicted in its place in the comparison, then compared per group."""
    from scalestudy.perfmodel.params import params_for
    from scalestudy.perfmodel.predict import predict

    groups: dict[tuple, list[TrialResult]] = {}
    for row in measured.to_dict("records"):
        try:
            cfg = config_from_row(row)
        except (SpecError, ValueError):  # outside the catalogue: no prediction
            continue
        autotp = params_for(cfg.hardware_profile, tp_all_reduce_per_linear=True)  # as it ran
        r = predict(cfg.model_copy(update={"backend": Backend.simulate}), params=autotp)
        tags = {k: row[k] for k in (M.ENSEMBLE_ID, M.ENSEMBLE_K, M.MEMBER_INDEX, M.TOKEN_BUDGET)}
        tags[M.ENSEMBLE_ROLE] = EnsembleRole(row[M.ENSEMBLE_ROLE])
        groups.setdefault(tuple(row[k] for k in GROUP_KEY), []).append(r.model_copy(update=tags))
    return [r for group in groups.values() for r in compare(group)]


def ensemble_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The study's compared rows, measured and predicted (`source`), one per trial."""
    if M.ENSEMBLE_ID not in df or df[M.ENSEMBLE_ID].isna().all():
        raise FigureSkipped("the study has no ensemble: section (one model against several)")
    rows = df[df[M.ENSEMBLE_ID].notna()]
    measured = rows[rows["source"] == MEASURED]
    out = [rows]
    if not measured.empty:
        from scalestudy_analysis.load import results_frame

        out.append(results_frame(_predicted_twins(completed(measured))))
    frame = pd.concat([f for f in out if not f.empty], ignore_index=True)
    return frame.assign(**{M.ENSEMBLE_K: frame[M.ENSEMBLE_K].astype(int)})


def _groups(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per group (member 0 stands for it: the group's columns are the same on each)."""
    done = completed(frame).sort_values(M.MEMBER_INDEX)
    return done.drop_duplicates([*GROUP_KEY, "source"]).assign(
        devices=lambda g: g["world_size"] * g[M.ENSEMBLE_K])


def crossovers(frame: pd.DataFrame) -> Iterator[tuple[str, Crossover, float]]:
    """(source, crossover, the members' smallest measured overlap) per comparison and member
    model."""
    for (source, _), rows in completed(frame).groupby(["source", M.ENSEMBLE_ID]):
        results = [_result(r) for r in rows.to_dict("records")]
        if not any(r.ensemble_role is EnsembleRole.single for r in results):
            continue
        members = rows[rows[M.ENSEMBLE_ROLE] != SINGLE]
        for model in sorted(members["model"].unique()):
            overlap = members.loc[members["model"] == model, M.ENSEMBLE_OVERLAP_FRACTION].min()
            yield source, crossover(results, model), overlap


def ensemble_comparison(df: pd.DataFrame) -> Figure:
    groups = _groups(ensemble_frame(df))
    if groups.empty:
        raise FigureSkipped("no group of the comparison completed")
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    ax_t, ax_e, ax_r = fig.subplots(1, 3)
    series = list(groups.groupby(["devices", "model", M.ENSEMBLE_ROLE, "source"]))
    colours = {key: PALETTE[i % len(PALETTE)] for i, key in
               enumerate(sorted({(d, m) for (d, m, *_), _ in series}))}
    for (n, model, role, source), rows in series:
        rows = rows.sort_values(M.ENSEMBLE_K)
        style = dict(SOURCE_STYLE[source], color=colours[(n, model)])
        if role == SINGLE:  # the single model: a star at k = 1 (hollow: predicted)
            style.update(marker="*", markersize=14, linestyle="none",
                         markerfacecolor=style["color"] if source == MEASURED else "none")
        label = f"{source}: {model} {'single' if role == SINGLE else 'members'} (N={n:,})"
        ax_t.plot(rows[M.ENSEMBLE_K], rows[M.ENSEMBLE_TOKENS_PER_S], label=label, gid=GID_DATA,
                  **style)
        ax_e.plot(rows[M.ENSEMBLE_K], rows[M.ENSEMBLE_TOKENS_PER_J], gid=GID_DATA, **style)
    for source, x, _ in crossovers(ensemble_frame(df)):
        name = "FLOPs/J" if x.metric == M.ENSEMBLE_MODEL_FLOPS_PER_J else "FLOPs/device-s"
        ax_r.plot([s.k for s in x.sides], [x.ratio(s) for s in x.sides], gid=GID_DATA,
                  label=f"{source}: {x.sides[0].model} vs {x.single.model}, "
                        f"N={x.devices:,} ({name})",
                  **dict(SOURCE_STYLE[source], color=colours.get((x.devices, x.sides[0].model))))
    ax_r.axhline(1.0, color="0.3", linewidth=1, linestyle=":", gid=GID_GUIDE)
    ax_r.plot([1], [1.0], marker="*", markersize=14, color="0.3", linestyle="none",
              gid=GID_GUIDE, label="the single model (= 1)")
    ks = sorted(groups[M.ENSEMBLE_K].unique())
    readable_log(ax_t, "y", groups[M.ENSEMBLE_TOKENS_PER_S].dropna())
    ax_t.set(title="Aggregate throughput", xlabel="members k (single model: star)",
             ylabel="tokens/s (sum over the group)")
    no_energy = groups[M.ENSEMBLE_TOKENS_PER_J].isna() & (groups["source"] == MEASURED)
    ax_e.set(title="Tokens per joule" + (" (measured: no energy meter)" if no_energy.any() else ""),
             xlabel="members k", ylabel="tokens/J (group)")
    ax_r.set(title="Efficiency relative to the single model", xlabel="members k",
             ylabel="group / single (model FLOPs per J or per device-s)")
    for ax in (ax_t, ax_e, ax_r):
        log2_x(ax, ks)
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=7)
    ax_r.legend(fontsize=7)
    return fig


def _pct(x: float) -> str:
    return f"{x:.1%}" if math.isfinite(x) else "an unknown share"


def finding(source: str, x: Crossover, overlap: float) -> str:
    """Where k members overtake the single model, by how much, and the terms behind it."""
    what = ("model FLOPs per joule" if x.metric == M.ENSEMBLE_MODEL_FLOPS_PER_J
            else "model FLOPs per device-second (no energy meter: devices x seconds, not joules)")
    member, best = x.sides[0].model, x.best
    head = f"{source.capitalize()}, {x.devices:,} devices: "
    if x.k is not None:
        at = next(s for s in x.sides if s.k == x.k)
        text = (f"{member} members overtake one {x.single.model} in {what} from k = {x.k} "
                f"({x.ratio(at):.2f}x)")
        if best.k != x.k:
            text += f", up to {x.ratio(best):.2f}x at k = {best.k}"
    else:
        text = (f"no count of {member} members up to k = {x.sides[-1].k} reaches one "
                f"{x.single.model} in {what}: at best {x.ratio(best):.2f}x at k = {best.k}")
    if math.isfinite(x.single.busy_fraction) and math.isfinite(best.busy_fraction):
        text += (f"; the single model computes {_pct(x.single.busy_fraction)} of each step (MFU "
                 f"{_pct(x.single.mfu)}) at {x.single.power_w_per_device:.0f} W per device, a "
                 f"member on {best.world_size_each:,} device{'s' * (best.world_size_each > 1)} "
                 f"{_pct(best.busy_fraction)} (MFU "
                 f"{_pct(best.mfu)}) at {best.power_w_per_device:.0f} W")
    if math.isfinite(overlap):
        text += f"; the members' timed windows overlapped {overlap:.0%}"
    return head + text + "."


def describe(df: pd.DataFrame) -> list[str]:
    found = list(crossovers(ensemble_frame(df)))
    if not found:
        raise FigureSkipped("no comparison has both its single model and a member group completed")
    found.sort(key=lambda f: (f[0] != MEASURED, f[1].devices, f[1].sides[0].model))
    return [finding(*f) for f in found]
