"""The numbers docs/headline.md states, computed from the paper studies' results (never typed by hand).

`findings(frames)` takes the tidy frame of each study of experiments/paper/ (study name -> frame)
and returns named, formatted figures; `render(template, frames)` fills docs/headline_template.md's
{placeholders} with them. A study missing from `frames` leaves its placeholders unfilled (named in
the error), so a stale headline is never written silently.
"""

from __future__ import annotations

import pandas as pd

from scalestudy import metrics as M
from scalestudy_analysis.load import completed

TPS = M.TOKENS_PER_S_PER_DEVICE
EXPOSED = M.COMM_EXPOSED_FRACTION


def _pct(x: float) -> str:
    return f"{x:.0%}" if abs(x) >= 0.1 else f"{x:.1%}"


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _fsdp(df: pd.DataFrame) -> dict[str, str]:
    rows = completed(df).sort_values("world_size")
    first, last = rows.iloc[0], rows.iloc[-1]
    half = rows[rows[TPS] < 0.5 * first[TPS]]
    return {
        "fsdp_w0": f"{first['world_size']:,}", "fsdp_w1": f"{last['world_size']:,}",
        "fsdp_tps0": _num(first[TPS]), "fsdp_tps1": _num(last[TPS]),
        "fsdp_drop": _pct(1 - last[TPS] / first[TPS]),
        "fsdp_exp0": _pct(first[EXPOSED]), "fsdp_exp1": _pct(last[EXPOSED]),
        "fsdp_mfu0": _pct(first[M.MFU]), "fsdp_mfu1": _pct(last[M.MFU]),
        "fsdp_half_at": f"{half.iloc[0]['world_size']:,}" if len(half) else "never",
        "fsdp_ga_half": f"{int(half.iloc[0]['grad_accum'])}" if len(half) else "-",
    }


def _layout(r: pd.Series) -> str:
    return f"TP{r['tp']} x PP{r['pp']} with ZeRO-{r['zero_stage']}" + (
        ", checkpointed" if r["activation_checkpointing"] else "")


def _model_parallel(df: pd.DataFrame) -> dict[str, str]:
    out, rows = {}, completed(df)
    for model, mine in rows.groupby("model"):
        key = model.replace("llama2-", "")
        pure = mine[(mine["tp"] == 1) & (mine["pp"] == 1) & (mine["zero_stage"] == 3)]
        mp = mine[(mine["tp"] > 1) | (mine["pp"] > 1)]
        best_pure, best_mp = pure.loc[pure[TPS].idxmax()], mp.loc[mp[TPS].idxmax()]
        out.update({
            f"mp_{key}_pure": _num(best_pure[TPS]), f"mp_{key}_pure_exp": _pct(best_pure[EXPOSED]),
            f"mp_{key}_best": _num(best_mp[TPS]), f"mp_{key}_best_layout": _layout(best_mp),
            f"mp_{key}_best_exp": _pct(best_mp[EXPOSED]),
            f"mp_{key}_ratio": f"{best_mp[TPS] / best_pure[TPS]:.1f}x",
            f"mp_{key}_overall": _layout(mine.loc[mine[TPS].idxmax()]),
        })
    out["mp_infeasible"] = str(int((df["status"] != M.Status.completed.value).sum()))
    out["mp_total"] = str(len(df))
    return out


def _generations(df: pd.DataFrame) -> dict[str, str]:
    rows, out = completed(df), {}
    small, big = rows["world_size"].min(), rows["world_size"].max()
    out.update(gen_w0=f"{small:,}", gen_w1=f"{big:,}")
    for hw, mine in rows.groupby("hardware"):
        key = hw.split("-")[0]
        at = mine.set_index("world_size")
        out.update({f"gen_{key}_exp0": _pct(at.loc[small, EXPOSED]),
                    f"gen_{key}_exp1": _pct(at.loc[big, EXPOSED]),
                    f"gen_{key}_mfu0": _pct(at.loc[small, M.MFU]),
                    f"gen_{key}_mfu1": _pct(at.loc[big, M.MFU])})
    return out


