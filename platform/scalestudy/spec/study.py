"""The study spec (YAML contract of every command) and its expansion into trials."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from scalestudy.parallel.degrees import Degrees, check_model_split, derive_degrees
from scalestudy.spec import catalog
from scalestudy.spec.catalog import HardwareProfile, ModelDims, Precision
from scalestudy.spec.errors import InfeasibleTrial


class Backend(str, Enum):
    measure = "measure"
    simulate = "simulate"


class SearchAlgorithm(str, Enum):
    grid = "grid"
    random = "random"
    optuna = "optuna"


class Steps(BaseModel):
    model_config = ConfigDict(extra="forbid")
    warmup: int = Field(3, ge=0)
    measure: PositiveInt = 10
    profile: int = Field(3, ge=0)  # profiled window after the timed one (communication, overlap)


class FaultTolerance(BaseModel):
    """Ray Train restarts of a trial's worker group, resuming from its last DeepSpeed checkpoint."""

    model_config = ConfigDict(extra="forbid")
    max_failures: int = Field(0, ge=0)  # FailureConfig(max_failures): worker-group restarts per trial
    # Steps between checkpoints once max_failures > 0 or the trial is elastic (each costs a
    # checkpoint write and a ray.train.report, outside the timed steps).
    checkpoint_every: PositiveInt = 5


class Elastic(BaseModel):
    """Ray Train elastic scaling: the trial runs with any world size in [min_workers, max_workers]
    that the cluster holds, keeping the global batch by recomputing gradient accumulation."""

    model_config = ConfigDict(extra="forbid")
    min_workers: PositiveInt
    max_workers: PositiveInt
    # How often a running trial checks whether the cluster could hold more workers (Ray Train's
    # elastic_resize_monitor_interval_s); growing restarts the group from the last checkpoint.
    resize_check_s: PositiveFloat = 60.0

    @model_validator(mode="after")
    def _ordered(self) -> Elastic:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers {self.min_workers} exceeds max_workers {self.max_workers}")
        return self


class Search(BaseModel):
    model_config = ConfigDict(extra="forbid")
    algorithm: SearchAlgorithm = SearchAlgorithm.grid
    num_samples: PositiveInt | None = None
    metric: str = "tokens_per_s_per_device"
    mode: Literal["max", "min"] = "max"


