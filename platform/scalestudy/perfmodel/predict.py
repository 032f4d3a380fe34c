"""predict(trial) -> TrialResult: the simulate backend, same schema as a measured trial.

Feasibility first (the memory model); then compute (compute.py), the communication the layout issues
(parallelism.py, priced by network.py), the schedule that hides part of it (overlap.py) and power
(power.py). Measured-only fields (losses, measured energy, wall time) stay NaN with a reason.
predict_many(trials) predicts a batch (a study, a sweep's table) with the cyclic collector paused.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Iterable, Iterator
from typing import Any

from scalestudy import metrics as M
from scalestudy.metrics import CollectiveStats, Status, TrialResult
from scalestudy.perfmodel import layouts
from scalestudy.perfmodel import parallelism as par
from scalestudy.perfmodel.compute import compute_times
from scalestudy.perfmodel.flops import hardware_flops_per_token, model_flops_per_token, utilization
from scalestudy.perfmodel.memory import MemoryBreakdown, memory_breakdown, memory_refusal
from scalestudy.perfmodel.coverage import uncalibrated
from scalestudy.perfmodel.overlap import StepTime, step_time
from scalestudy.perfmodel.params import ModelParams, params_for
from scalestudy.perfmodel.power import estimate_power
from scalestudy.spec.catalog import HardwareProfile, ModelDims
from scalestudy.errors import InfeasibleTrial, ReasonClass
from scalestudy.spec.study import PlannedTrial, TrialConfig

BACKEND = "simulate"
_NOT_MODELLED = {
    M.LOSS_FIRST: "simulated trial: no training",
    M.LOSS_LAST: "simulated trial: no training",
    M.POWER_W: "simulated trial: see power_w_estimated",
    M.ENERGY_J: "simulated trial: see energy_j_estimated",
    M.ENERGY_PER_TOKEN_J: "simulated trial: see energy_per_token_j_estimated",
    M.TOKENS_PER_J: "simulated trial: see tokens_per_j_estimated",
    M.WALL_TIME_S: "simulated trial",
    M.TIME_LOST_S: "simulated trial: no faults",
    M.TIME_TO_FIRST_STEP_S: "simulated trial",
    M.STEP_TIME_P90_S: "the model predicts one step time, no distribution",
}


@functools.lru_cache(maxsize=4096)
def _flops_per_token(dims: ModelDims, seq_len: int, recompute: bool,
                     fraction: float) -> tuple[float, float]:
    return (model_flops_per_token(dims, seq_len),
            hardware_flops_per_token(dims, seq_len, recompute, fraction))


def _comm_stats(cfg: TrialConfig, comms: list[par.Comm]) -> dict[str, CollectiveStats]:
    groups = {"tp": cfg.tp, "dp": cfg.dp}
    out: dict[str, CollectiveStats] = {}
    for kind, (calls, nbytes, secs) in par.by_kind(comms).items():
        # Bus bandwidth uses the group the collective runs in: TP for blocking all_reduces.
        n = groups["tp"] if kind == M.ALL_REDUCE and cfg.tp > 1 and cfg.dp == 1 else groups["dp"]
        algbw = nbytes / secs / 1e9 if secs > 0 else float("nan")
        out[kind] = CollectiveStats(count=calls, bytes=nbytes, time_s=secs, algbw_gbps=algbw,
                                    busbw_gbps=algbw * M.busbw_factor(kind, n))
    return out


def simulate(cfg: TrialConfig, p: ModelParams | None = None) -> tuple[StepTime, list[par.Comm]]:
    """Step-time breakdown of a trial, without feasibility checks (for fitting and analysis)."""
    p = p or params_for(cfg.hardware_profile)
    ct = compute_times(cfg, p)
    comms = par.communication(cfg, p)
    if cfg.cp > 1 or cfg.tp_comm_overlap:  # terms that need the compute times (layouts.py)
        comms = layouts.with_layout_comms(cfg, p, ct, comms)
    z3 = par.zero3_phases(cfg, p, ct) if cfg.zero_stage == 3 and cfg.dp > 1 else None
    # The stages as the trial splits them (stage_layers, its chunks): an uneven split paces the
    # pipeline at its heaviest rank, where balanced stages would under-predict the step.
    return step_time(ct, comms, cfg.grad_accum, cfg.pp, p, z3, blocks=par.pipeline_blocks(cfg),
                     virtual_stages=par.virtual_stages(cfg, p)), comms


def predict(cfg: TrialConfig, hardware: HardwareProfile | None = None,
            params: ModelParams | None = None, memory: MemoryBreakdown | Any = None
            ) -> TrialResult:
    """One trial's predicted result; status `infeasible` (class memory) with the reason when its
    estimate breaks the memory rule (perfmodel/memory.py), the same rule the plan applies.
    `memory`: the plan's estimate of this config (anything with total_gib and terms_gib), so it is
    not computed twice."""
    if hardware is not None and hardware is not cfg.hardware_profile:
        cfg = cfg.model_copy(update={"hardware_profile": hardware, "hardware": hardware.name})
        memory = None
    base = {**cfg.config_fields(), "backend": BACKEND}
    p = params or params_for(cfg.hardware_profile)
    mem = memory or memory_breakdown(cfg, fused_attention=p.fused_attention)
    reason = memory_refusal(mem.total_gib, cfg.hardware_profile.hbm_gib)
    if reason:
        return TrialResult(**base, status=Status.infeasible, reason=reason,
                           reason_class=ReasonClass.memory.value,
                           peak_memory_gib=mem.total_gib, memory_source="model")
    st, comms = simulate(cfg, p)
    tokens_s = cfg.tokens_per_step / st.step_s
    per_device = tokens_s / cfg.world_size
    peak = cfg.hardware_profile.peak_flops(cfg.precision)
    redo = (layouts.attention_share(cfg.model_dims, cfg.seq_len) if layouts.selective(cfg)
            else p.recompute_fraction)  # selective recomputation: the attention core only
    mflops, hflops = _flops_per_token(cfg.model_dims, cfg.seq_len, cfg.activation_checkpointing,
                                      redo)
    pw = estimate_power(cfg, st, p)
    return TrialResult(
        **base,
        status=Status.completed,
        step_time_s=st.step_s,
        step_times_s=[st.step_s],
        tokens_per_s=tokens_s,
        tokens_per_s_per_device=per_device,
        model_tflops_per_device=mflops * per_device / 1e12,
        mfu=utilization(mflops, per_device, peak),
        hfu=utilization(hflops, per_device, peak),
        comm_time_s=st.comm_s,
        comm_exposed_s=st.exposed_s,
        comm_exposed_fraction=st.exposed_s / st.step_s,
        compute_time_s=st.compute_s,
        bubble_time_s=st.bubble_s,
        comm=_comm_stats(cfg, comms),
        peak_memory_gib=mem.total_gib,
        memory_source="model",
        energy_source="model",
        power_w_estimated=pw.power_w_per_device,
        energy_j_estimated=pw.energy_per_step_j * cfg.steps.measure,
        energy_per_token_j_estimated=pw.energy_per_token_j,
        tokens_per_j_estimated=pw.tokens_per_j,
        missing=_NOT_MODELLED,  # validation copies it
        uncalibrated=uncalibrated(cfg),
        extra={"energy_window_steps": cfg.steps.measure,
               # GPU-only, like power_w_estimated; the node's other power is named apart.
               M.TOTAL_POWER_W_ESTIMATED: pw.total_power_w,
               M.NODE_OVERHEAD_POWER_W_ESTIMATED: pw.node_overhead_w_per_device,
               "memory_gib": dict(mem.terms_gib)},
    )


def predict_planned(planned: PlannedTrial) -> TrialResult:
    """A planned trial (a plan entry: its verdict and memory estimate decided by the plan) -> its
    predicted result; an infeasible one keeps the plan's reason and class."""
    if not planned.feasible:
        return TrialResult.refused(planned, backend=BACKEND)
    memory = getattr(planned, "memory", None)
    try:
        return predict(planned.config, memory=memory)
    except InfeasibleTrial as err:  # a model term that cannot apply (kept typed, never a crash)
        base = {**planned.config.config_fields(), "backend": BACKEND}
        return TrialResult(**base, status=Status.infeasible, reason=str(err),
                           reason_class=err.reason_class.value)



@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, then as it was (on or off).

    Why: a prediction allocates a few hundred small containers, so the collector runs every few
    predictions and, every few thousand, walks the whole heap (every imported library's objects and
    the results kept so far) to find cycles that predictions do not make; reference counting frees
    everything a prediction drops (tests/unit/test_predict_many.py checks that a batch leaves no
    cyclic garbage). tests/bench/predict_speed.py, 5,120 random configurations, each path in a fresh
    process, alternating, idle 2-core AMD EPYC: 0.88-0.89 s of CPU paused, 1.01-1.05 s one predict()
    call at a time with the collector running (1.15x). Process-wide: another thread's cycles wait
    for the batch's end."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def predict_many(trials: Iterable[PlannedTrial | TrialConfig]) -> list[TrialResult]:
    """Each trial's predicted result, in order: a planned trial as predict_planned reads it (its
    infeasibility recorded), a config as predict does. Same results as one call each, faster."""
    with _cyclic_gc_paused():
        return [predict_planned(t) if isinstance(t, PlannedTrial) else predict(t) for t in trials]
