"""Metric names and the TrialResult schema shared by measured and predicted trials.

Every other module refers to metrics through these constants, so a renamed metric is renamed once.
A metric that could not be measured is NaN and ``missing[name]`` says why.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from scalestudy.spec.trial import PlannedTrial, TrialConfig, config_columns

NAN = float("nan")

# Throughput and utilization
STEP_TIME_S = "step_time_s"
STEP_TIME_P90_S = "step_time_p90_s"
TOKENS_PER_S = "tokens_per_s"
TOKENS_PER_S_PER_DEVICE = "tokens_per_s_per_device"
MODEL_TFLOPS_PER_DEVICE = "model_tflops_per_device"
MFU = "mfu"
HFU = "hfu"
# Communication (per optimizer step)
COMM_TIME_S = "comm_time_s"
COMM_EXPOSED_S = "comm_exposed_s"
COMM_EXPOSED_FRACTION = "comm_exposed_fraction"
# Step-time breakdown (the performance model fills them; step = compute + exposed comm + bubble)
COMPUTE_TIME_S = "compute_time_s"
BUBBLE_TIME_S = "bubble_time_s"
STEP_TIME_S_PROFILED = "step_time_s_profiled"  # profiled window, perturbed: never for throughput
# Pipelines (pp > 1; train/pipeline_summary.py defines them): the share of a stage's time in the
# schedule it spends idle, the mean over stages; the busiest stage's compute over the mean stage's.
# Per stage (compute, bubble, p2p wait, peak memory): TrialResult.pipeline_stages.
BUBBLE_FRACTION = "bubble_fraction"
STAGE_IMBALANCE = "stage_imbalance"
# Device busy-ness over the timed window: NVML utilization % (GPU) / CPU-seconds per wall second (CPU)
DEVICE_UTILIZATION_PCT = "device_utilization_pct"
CPU_UTILIZATION_CORES = "cpu_utilization_cores"
# Memory, per device (max over the trial's devices). On GPU: the caching allocator's peak allocated
# bytes (PEAK_MEMORY_GIB), its peak reserved bytes (what the allocator holds from the driver, including
# fragmentation: the figure an OOM is decided against) and NVML's used memory of the trial's device
# (everything on the device: CUDA context, NCCL buffers, reserved pool, other processes). On CPU the
# first is the process's peak RSS and the other two are NaN with a reason.
PEAK_MEMORY_GIB = "peak_memory_gib"
PEAK_MEMORY_RESERVED_GIB = "peak_memory_reserved_gib"
DEVICE_MEMORY_USED_GIB = "device_memory_used_gib"
# Energy: measured over the timed window (checkpoint saves excluded), on the trial's own devices only.
# energy_source "nvml" covers the GPU boards only (no CPUs, host memory, NICs, fans, PSU losses);
# "rapl" covers CPU packages and their DRAM. POWER_W is per device of the trial (mean over them).
POWER_W = "power_w"
ENERGY_J = "energy_j"
ENERGY_PER_TOKEN_J = "energy_per_token_j"
TOKENS_PER_J = "tokens_per_j"
# ... and modelled (never mixed with the measured ones). Modelled, not validated. power_w_estimated is
# GPU-only, like NVML's measured power_w; the node's other power (CPUs, NICs, fans, PSU loss) is a
# separate estimate per device, in a result's `extra` under NODE_OVERHEAD_POWER_W_ESTIMATED.
POWER_W_ESTIMATED = "power_w_estimated"
NODE_OVERHEAD_POWER_W_ESTIMATED = "node_overhead_power_w_estimated"
# The GPUs of the whole trial together (a result's `extra`): power_w_estimated x world_size.
TOTAL_POWER_W_ESTIMATED = "total_power_w_estimated"
ENERGY_J_ESTIMATED = "energy_j_estimated"
ENERGY_PER_TOKEN_J_ESTIMATED = "energy_per_token_j_estimated"
TOKENS_PER_J_ESTIMATED = "tokens_per_j_estimated"
# Training signal
LOSS_FIRST = "loss_first"
LOSS_LAST = "loss_last"
# Cost of the trial itself
# Fault tolerance and elastic trials: worker-group restarts, and the wall time from each failed
# attempt's last checkpoint to its resumed loop (lost work + detection + restart + reload).
RESTARTS = "restarts"
TIME_LOST_S = "time_lost_s"

WALL_TIME_S = "wall_time_s"
TIME_TO_FIRST_STEP_S = "time_to_first_step_s"
# Per-step series (MLflow metric history, one value per step)
TRAIN_LOSS = "train/loss"
TRAIN_STEP_TIME_S = "train/step_time_s"

SCALAR_METRICS: tuple[str, ...] = (
    STEP_TIME_S, STEP_TIME_P90_S, TOKENS_PER_S, TOKENS_PER_S_PER_DEVICE, MODEL_TFLOPS_PER_DEVICE,
    MFU, HFU, COMM_TIME_S, COMM_EXPOSED_S, COMM_EXPOSED_FRACTION, COMPUTE_TIME_S, BUBBLE_TIME_S,
    STEP_TIME_S_PROFILED, BUBBLE_FRACTION, STAGE_IMBALANCE,
    DEVICE_UTILIZATION_PCT, CPU_UTILIZATION_CORES, PEAK_MEMORY_GIB, PEAK_MEMORY_RESERVED_GIB,
    DEVICE_MEMORY_USED_GIB,
    POWER_W, ENERGY_J, ENERGY_PER_TOKEN_J, TOKENS_PER_J,
    POWER_W_ESTIMATED, ENERGY_J_ESTIMATED, ENERGY_PER_TOKEN_J_ESTIMATED, TOKENS_PER_J_ESTIMATED,
    LOSS_FIRST, LOSS_LAST, WALL_TIME_S, TIME_TO_FIRST_STEP_S, RESTARTS, TIME_LOST_S,
)


# One large model or several smaller ones at once (issue 36: plan/ensemble.py, sweep/ensemble.py,
# perfmodel/ensemble.py). Rows of one comparison (the single model on N devices and, per member count
# k, k members on N / k each) share ENSEMBLE_ID; ENSEMBLE_K and MEMBER_INDEX place a row in it.
ENSEMBLE_ID = "ensemble_id"
ENSEMBLE_ROLE = "ensemble_role"
ENSEMBLE_K = "ensemble_k"
MEMBER_INDEX = "member_index"
TOKEN_BUDGET = "token_budget"  # tokens each model trains on (the spec's ensemble.token_budget)
# The timed window of a measured trial, epoch seconds of rank 0's clock: members' overlap is read off it.
TIMED_WINDOW_START_EPOCH_S = "timed_window_start_epoch_s"
TIMED_WINDOW_END_EPOCH_S = "timed_window_end_epoch_s"
# Per trial. Energy is the row's own: measured (nvml, rapl) or modelled (model: the *_estimated
# figures); a meter shared by several trials (RAPL: the whole machine) is attributed to each by its
# share of the devices running then. Model FLOPs per joule compares models of different sizes fairly;
# device-seconds per token is the fallback where no energy figure exists (named so, never as joules).
ENERGY_ATTRIBUTED_J = "energy_attributed_j"
MODEL_FLOPS_PER_J = "model_flops_per_j"
DEVICE_S_PER_TOKEN = "device_s_per_token"
TIME_TO_BUDGET_S = "time_to_budget_s"  # token_budget / tokens_per_s
ENERGY_TO_BUDGET_J = "energy_to_budget_j"  # token_budget x attributed energy per token
# Per group of trials run together (the same on each of its rows): the single model is a group of
# one. Aggregate throughput is the members' sum; per joule, their sums over their energy; time to the
# budget the slowest member's, energy to it the sum (every member trains on token_budget tokens).
ENSEMBLE_OVERLAP_FRACTION = "ensemble_overlap_fraction"  # all members in their window / shortest one
ENSEMBLE_TOKENS_PER_S = "ensemble_tokens_per_s"
ENSEMBLE_TOKENS_PER_J = "ensemble_tokens_per_j"
ENSEMBLE_MODEL_FLOPS_PER_J = "ensemble_model_flops_per_j"
ENSEMBLE_MODEL_FLOPS_PER_DEVICE_S = "ensemble_model_flops_per_device_s"
ENSEMBLE_DEVICE_S_PER_TOKEN = "ensemble_device_s_per_token"
ENSEMBLE_TIME_TO_BUDGET_S = "ensemble_time_to_budget_s"
ENSEMBLE_ENERGY_TO_BUDGET_J = "ensemble_energy_to_budget_j"
ENSEMBLE_ENERGY_SOURCE = "ensemble_energy_source"
ENSEMBLE_METRICS: tuple[str, ...] = (
    ENSEMBLE_K, MEMBER_INDEX, TOKEN_BUDGET, TIMED_WINDOW_START_EPOCH_S, TIMED_WINDOW_END_EPOCH_S,
    ENERGY_ATTRIBUTED_J, MODEL_FLOPS_PER_J, DEVICE_S_PER_TOKEN, TIME_TO_BUDGET_S, ENERGY_TO_BUDGET_J,
    ENSEMBLE_OVERLAP_FRACTION, ENSEMBLE_TOKENS_PER_S, ENSEMBLE_TOKENS_PER_J, ENSEMBLE_MODEL_FLOPS_PER_J,
    ENSEMBLE_MODEL_FLOPS_PER_DEVICE_S, ENSEMBLE_DEVICE_S_PER_TOKEN, ENSEMBLE_TIME_TO_BUDGET_S,
    ENSEMBLE_ENERGY_TO_BUDGET_J,
)


def search_metric(name: str | None) -> str:
    """The metric a search optimises: the spec's `search.metric`, by default per-device throughput."""
    return name or TOKENS_PER_S_PER_DEVICE


