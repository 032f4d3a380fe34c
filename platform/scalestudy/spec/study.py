"""The study spec (YAML contract of every command) and its expansion into trials."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
)

from scalestudy.parallel.degrees import check_model_split, derive_degrees
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
    seq_len: list[int] = [128]
    precision: list[Precision] = [Precision.bf16]
    world_size: list[int] = [1]
    zero_stage: list[int] = [0]
    tp: list[int] = [1]
    pp: list[int] = [1]
    micro_batch: list[int] = [1]
    global_batch: list[int | None] = [None]
    activation_checkpointing: list[bool] = [False]
    steps: Steps = Steps()
    search: Search = Search()
    tracking: Tracking = Tracking()
    seed: int = 0
    learning_rate: PositiveFloat = 1e-3
    trial_timeout_s: PositiveFloat = 3600.0

    @field_validator(
        "seq_len", "precision", "world_size", "zero_stage", "tp", "pp", "micro_batch",
        "global_batch", "activation_checkpointing", mode="before",
    )
    @classmethod
    def _listify(cls, v: Any) -> list:
        return _as_list(v)

    @field_validator("seq_len", "world_size", "tp", "pp", "micro_batch", mode="after")
    @classmethod
    def _positive_ints(cls, v: list[int]) -> list[int]:
        return [_positive(x) for x in v]

    @field_validator("global_batch", mode="after")
    @classmethod
    def _positive_batch(cls, v: list[int | None]) -> list[int | None]:
        return [x if x is None else _positive(x) for x in v]

    @field_validator("zero_stage", mode="after")
    @classmethod
    def _stages(cls, v: list[int]) -> list[int]:
        return [_zero_stage(x) for x in v]

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
    model_dims: ModelDims
    hardware_profile: HardwareProfile

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def trial_id(self) -> str:
        """Stable hash of everything that defines the trial (not the study name or backend)."""
        payload = self.model_dump(mode="json", exclude={"study"})
        blob = json.dumps(payload, sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()[:12]

    @property
    def run_name(self) -> str:
        name = f"ws{self.world_size}-tp{self.tp}"
        if self.pp > 1:
            name += f"-pp{self.pp}"
        name += f"-z{self.zero_stage}-mb{self.micro_batch}"
        if self.grad_accum > 1:
            name += f"-ga{self.grad_accum}"
        return name

    def config_fields(self) -> dict[str, Any]:
        """Flat, scalar config columns (what the ledger, MLflow params and tables show)."""
        d = self.model_dump(mode="json", exclude={"model_dims", "hardware_profile", "steps"})
        d["trial_id"] = self.trial_id
        d.update({f"steps_{k}": v for k, v in self.steps.model_dump().items()})
        return d


class PlannedTrial(BaseModel):
    """A trial as expanded from the grid: either a runnable config or the reason it cannot run."""

    model_config = ConfigDict(frozen=True)
    axes: dict[str, Any]
    config: TrialConfig | None = None
    reason: str | None = None


AXES = (
    "model", "hardware", "seq_len", "precision", "world_size", "zero_stage", "tp", "pp",
    "micro_batch", "global_batch", "activation_checkpointing",
)


def build_trial(spec: StudySpec, point: dict[str, Any]) -> TrialConfig:
    """One grid point -> TrialConfig, or InfeasibleTrial with the reason."""
    model: NamedModel = point["model"]
    hw: HardwareProfile = point["hardware"]
    deg = derive_degrees(
        point["world_size"], point["tp"], point["pp"], point["micro_batch"], point["global_batch"]
    )
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
        precision=precision,
        activation_checkpointing=point["activation_checkpointing"],
        steps=spec.steps,
        seed=spec.seed,
        learning_rate=spec.learning_rate,
        trial_timeout_s=spec.trial_timeout_s,
        model_dims=model.dims,
        hardware_profile=hw,
    )


def expand(spec: StudySpec) -> list[PlannedTrial]:
    """The full grid in a fixed order (axes in AXES order, values in spec order)."""
    planned = []
    for values in itertools.product(*(getattr(spec, a) for a in AXES)):
        point = dict(zip(AXES, values))
        shown = {
            k: (v.name if isinstance(v, (NamedModel, HardwareProfile)) else
                v.value if isinstance(v, Enum) else v)
            for k, v in point.items()
        }
        try:
            planned.append(PlannedTrial(axes=shown, config=build_trial(spec, point)))
        except InfeasibleTrial as err:
            planned.append(PlannedTrial(axes=shown, reason=str(err)))
    return planned
