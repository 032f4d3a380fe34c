"""`scalestudy plan`: the space of layouts for one model on N devices, every point judged by the one
planner (plan_spec) and predicted by the model, ranked by an objective with an uncertainty band.

The space is a study spec built in memory (backend simulate, every free axis a list), so a layout
the planner ranks is exactly a trial `sweep` would run or refuse, with the same memory rule. Its
plan.yaml is that spec narrowed to the layouts chosen. Pure Python: no torch, no ray.
"""

from __future__ import annotations

import math
from collections import Counter
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from scalestudy import metrics as M
from scalestudy.errors import SpecError
from scalestudy.tables import fmt
from scalestudy.metrics import Status, TrialResult
from scalestudy.perfmodel.predict import predict_many
from scalestudy.plan.build import plan_spec
from scalestudy.plan.entry import PlanEntry
from scalestudy.spec import catalog
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import StudySpec

PLAN_COLUMNS = ["rank", "trial", "family", "dp", "tp", "pp", "zero_stage", "micro_batch",
                "grad_accum", "activation_checkpointing", "score", "low", "high", M.MFU,
                M.PEAK_MEMORY_GIB]
# Axes `--space` may free; the others stay at their single value. The default space frees the
# first five; the layout options of issue 35 are asked for by name: cp (context-parallel degree),
# sp (Megatron sequence parallelism, with tp > 1), gather_granularity (ZeRO-3 gathers per module
# or per block), selective (selective recomputation beside none and full; with recompute).
DEFAULT_SPACE = ("zero", "tp", "pp", "micro_batch", "recompute")
FREE_AXES = (*DEFAULT_SPACE, "cp", "sp", "gather_granularity", "selective")
MAX_LAYOUTS = 100_000


class Objective(str, Enum):
    tokens_per_s = M.TOKENS_PER_S
    tokens_per_joule = "tokens_per_joule"
    usd_per_token = "usd_per_token"


class PlanRequest(BaseModel):
    """What the user asks: a model on N devices of one hardware, and which axes are free."""

    model_config = ConfigDict(extra="forbid")
    model: str
    hardware: str
    devices: PositiveInt
    global_batch: PositiveInt | None = None  # sequences per step; None: 1,024 or what N needs
    seq_len: PositiveInt | None = None       # None: min(4,096, the model's max)
    precision: str = "auto"
    mem_cap_gib: float | None = Field(default=None, gt=0)
    objective: Objective = Objective.tokens_per_s
    space: tuple[str, ...] = DEFAULT_SPACE
    usd_per_device_hour: float | None = Field(default=None, gt=0)


def _powers(limit: int, start: int = 1) -> list[int]:
    out, v = [], start
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def space_spec(req: PlanRequest, profile: HardwareProfile | None = None,
               **settings: Any) -> StudySpec:
    """The in-memory study whose grid is the space (a SpecError names a bad request's field).
    `profile` replaces the catalogue's hardware (a calibrated or refitted one, same name);
    `settings` are further spec fields (backend, steps, tracking) for measuring the space."""
    unknown = set(req.space) - set(FREE_AXES)
    if unknown:
        raise SpecError("--space", ",".join(sorted(unknown)), f"choose from {', '.join(FREE_AXES)}")
    dims = catalog.get_model(req.model) if req.model in catalog.model_names() else None
    if dims is None:
        raise SpecError("MODEL", req.model, f"choose one of {', '.join(catalog.model_names())}")
    hw: Any = profile if profile is not None else req.hardware
    if profile is not None:
        per_node = profile.gpus_per_node
    else:
        per_node = catalog.get_hardware(hw).gpus_per_node if hw in catalog.hardware_names() else 8
    n = req.devices
    seq = req.seq_len or min(4096, dims.max_seq_len)
    gb = req.global_batch or max(1024, _ceil_pow2(n))
    free = set(req.space)
    data: dict[str, Any] = {
        "name": f"plan-{req.model}-{n}", "model": req.model, "hardware": hw,
        "backend": "simulate", "seq_len": seq, "precision": req.precision, "world_size": n,
        "global_batch": gb,
        "zero_stage": [0, 1, 2, 3] if "zero" in free else [1],
        "tp": [t for t in _powers(per_node) if n % t == 0] if "tp" in free else [1],
        "pp": [p for p in _powers(min(dims.num_layers, n)) if dims.num_layers % p == 0]
        if "pp" in free else [1],
        "micro_batch": [b for b in _powers(min(gb, 32))] if "micro_batch" in free else [1],
        "activation_checkpointing": _recompute(free),
        **_layout_options(free, n, per_node),
        "tracking": {"experiment": f"plan-{req.model}"},
    }
    return validate_spec({**data, **settings})