# Collective kinds, as DeepSpeed and torch.distributed name them after kind_of (measure/overlap.py)
ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"
BROADCAST = "broadcast"
REDUCE = "reduce"
SEND_RECV = "send_recv"
GATHER = "gather"
SCATTER = "scatter"
BARRIER = "barrier"  # moves no payload: counted, never in bandwidth
OTHER = "other"  # a collective kind_of could not name
# Every kind a trace or DeepSpeed's comms logger is mapped to (measure/overlap.py kind_of).
COLLECTIVE_KINDS: tuple[str, ...] = (
    ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, REDUCE, ALL_TO_ALL, SEND_RECV, GATHER, SCATTER,
    BARRIER, OTHER,
)
# The collectives calibrate benchmarks (busbw_gbps_<kind> curves of a profile), in this order.
CALIBRATED_COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)


def busbw_factor(kind: str, group_size: int) -> float:
    """busbw / algbw of one collective over `group_size` ranks (nccl-tests doc/PERFORMANCE.md):
    all_reduce 2(n-1)/n; all_gather, reduce_scatter and all_to_all (n-1)/n, with S the full buffer
    (the gathered output, the unscattered input); broadcast, reduce and send/recv 1. The factor turns
    a time into the bandwidth each rank's link carries, comparable across group sizes. Any other kind
    (barrier, ...) counts as 1: it moves no payload, so its bus bytes stay 0 rather than NaN, which
    would poison a per-kind sum. ``group_size`` is the collective's OWN group (tp for a
    tensor-parallel all_reduce, dp for gradient reduction), never the world size."""
    n = group_size
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if kind == ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if kind in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
        return (n - 1) / n
    return 1.0


