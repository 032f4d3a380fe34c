"""Synthetic studies with known numbers, for tests and for trying figures without a cluster.

Every row is a validated TrialResult, so a synthetic study has exactly the schema of a real one.
The numbers follow simple closed forms (documented per metric) rather than any performance model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import pandas as pd

from scalestudy.metrics import Status, TrialResult
from scalestudy_analysis.load import results_frame

HW_SPEED = {"v100-32gb": 0.4, "a100-80gb": 1.0, "h100-80gb": 2.5, "h200-141gb": 2.8}
MODEL_SIZE_B = {"llama2-7b": 7, "llama2-13b": 13, "llama2-70b": 70}


def synthetic_results(
    world_sizes: Iterable[int] = (8, 16, 32, 64),
    models: Iterable[str] = ("llama2-7b",),
    hardware: Iterable[str] = ("a100-80gb",),
    zero_stages: Iterable[int] = (3,),
    tp_pp: Iterable[tuple[int, int]] = ((1, 1),),
    micro_batches: Iterable[int] = (1,),
    seq_lens: Iterable[int] = (2048,),
    backends: Iterable[str] = ("measure",),
    study: str = "synthetic",
    power: bool = True,
    comm: bool = True,
    per_step: bool = True,
    infeasible: Iterable[tuple[int, int, int]] = (),  # (world_size, tp, pp) marked infeasible
) -> list[TrialResult]:
    """One trial per grid point and backend. Per-device throughput = 1000 tokens/s x hardware
    speed / model size in billions x micro-batch^0.3, times a scaling efficiency of
    1 / (1 + 0.1 log2(ws / smallest ws)); predictions are 10% above measurements."""
    world_sizes = sorted(world_sizes)
    out = []
    bad = set(infeasible)
    grid = itertools.product(models, hardware, world_sizes, zero_stages, tp_pp, micro_batches,
                             seq_lens, backends)
    for model, hw, ws, zero, (tp, pp), mb, seq, backend in grid:
        if ws % (tp * pp):
            continue
        dp = ws // (tp * pp)
        cfg = dict(study=study, trial_id=f"{backend}-{model}-{hw}-{ws}-{zero}-{tp}-{pp}-{mb}-{seq}",
                   backend=backend, model=model, hardware=hw, world_size=ws,
                   nodes=max(1, ws // 8), dp=dp, tp=tp, pp=pp, zero_stage=zero, micro_batch=mb,
                   grad_accum=1, global_batch=mb * dp, seq_len=seq, precision="bf16",
                   activation_checkpointing=False, seed=0, learning_rate=1e-3,
                   trial_timeout_s=3600.0, steps_warmup=2, steps_measure=5, steps_profile=1)
        if (ws, tp, pp) in bad:
            out.append(TrialResult(**cfg, status=Status.infeasible,
                                   reason="needs 93.1 GiB per device, has 80 GiB"))
            continue
        eff = 1.0 / (1.0 + 0.1 * math.log2(ws / world_sizes[0]))
        per_dev = 1000.0 * HW_SPEED.get(hw, 1.0) / MODEL_SIZE_B.get(model, 7) * mb ** 0.3 * eff
        per_dev *= 1.0 + 0.05 * math.log2(tp * pp)  # something for the degree figure to rank
        if backend == "simulate":
            per_dev *= 1.1
        tokens_per_s = per_dev * ws
        step = mb * dp * seq / tokens_per_s
        exposed = step * (1.0 - eff)
        fields = dict(step_time_s=step, step_time_p90_s=step * 1.05, tokens_per_s=tokens_per_s,
                      tokens_per_s_per_device=per_dev, mfu=0.5 * eff, hfu=0.5 * eff,
                      # 6 FLOPs per parameter per token (no attention term: enough to rank sizes)
                      model_tflops_per_device=per_dev * 6e9 * MODEL_SIZE_B.get(model, 7) / 1e12,
                      peak_memory_gib=60.0 / (1 + zero) / tp + mb)
        if comm:
            fields.update(comm_time_s=step * 0.5, comm_exposed_s=exposed,
                          comm_exposed_fraction=exposed / step)
        if power:
            watts = 400.0 * HW_SPEED.get(hw, 1.0) ** 0.5
            key = "power_w" if backend == "measure" else "power_w_estimated"
            tpj = "tokens_per_j" if backend == "measure" else "tokens_per_j_estimated"
            fields.update({key: watts, tpj: tokens_per_s / (watts * ws)})
        if per_step and backend == "measure":
            fields.update(step_times_s=[step * f for f in (0.98, 1.0, 1.01, 1.02, 1.06)],
                          losses=[10.0 - 0.3 * i for i in range(7)],
                          loss_first=10.0, loss_last=8.2)
        out.append(TrialResult(**cfg, status=Status.completed, **fields))
    return out


def synthetic_study(**kwargs) -> pd.DataFrame:
    return results_frame(synthetic_results(**kwargs))