def _recompute(free: set[str]) -> list:
    values: list = [False]
    if "selective" in free:
        values.append("selective")
    if "recompute" in free or "selective" in free:
        values.append(True)
    return values


def _layout_options(free: set[str], n: int, per_node: int) -> dict[str, list]:
    """The spec's layout options the space frees. A combination that cannot be (sequence
    parallelism without tp, block gathers below ZeRO-3, a cp that does not divide what tp x pp
    leaves) is refused per layout by the planner, with its reason, as a sweep would refuse it."""
    out: dict[str, list] = {}
    if "cp" in free:  # inside a node, where ring attention's p2p runs over NVLink
        out["cp"] = [c for c in _powers(min(per_node, n)) if n % c == 0]
    if "sp" in free:
        out["sequence_parallel"] = [False, True]
    if "gather_granularity" in free:
        out["gather_granularity"] = ["module", "block"]
    return out


def _ceil_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class RankedLayout(BaseModel):
    """One layout of the space: the plan's verdict, the model's prediction and its score."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    entry: PlanEntry
    result: TrialResult
    family: str
    score: float          # the objective, larger is better (usd_per_token is negated)
    low: float            # the score's band from the model's validation residuals (family)
    high: float
    factor: float = 1.0   # measured over predicted for the layout's family (plan/refit.py)

    @property
    def feasible(self) -> bool:
        return self.result.status is Status.completed


def family_of(tp: int, pp: int, zero_stage: int) -> str:
    """The layout families the study compares: sharded data parallelism, plain data parallelism,
    tensor parallelism, pipelines (with or without tensor parallelism)."""
    if pp > 1:
        return "pipeline+tp" if tp > 1 else "pipeline"
    if tp > 1:
        return "tensor"
    return "zero3" if zero_stage == 3 else "data"


# Relative error of the model's throughput per family, out of sample: the published validation rows
# (tests/validation/test_published.py, leave-one-source-out, 106 rows from 9 sources, known misses
# included) split by the family of each row's layout, mean absolute relative error. A family with
# fewer than MIN_FAMILY_ROWS rows takes the overall figure. tests/validation/test_plan_bands.py
# recomputes them and fails when they drift from the validation.
MIN_FAMILY_ROWS = 5
FAMILY_ERROR = {"zero3": 0.208, "pipeline+tp": 0.138, "tensor": 0.041, "data": 0.075}
OVERALL_ERROR = 0.155  # all 106 rows; pipeline (1 row) takes it


def band_error(family: str, errors: dict[str, float] | None = None) -> float:
    """The relative error a family's band spans: `errors`' figure, else the published one."""
    if errors:
        return errors.get(family, errors.get("*", OVERALL_ERROR))
    return FAMILY_ERROR.get(family, OVERALL_ERROR)


def score_of(result: TrialResult, req: PlanRequest, price: float | None) -> float:
    """The objective of a result, larger is better, predicted or measured alike: energy measured
    where it was (tokens_per_j), else the model's estimate of it."""
    if result.status is not Status.completed:
        return -math.inf
    if req.objective is Objective.tokens_per_s:
        return result.tokens_per_s
    if req.objective is Objective.tokens_per_joule:
        measured = result.tokens_per_j
        return measured if math.isfinite(measured) else result.tokens_per_j_estimated
    hourly = price * result.world_size
    return -hourly / 3600.0 / result.tokens_per_s  # USD per token, negated: larger is better