class EnsembleRole(str, Enum):
    """A row's part in an ensemble comparison: the single model on all N devices, or a member."""

    single = "single"
    member = "member"


class Status(str, Enum):
    completed = "completed"
    failed = "failed"
    infeasible = "infeasible"
    timeout = "timeout"


class CollectiveStats(BaseModel):
    """One collective kind, per optimizer step, averaged over the profiled window.

    ``bus_bytes`` is the sum over calls of bytes x busbw_factor(kind, that call's group size), so
    ``busbw_gbps`` = bus_bytes / time_s stays right when one kind runs in groups of different sizes
    (tp and dp all_reduces); NaN where the calls' groups are unknown."""

    # NaN as JSON's NaN, as TrialResult writes its own: a result crosses from the trial to the
    # driver as JSON (sweep/trainable.py), and null would not read back as a float.
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")
    count: float
    bytes: float
    time_s: float
    bus_bytes: float = NAN
    algbw_gbps: float = NAN
    busbw_gbps: float = NAN


# The config columns, derived from TrialConfig (spec/trial.py): a field added there is a column here.
ConfigColumns = create_model("ConfigColumns", __config__=ConfigDict(extra="forbid"),
                             **config_columns())


class TrialResult(ConfigColumns):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    status: Status
    reason: str | None = None
    # Which rule refused an infeasible trial (scalestudy.errors.ReasonClass), the same in every command
    reason_class: str | None = None

    step_time_s: float = NAN
    step_time_p90_s: float = NAN
    tokens_per_s: float = NAN
    tokens_per_s_per_device: float = NAN
    model_tflops_per_device: float = NAN
    mfu: float = NAN
    hfu: float = NAN
    comm_time_s: float = NAN
    comm_exposed_s: float = NAN
    comm_exposed_fraction: float = NAN
    compute_time_s: float = NAN
    bubble_time_s: float = NAN
    comm: dict[str, CollectiveStats] = Field(default_factory=dict)
    step_time_s_profiled: float = NAN
    bubble_fraction: float = NAN
    stage_imbalance: float = NAN
    # Per pipeline stage (pp > 1), in stage order: stage, blocks, forward_s, backward_s, busy_s and
    # p2p_wait_s per step, bubble_fraction, peak_memory_gib (train/pipeline_summary.StageReading).
    pipeline_stages: list[dict[str, Any]] = Field(default_factory=list)
    device_utilization_pct: float = NAN
    cpu_utilization_cores: float = NAN
    peak_memory_gib: float = NAN
    peak_memory_reserved_gib: float = NAN
    device_memory_used_gib: float = NAN
    memory_source: str | None = None
    power_w: float = NAN
    energy_j: float = NAN
    energy_per_token_j: float = NAN
    tokens_per_j: float = NAN
    energy_source: str = "none"
    power_w_estimated: float = NAN
    energy_j_estimated: float = NAN
    energy_per_token_j_estimated: float = NAN
    tokens_per_j_estimated: float = NAN
    loss_first: float = NAN
    loss_last: float = NAN
    wall_time_s: float = NAN
    time_to_first_step_s: float = NAN
    restarts: int = 0
    time_lost_s: float = NAN  # measured trials only (0 when nothing was lost)
    # Every segment of an elastic trial that was resized (train/segments.py), in order: world_size,
    # grad_accum, start_step, warmup_steps, steps (timed), step_time_median_s, tokens_per_s; empty
    # when the trial ran at one size. Throughput columns are the final segment's.
    resizes: list[dict[str, Any]] = Field(default_factory=list)
    step_times_s: list[float] = Field(default_factory=list)
    losses: list[float] = Field(default_factory=list)
    missing: dict[str, str] = Field(default_factory=dict)  # metric -> why it is NaN
    # A prediction's figures that its profile did not calibrate (perfmodel/coverage.py), one line
    # each; empty for a measured row and for a prediction on calibrated figures only.
    uncalibrated: list[str] = Field(default_factory=list)
    extra: dict[str, Any] = Field(default_factory=dict)  # backend-specific details (e.g. ds config)
    # One large model or several smaller ones (issue 36): None / NaN outside an ensemble study.
    ensemble_id: str | None = None
    ensemble_role: EnsembleRole | None = None
    ensemble_k: int | None = None
    member_index: int | None = None
    token_budget: float = NAN
    timed_window_start_epoch_s: float = NAN
    timed_window_end_epoch_s: float = NAN
    energy_attributed_j: float = NAN
    model_flops_per_j: float = NAN
    device_s_per_token: float = NAN
    time_to_budget_s: float = NAN
    energy_to_budget_j: float = NAN
    ensemble_overlap_fraction: float = NAN
    ensemble_tokens_per_s: float = NAN
    ensemble_tokens_per_j: float = NAN
    ensemble_model_flops_per_j: float = NAN
    ensemble_model_flops_per_device_s: float = NAN
    ensemble_device_s_per_token: float = NAN
    ensemble_time_to_budget_s: float = NAN
    ensemble_energy_to_budget_j: float = NAN
    ensemble_energy_source: str | None = None

    @classmethod
    def from_config(cls, cfg: TrialConfig, status: Status, **fields: Any) -> TrialResult:
        return cls(**{**cfg.config_fields(), **fields}, status=status)

    @classmethod
    def refused(cls, planned: PlannedTrial, **fields: Any) -> TrialResult:
        """The row of a planned trial that its verdict refused: its reason, the rule's class and,
        when the plan made one (plan.PlanEntry.memory), the memory estimate as the peak."""
        memory = getattr(planned, "memory", None)
        if memory is not None:
            fields = {PEAK_MEMORY_GIB: memory.total_gib, "memory_source": "model", **fields}
        rc = planned.reason_class
        return cls.from_config(planned.config, Status.infeasible, reason=planned.reason,
                               reason_class=rc.value if rc is not None else None, **fields)

    def scalar_metrics(self) -> dict[str, float]:
        """Finite scalar metrics plus flattened per-collective ones (`comm/<kind>/<stat>`)."""
        out = {m: getattr(self, m) for m in SCALAR_METRICS if math.isfinite(getattr(self, m))}
        out.update({m: v for m in ENSEMBLE_METRICS  # None outside an ensemble study
                    if (v := getattr(self, m)) is not None and math.isfinite(v)})
        for kind, stats in self.comm.items():
            for stat, value in stats.model_dump().items():
                if math.isfinite(value):
                    out[f"comm/{kind}/{stat}"] = value
        for stage in self.pipeline_stages:  # `stage/<i>/<figure>`, as MLflow metrics
            for stat, value in stage.items():
                if stat != "stage" and isinstance(value, (int, float)) and math.isfinite(value):
                    out[f"stage/{stage['stage']}/{stat}"] = float(value)
        return out