def _fixed(df: pd.DataFrame) -> dict[str, str]:
    rows, out = completed(df), {}
    for hw, mine in rows.groupby("hardware"):
        key, mine = hw.split("-")[0], mine.sort_values("world_size")
        a, b = mine.iloc[0], mine.iloc[-1]
        out.update({f"fixed_{key}_w0": f"{a['world_size']:,}", f"fixed_{key}_w1": f"{b['world_size']:,}",
                    f"fixed_{key}_drop": _pct(1 - b[TPS] / a[TPS]),
                    f"fixed_{key}_exp1": _pct(b[EXPOSED])})
    return out


def _model_size(df: pd.DataFrame) -> dict[str, str]:
    rows = completed(df)
    out = {}
    for i, (_, r) in enumerate(rows.iterrows()):
        out.update({f"size_{i}_model": r["model"], f"size_{i}_exp": _pct(r[EXPOSED]),
                    f"size_{i}_mfu": _pct(r[M.MFU])})
    return out


def _workload(df: pd.DataFrame) -> dict[str, str]:
    rows = completed(df).set_index(["micro_batch", "seq_len"])
    mb0, mb1 = rows.index.get_level_values(0).min(), rows.index.get_level_values(0).max()
    s0, s1 = rows.index.get_level_values(1).min(), rows.index.get_level_values(1).max()
    return {"wl_mb0": str(mb0), "wl_mb1": str(mb1), "wl_s0": f"{s0:,}", "wl_s1": f"{s1:,}",
            "wl_mfu_mb0": _pct(rows.loc[(mb0, s0), M.MFU]),
            "wl_mfu_mb1": _pct(rows.loc[(mb1, s0), M.MFU]),
            "wl_mfu_s1": _pct(rows.loc[(mb0, s1), M.MFU]),
            "wl_exp_mb0": _pct(rows.loc[(mb0, s0), EXPOSED]),
            "wl_exp_mb1": _pct(rows.loc[(mb1, s0), EXPOSED])}


def _power(df: pd.DataFrame) -> dict[str, str]:
    rows, out = completed(df), {}
    for model, mine in rows.groupby("model"):
        key, mine = model.replace("llama2-", ""), mine.sort_values("world_size")
        a, b = mine.iloc[0], mine.iloc[-1]
        out.update({
            "pw_w0": f"{a['world_size']:,}", "pw_w1": f"{b['world_size']:,}",
            f"pw_{key}_power": f"{b[M.TOTAL_POWER_W_ESTIMATED] / a[M.TOTAL_POWER_W_ESTIMATED]:.3g}x",
            f"pw_{key}_tput": f"{b[M.TOKENS_PER_S] / a[M.TOKENS_PER_S]:.3g}x",
            f"pw_{key}_tpj0": f"{a[M.TOKENS_PER_J_ESTIMATED]:.3g}",
            f"pw_{key}_tpj1": f"{b[M.TOKENS_PER_J_ESTIMATED]:.3g}",
            f"pw_{key}_gpu_w0": _num(a[M.POWER_W_ESTIMATED]),
            f"pw_{key}_gpu_w1": _num(b[M.POWER_W_ESTIMATED]),
        })
    return out


STUDIES = {"fsdp_scaling": _fsdp, "model_parallel": _model_parallel,
           "hardware_generations": _generations, "fixed_workload": _fixed,
           "model_size": _model_size, "compute_workload": _workload, "power": _power}


def findings(frames: dict[str, pd.DataFrame]) -> dict[str, str]:
    out: dict[str, str] = {}
    for study, fn in STUDIES.items():
        if study in frames:
            out.update(fn(frames[study]))
    return out


def render(template: str, frames: dict[str, pd.DataFrame]) -> str:
    values = findings(frames)
    try:
        return template.format_map(values)
    except KeyError as err:
        raise KeyError(f"headline template needs {err} (is its study swept?)") from None