def rank(req: PlanRequest, profile: HardwareProfile | None = None,
         errors: dict[str, float] | None = None, **settings: Any) -> list[RankedLayout]:
    """Every layout of the space, best first by the objective (infeasible last). `errors` replaces
    the published family errors of the bands (family -> relative error; "*" for every family), as
    plan/rounds.py does once the model is refitted on this machine's measurements."""
    spec = space_spec(req, profile, **settings)
    entries = plan_spec(spec)
    if len(entries) > MAX_LAYOUTS:
        raise SpecError("--space", ",".join(req.space), f"{len(entries):,} layouts exceed "
                        f"{MAX_LAYOUTS:,}; free fewer axes")
    if req.mem_cap_gib is not None:
        entries = [_capped(e, req.mem_cap_gib) for e in entries]
    price = price_of(req)
    ranked = []
    for e, r in zip(entries, predict_many(entries)):
        fam = family_of(r.tp, r.pp, r.zero_stage)
        s = score_of(r, req, price)
        err = band_error(fam, errors)
        band = (s * (1 - err), s * (1 + err)) if s > 0 else (s * (1 + err), s * (1 - err))
        ranked.append(RankedLayout(entry=e, result=r, family=fam, score=s, low=min(band),
                                   high=max(band)))
    ranked.sort(key=lambda x: -x.score)
    return ranked


def _capped(entry: PlanEntry, cap_gib: float) -> PlanEntry:
    """The entry judged against a device of `cap_gib` (the memory rule, with its margin)."""
    from scalestudy.perfmodel.memory import memory_refusal

    if not entry.feasible or entry.memory is None:
        return entry
    reason = memory_refusal(entry.memory.total_gib, min(cap_gib, entry.memory.device_gib))
    if reason is None:
        return entry
    from scalestudy.errors import ReasonClass

    return entry.model_copy(update={"reason": f"{reason} (--mem-cap {cap_gib:g} GiB)",
                                    "reason_class": ReasonClass.memory})


def price_of(req: PlanRequest) -> float | None:
    if req.objective is not Objective.usd_per_token:
        return None
    price = req.usd_per_device_hour or catalog.get_hardware(req.hardware).usd_per_device_hour
    if price is None:
        raise SpecError("--usd-per-device-hour", None, f"hardware {req.hardware} has no price "
                        "in the catalogue; give one")
    return price


def refusals(ranked: list[RankedLayout], n: int = 5) -> list[tuple[str, int, str]]:
    """(reason class, how many layouts, one example reason) of the refused, commonest first."""
    refused = [r for r in ranked if not r.feasible]
    counts = Counter(r.result.reason_class or "?" for r in refused)
    example = {}
    for r in refused:
        example.setdefault(r.result.reason_class or "?", f"{r.entry.config.run_name}: {r.result.reason}")
    return [(c, k, example[c]) for c, k in counts.most_common(n)]


def table_rows(ranked: list[RankedLayout]) -> list[dict[str, Any]]:
    """Rows of the ranked table (feasible layouts), as the CLI prints them."""
    rows = []
    for i, r in enumerate([x for x in ranked if x.feasible], 1):
        res = r.result
        rows.append({"rank": i, "trial": r.entry.config.run_name, "family": r.family,
                     "zero_stage": res.zero_stage, "tp": res.tp, "pp": res.pp, "dp": res.dp,
                     "micro_batch": res.micro_batch, "grad_accum": res.grad_accum,
                     "activation_checkpointing": res.activation_checkpointing,
                     M.TOKENS_PER_S: res.tokens_per_s, "score": r.score, "low": r.low,
                     "high": r.high, "factor": r.factor, M.MFU: res.mfu,
                     M.PEAK_MEMORY_GIB: res.peak_memory_gib,
                     "status": "predicted", "uncalibrated": res.uncalibrated})
    return rows


def families_line(rows: list[dict[str, Any]]) -> str:
    """The best row of each family (rows best first, as table_rows gives them), in one line."""
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        best.setdefault(r["family"], r)
    return "best of each family: " + "; ".join(
        f"{f} #{r['rank']} {r['trial']} ({fmt(r['score'])})" for f, r in best.items())
