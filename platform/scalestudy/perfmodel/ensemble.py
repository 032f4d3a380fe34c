"""One large model or several smaller ones at once: the comparison's arithmetic, for measured and
predicted trials alike, its prediction from the model's power terms, and where it crosses over.

A group is what runs together: the single model on all N devices (a group of one), or k members on
N / k devices each. From each trial of a group (its throughput, its model FLOPs rate, its energy):
  * energy per token is the trial's own: measured by NVML (its GPUs alone), or by RAPL (the whole
    machine: attributed to each trial by its share of the devices the group runs on), or modelled
    (perfmodel/power.py: idle + (TDP - idle) x (busy + comm_power_fraction x waiting), GPU only);
  * the group's aggregate tokens/s is the members' sum, its tokens (model FLOPs) per joule their
    sums over their summed power, its time to the token budget the slowest member's and its energy
    to it the sum: every model, the single and each member, trains on token_budget tokens;
  * measured only: the members' overlap, the time all of them were in their timed windows over the
    shortest window (1 when they ran exactly together).
Model FLOPs per joule (6N + attention, perfmodel/flops.py) is the fair measure across model sizes:
a 7B member processes ten times the tokens of a 70B model for the same work. Where a trial has no
energy figure, NaN with the reason; the fallback is named for what it is, model FLOPs per
device-second (devices x seconds, not joules).
Pure Python: no torch, no ray.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scalestudy import metrics as M
from scalestudy.metrics import EnsembleRole, Status, TrialResult
from scalestudy.spec.trial import PlannedTrial

NAN = math.nan
MODEL_SOURCE = "model"  # energy_source of a predicted trial (perfmodel/predict.py)
NOT_CONCURRENT_K1 = "a group of one: nothing runs beside it"
PREDICTED_OVERLAP = "predicted: the members are modelled as running together throughout"
GROUP_METRICS = (M.ENSEMBLE_OVERLAP_FRACTION, M.ENSEMBLE_TOKENS_PER_S, M.ENSEMBLE_TOKENS_PER_J,
                 M.ENSEMBLE_MODEL_FLOPS_PER_J, M.ENSEMBLE_MODEL_FLOPS_PER_DEVICE_S,
                 M.ENSEMBLE_DEVICE_S_PER_TOKEN, M.ENSEMBLE_TIME_TO_BUDGET_S,
                 M.ENSEMBLE_ENERGY_TO_BUDGET_J)


def energy_per_token(r: TrialResult, group_devices: int) -> tuple[float, float, str | None]:
    """(joules per token attributed to this trial, its share of its meter's energy, why NaN)."""
    if r.energy_source == MODEL_SOURCE:
        e = r.energy_per_token_j_estimated
        return e, 1.0, None if math.isfinite(e) else "the power model gave no energy"
    if not math.isfinite(r.energy_per_token_j):
        why = r.missing.get(M.ENERGY_J) or f"no energy measured (source {r.energy_source})"
        return NAN, NAN, why
    # RAPL meters the whole machine, seen by every trial of the group: each takes its device share.
    share = r.world_size / group_devices if r.energy_source == "rapl" else 1.0
    return r.energy_per_token_j * share, share, None


def model_flops_per_s(r: TrialResult) -> float:
    """The trial's model FLOPs per second over all its devices (MFU's numerator)."""
    return r.model_tflops_per_device * 1e12 * r.world_size


def windows_overlap(windows: Sequence[tuple[float, float]]) -> float:
    """Time every window is open / the shortest window: 1 when they all ran exactly together."""
    start, end = max(w[0] for w in windows), min(w[1] for w in windows)
    shortest = min(w[1] - w[0] for w in windows)
    return max(0.0, end - start) / shortest if shortest > 0 else NAN


def _row_fields(r: TrialResult, devices: int, budget: float) -> tuple[dict, dict[str, str]]:
    e, share, why = energy_per_token(r, devices)
    tps = r.tokens_per_s
    window_j = r.energy_j_estimated if r.energy_source == MODEL_SOURCE else r.energy_j
    fields = {M.DEVICE_S_PER_TOKEN: r.world_size / tps, M.TIME_TO_BUDGET_S: budget / tps,
              M.ENERGY_TO_BUDGET_J: budget * e,
              M.MODEL_FLOPS_PER_J: model_flops_per_s(r) / (tps * e),
              M.ENERGY_ATTRIBUTED_J: window_j * share}
    missing = {m: why for m in (M.ENERGY_TO_BUDGET_J, M.MODEL_FLOPS_PER_J, M.ENERGY_ATTRIBUTED_J)
               if why}
    return fields, missing


def _group_fields(group: Sequence[TrialResult], energies: list[float], reasons: list[str | None],
                  devices: int, budget: float) -> tuple[dict, dict[str, str]]:
    tps = [r.tokens_per_s for r in group]
    power = sum(t * e for t, e in zip(tps, energies))
    flops = sum(model_flops_per_s(r) for r in group)
    sources = {r.energy_source for r in group}
    fields = {M.ENSEMBLE_TOKENS_PER_S: sum(tps), M.ENSEMBLE_TOKENS_PER_J: sum(tps) / power,
              M.ENSEMBLE_MODEL_FLOPS_PER_J: flops / power,
              M.ENSEMBLE_MODEL_FLOPS_PER_DEVICE_S: flops / devices,
              M.ENSEMBLE_DEVICE_S_PER_TOKEN: devices / sum(tps),
              M.ENSEMBLE_TIME_TO_BUDGET_S: max(budget / t for t in tps),
              M.ENSEMBLE_ENERGY_TO_BUDGET_J: budget * sum(energies),
              M.ENSEMBLE_ENERGY_SOURCE: sources.pop() if len(sources) == 1 else "mixed"}
    why = next((w for w in reasons if w), None)
    missing = {m: why for m in (M.ENSEMBLE_TOKENS_PER_J, M.ENSEMBLE_MODEL_FLOPS_PER_J,
                                M.ENSEMBLE_ENERGY_TO_BUDGET_J) if why}
    return fields, missing


def _overlap(group: Sequence[TrialResult]) -> tuple[float, str | None]:
    if len(group) == 1:
        return NAN, NOT_CONCURRENT_K1
    if all(r.energy_source == MODEL_SOURCE for r in group):
        return NAN, PREDICTED_OVERLAP
    windows = [(r.timed_window_start_epoch_s, r.timed_window_end_epoch_s) for r in group]
    if not all(math.isfinite(a) and math.isfinite(b) for a, b in windows):
        return NAN, "a member's timed window was not recorded"
    return windows_overlap(windows), None


def compare(group: Sequence[TrialResult]) -> list[TrialResult]:
    """The group's trials (tagged: plan/ensemble.py Slot.tag) with the comparison's per-trial and
    per-group figures; a group with a trial that did not complete has no aggregate (NaN, why)."""
    devices = sum(r.world_size for r in group)
    budget = group[0].token_budget
    failed = [r for r in group if r.status is not Status.completed]
    if failed:
        why = (f"member {failed[0].member_index} of the group did not complete "
               f"({failed[0].status.value}: {failed[0].reason})")
        return [r.model_copy(update={"missing": {**r.missing, **dict.fromkeys(GROUP_METRICS, why)}})
                for r in group]
    rows = [_row_fields(r, devices, budget) for r in group]
    energies, _, reasons = zip(*(energy_per_token(r, devices) for r in group))
    agg, agg_missing = _group_fields(group, list(energies), list(reasons), devices, budget)
    overlap, why = _overlap(group)
    agg[M.ENSEMBLE_OVERLAP_FRACTION] = overlap
    if why:
        agg_missing[M.ENSEMBLE_OVERLAP_FRACTION] = why
    return [r.model_copy(update={**fields, **agg,
                                 "missing": {**r.missing, **missing, **agg_missing}})
            for r, (fields, missing) in zip(group, rows)]


def predict_group(trials: Sequence[PlannedTrial], tags: Sequence[dict]) -> list[TrialResult]:
    """A group's predicted comparison: each trial predicted (perfmodel/predict.py, its power from
    perfmodel/power.py), tagged with its place in the comparison, then compared."""
    from scalestudy.perfmodel.predict import predict_planned

    return compare([predict_planned(t).model_copy(update=dict(tag))
                    for t, tag in zip(trials, tags)])


@dataclass(frozen=True)
class Side:
    """One side of a comparison: the single model, or a group of k members (alike: one stands for
    all), with the power model's terms of one trial where the row has them."""

    model: str
    k: int
    world_size_each: int
    tokens_per_s: float  # the group's aggregate
    efficiency: float  # the comparison's metric (Crossover.metric), the group's aggregate
    time_to_budget_s: float
    energy_to_budget_j: float
    step_s: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    power_w_per_device: float  # modelled (GPU only); NaN on a measured row
    mfu: float  # model FLOPs rate / peak: with power, what model FLOPs per joule is made of

    @property
    def busy_fraction(self) -> float:
        """Share of the step the devices compute: what the power model bills at TDP."""
        return self.compute_s / self.step_s if self.step_s > 0 else NAN

    @classmethod
    def of(cls, r: TrialResult, metric: str) -> Side:
        return cls(r.model, r.ensemble_k or 1, r.world_size, r.ensemble_tokens_per_s,
                   getattr(r, metric), r.ensemble_time_to_budget_s, r.ensemble_energy_to_budget_j,
                   r.step_time_s, r.compute_time_s, r.comm_exposed_s, r.bubble_time_s,
                   r.power_w_estimated, r.mfu)


@dataclass(frozen=True)
class Crossover:
    """Where k members of one model overtake the single model on the comparison's metric: the
    smallest k whose aggregate is at least the single model's (None: no k listed does)."""

    devices: int
    metric: str  # ENSEMBLE_MODEL_FLOPS_PER_J, or ..._PER_DEVICE_S where energy is missing
    single: Side
    sides: tuple[Side, ...]  # the member model's groups, k ascending

    def ratio(self, side: Side) -> float:
        return side.efficiency / self.single.efficiency

    @property
    def k(self) -> int | None:
        return next((s.k for s in self.sides if self.ratio(s) >= 1.0), None)

    @property
    def best(self) -> Side:
        return max(self.sides, key=self.ratio)


def crossover(rows: Sequence[TrialResult], member_model: str) -> Crossover:
    """The crossover of one comparison (rows sharing an ensemble_id, compared) for one member
    model, on model FLOPs per joule where every side has it, else per device-second."""
    single = next(r for r in rows if r.ensemble_role is EnsembleRole.single)
    groups = {}
    for r in sorted(rows, key=lambda r: (r.ensemble_k or 1, r.member_index or 0)):
        if r.ensemble_role is EnsembleRole.member and r.model == member_model:
            groups.setdefault(r.ensemble_k, r)  # member 0 stands for its group
    if not groups:
        raise ValueError(f"no member of model {member_model} in the comparison")
    sides = [single, *groups.values()]
    metric = (M.ENSEMBLE_MODEL_FLOPS_PER_J
              if all(math.isfinite(r.ensemble_model_flops_per_j) for r in sides)
              else M.ENSEMBLE_MODEL_FLOPS_PER_DEVICE_S)
    return Crossover(single.world_size, metric, Side.of(single, metric),
                     tuple(Side.of(r, metric) for r in groups.values()))