class Tracking(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mlflow_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    experiment: str | None = None  # None: the study name


class NamedModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    dims: ModelDims


def _positive(v: int) -> int:
    if v <= 0:
        raise ValueError("must be a positive integer")
    return v


def _zero_stage(v: int) -> int:
    if v not in (0, 1, 2, 3):
        raise ValueError("must be one of 0, 1, 2, 3 (DeepSpeed ZeRO stage)")
    return v


# Per-element checks, so an error names the offending list element (zero_stage[1]) and its value.
PosInt = Annotated[int, AfterValidator(_positive)]
ZeroStage = Annotated[int, AfterValidator(_zero_stage)]


def _as_list(v: Any) -> list:
    """Sweepable axes take a scalar or a list; both are stored as a non-empty list."""
    if isinstance(v, list):
        if not v:
            raise ValueError("an axis list must not be empty")
        return v
    return [v]


class StudySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # First, so the hardware validator can resolve profile paths relative to the spec file.
    spec_dir: Path | None = Field(default=None, exclude=True)
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    model: list[NamedModel]
    hardware: list[HardwareProfile]
    backend: Backend = Backend.measure
    seq_len: list[PosInt] = [128]
    precision: list[Precision] = [Precision.bf16]
    world_size: list[PosInt] = [1]
    zero_stage: list[ZeroStage] = [0]
    tp: list[PosInt] = [1]
    pp: list[PosInt] = [1]
    micro_batch: list[PosInt] = [1]
    global_batch: list[PosInt | None] = [None]
    activation_checkpointing: list[bool] = [False]
    steps: Steps = Steps()
    search: Search = Search()
    tracking: Tracking = Tracking()
    seed: int = 0
    learning_rate: PositiveFloat = 1e-3
    trial_timeout_s: PositiveFloat = 3600.0
    fault_tolerance: FaultTolerance = FaultTolerance()
    elastic: Elastic | None = None

    @field_validator(
        "seq_len", "precision", "world_size", "zero_stage", "tp", "pp", "micro_batch",
        "global_batch", "activation_checkpointing", mode="before",
    )
    @classmethod
    def _listify(cls, v: Any) -> list:
        return _as_list(v)

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_models(cls, v: list) -> list[NamedModel]:
        return [_resolve_model(x) for x in _as_list(v)]

    @field_validator("hardware", mode="before")
    @classmethod
    def _resolve_hardware(cls, v: list, info) -> list[HardwareProfile]:
        spec_dir = info.data.get("spec_dir")
        return [_resolve_hardware(x, spec_dir) for x in _as_list(v)]

    @property
    def experiment(self) -> str:
        return self.tracking.experiment or self.name


def _resolve_model(x: Any) -> NamedModel:
    if isinstance(x, NamedModel):
        return x
    if isinstance(x, str):
        if x not in catalog.model_names():
            raise ValueError(
                f"unknown model; choose one of {', '.join(catalog.model_names())}, "
                "or give a mapping of dims (hidden_size, num_layers, num_heads, ...)"
            )
        return NamedModel(name=x, dims=catalog.get_model(x))
    if isinstance(x, dict) and "dims" in x:
        return NamedModel(**x)
    if isinstance(x, dict):
        try:
            dims = ModelDims(**x)
        except ValidationError as err:
            e = err.errors()[0]
            raise ValueError(f"model dims: {'.'.join(map(str, e['loc']))}: {e['msg']}") from None
        name = f"custom-{dims.architecture}-h{dims.hidden_size}-l{dims.num_layers}"
        return NamedModel(name=name, dims=dims)
    raise ValueError("must be a catalogue name or a mapping of dims")


def _resolve_hardware(x: Any, spec_dir: Path | None) -> HardwareProfile:
    if isinstance(x, HardwareProfile):
        return x
    if not isinstance(x, str):
        raise ValueError("must be a catalogue name or a path to a hardware profile YAML")
    if x in catalog.hardware_names():
        return catalog.get_hardware(x)
    candidates = [Path(x)] + ([spec_dir / x] if spec_dir else [])
    for path in candidates:
        if path.is_file():
            try:
                return catalog.load_hardware_file(path)
            except ValidationError as err:
                e = err.errors()[0]
                raise ValueError(
                    f"profile {path}: {'.'.join(map(str, e['loc']))}: {e['msg']}"
                ) from None
    raise ValueError(
        f"unknown hardware; choose one of {', '.join(catalog.hardware_names())}, "
        "or a path to a profile written by `scalestudy calibrate`"
    )


class TrialConfig(BaseModel):
    """One point of a study: the config columns of every TrialResult."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    study: str
    backend: Backend
    model: str
    hardware: str
    world_size: int
    nodes: int
    dp: int
    tp: int
    pp: int
    zero_stage: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    precision: Precision
    activation_checkpointing: bool
    steps: Steps
    seed: int
    learning_rate: float
    trial_timeout_s: float
    fault_tolerance: FaultTolerance = FaultTolerance()
    elastic: Elastic | None = None
    model_dims: ModelDims
    hardware_profile: HardwareProfile

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def trial_id(self) -> str:
        """Stable hash of everything that defines the trial (not the study name or backend)."""
        # How a trial survives faults does not change what it measures; elastic bounds do.
        payload = self.model_dump(mode="json", exclude={"study", "fault_tolerance"})
        if self.elastic is None:
            payload.pop("elastic")
        blob = json.dumps(payload, sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()[:12]

    @property
    def run_name(self) -> str:
        return trial_name(self)

    def config_fields(self) -> dict[str, Any]:
        """Flat, scalar config columns (what the ledger, MLflow params and tables show)."""
        d = self.model_dump(mode="json", exclude={"model_dims", "hardware_profile", "steps",
                                                  "fault_tolerance", "elastic"})
        d["trial_id"] = self.trial_id
        d.update({f"steps_{k}": v for k, v in self.steps.model_dump().items()})
        return d


def trial_name(t: Any) -> str:
    """Short human name of a trial (`ws2-tp1-z3-mb2`), for a TrialConfig or a TrialResult."""
    name = f"ws{t.world_size}-tp{t.tp}" + (f"-pp{t.pp}" if t.pp > 1 else "")
    name += f"-z{t.zero_stage}-mb{t.micro_batch}"
    return name + (f"-ga{t.grad_accum}" if t.grad_accum > 1 else "")


class PlannedTrial(BaseModel):
    """A trial as expanded from the grid: its config, and why it cannot run when it cannot.

    Infeasible points keep a config (derived values rounded down) so their results share the
    schema of every other trial."""

    model_config = ConfigDict(frozen=True)
    axes: dict[str, Any]
    config: TrialConfig
    reason: str | None = None

    @property
    def feasible(self) -> bool:
        return self.reason is None


AXES = (
    "model", "hardware", "seq_len", "precision", "world_size", "zero_stage", "tp", "pp",
    "micro_batch", "global_batch", "activation_checkpointing",
)


def _lenient_degrees(point: dict[str, Any]) -> Degrees:
    """Degrees of a point that may not divide (floor division), for recording infeasible trials."""
    ws, tp, pp, mb = point["world_size"], point["tp"], point["pp"], point["micro_batch"]
    dp = max(ws // (tp * pp), 1)
    gb = point["global_batch"] or mb * dp
    return Degrees(ws, dp, tp, pp, mb, max(gb // (mb * dp), 1), gb)


def resolve_point(spec: StudySpec, axes: dict[str, Any]) -> dict[str, Any]:
    """Axis values as shown/sampled (names, plain values) -> the spec's typed objects."""
    point = dict(axes)
    point["model"] = next(m for m in spec.model if m.name == axes["model"])
    point["hardware"] = next(h for h in spec.hardware if h.name == axes["hardware"])
    point["precision"] = Precision(axes["precision"])
    return point


def build_trial(spec: StudySpec, point: dict[str, Any]) -> PlannedTrial:
    """One grid point (typed, see resolve_point) -> PlannedTrial with its infeasibility reason."""
    shown = {
        k: (v.name if isinstance(v, (NamedModel, HardwareProfile)) else
            v.value if isinstance(v, Enum) else v)
        for k, v in point.items()
    }
    try:
        deg = derive_degrees(
            point["world_size"], point["tp"], point["pp"], point["micro_batch"],
            point["global_batch"],
        )
        reason = None
    except InfeasibleTrial as err:
        deg, reason = _lenient_degrees(point), str(err)
    cfg = _trial_config(spec, point, deg)
    if reason is None:
        try:
            check_trial(spec, point, deg)
        except InfeasibleTrial as err:
            reason = str(err)
    return PlannedTrial(axes=shown, config=cfg, reason=reason)


def check_trial(spec: StudySpec, point: dict[str, Any], deg: Degrees) -> None:
    model: NamedModel = point["model"]
    hw: HardwareProfile = point["hardware"]
    check_model_split(model.dims, deg.tp, deg.pp)
    precision: Precision = point["precision"]
    if precision not in hw.peak_tflops:
        raise InfeasibleTrial(f"hardware {hw.name} has no {precision.value} peak figure")
    if hw.kind == "cpu" and precision is Precision.fp16:
        raise InfeasibleTrial("fp16 training needs a GPU; use bf16 or fp32 on CPU")
    if model.dims.architecture == "gpt" and point["seq_len"] > model.dims.max_seq_len:
        raise InfeasibleTrial(
            f"seq_len {point['seq_len']} exceeds the learned positions ({model.dims.max_seq_len})"
        )
    if spec.backend is Backend.measure and deg.pp > 1:
        raise InfeasibleTrial("pp > 1 is not supported by the measure backend (use simulate)")
    if spec.elastic is not None:
        check_elastic(spec.elastic, deg)


def check_elastic(el: Elastic, deg: Degrees) -> None:
    """Every world size the trial may run at must keep the global batch exactly."""
    if not el.min_workers <= deg.world_size <= el.max_workers:
        raise InfeasibleTrial(f"world_size {deg.world_size} outside elastic "
                              f"[{el.min_workers}, {el.max_workers}]")
    for w in range(el.min_workers, el.max_workers + 1):
        try:
            derive_degrees(w, deg.tp, deg.pp, deg.micro_batch, deg.global_batch)
        except InfeasibleTrial as err:
            raise InfeasibleTrial(
                f"elastic world size {w} cannot keep the global batch: {err}; narrow "
                "elastic.min_workers/max_workers or choose a global_batch every size divides"
            ) from None


def _trial_config(spec: StudySpec, point: dict[str, Any], deg: Degrees) -> TrialConfig:
    model: NamedModel = point["model"]
    hw: HardwareProfile = point["hardware"]
    return TrialConfig(
        study=spec.name,
        backend=spec.backend,
        model=model.name,
        hardware=hw.name,
        world_size=deg.world_size,
        nodes=math.ceil(deg.world_size / hw.gpus_per_node),
        dp=deg.dp,
        tp=deg.tp,
        pp=deg.pp,
        zero_stage=point["zero_stage"],
        micro_batch=deg.micro_batch,
        grad_accum=deg.grad_accum,
        global_batch=deg.global_batch,
        seq_len=point["seq_len"],
        precision=point["precision"],
        activation_checkpointing=point["activation_checkpointing"],
        steps=spec.steps,
        seed=spec.seed,
        learning_rate=spec.learning_rate,
        trial_timeout_s=spec.trial_timeout_s,
        fault_tolerance=spec.fault_tolerance,
        elastic=spec.elastic,
        model_dims=model.dims,
        hardware_profile=hw,
    )


def expand(spec: StudySpec) -> list[PlannedTrial]:
    """The full grid in a fixed order (axes in AXES order, values in spec order)."""
    return [
        build_trial(spec, dict(zip(AXES, values)))
        for values in itertools.product(*(getattr(spec, a) for a in AXES))
    ]
