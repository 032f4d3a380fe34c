"""The study spec (YAML contract of every command) and its expansion into trials.

A trial is a TrialConfig (spec/trial.py); its layout (degrees, nodes, batch split) comes from the
layout object (parallel/layout.py), which also says why a point cannot run.
"""

from __future__ import annotations

import itertools
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
)

from scalestudy.parallel.layout import Layout
from scalestudy.spec import catalog
from scalestudy.spec.catalog import HardwareProfile, ModelDims, Precision
from scalestudy.spec.errors import InfeasibleTrial
from scalestudy.spec.precision import PrecisionChoice, resolve_precision
from scalestudy.spec.trial import (
    AXES,
    LAYOUT_NAME_AXES,
    Backend,
    Elastic,
    FaultTolerance,
    PlannedTrial,
    Steps,
    TrialConfig,
)


class SearchAlgorithm(str, Enum):
    grid = "grid"
    random = "random"
    optuna = "optuna"


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


class Workers(BaseModel):
    """How a measured sweep starts its trials' worker processes (train/warm.py)."""

    model_config = ConfigDict(extra="forbid")
    # True: consecutive trials of one worker shape (world size, resources per worker, hardware)
    # share a warm group of worker processes and its process group; False: every trial starts its
    # own (a cold Ray Train worker group), as before warm groups existed.
    reuse: bool = True


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
    precision: list[PrecisionChoice] = [PrecisionChoice.auto]
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
    trial_timeout_s: PositiveFloat = 3600.0  # counted from the start of a trial's worker group
    # The wait for a trial's nodes (an autoscaler's take minutes); past it the trial is recorded as
    # a timeout with a placement reason.
    placement_timeout_s: PositiveFloat = 1800.0
    fault_tolerance: FaultTolerance = FaultTolerance()
    elastic: Elastic | None = None
    # Excluded from dumps, so from the spec hash: how trials start does not change what they measure.
    workers: Workers = Field(default_factory=Workers, exclude=True)

    @field_validator(
        "seq_len", "precision", "world_size", "zero_stage", "tp", "pp", "micro_batch",
        "global_batch", "activation_checkpointing", mode="before",
    )
    @classmethod
    def _listify(cls, v: Any) -> list:
        return _as_list(v)

    @field_validator(*AXES, mode="after")
    @classmethod
    def _distinct(cls, v: list) -> list:
        """A value listed twice is one grid point: two would be two trials of one trial id."""
        seen: set = set()
        return [x for x in v if not (shown(x) in seen or seen.add(shown(x)))]

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_models(cls, v: list) -> list[NamedModel]:
        models = [_resolve_model(x) for x in _as_list(v)]
        _one_per_name([(m.name, m.dims) for m in models], "models with different dims",
                      "name each one: {name: my-model, dims: {architecture: ..., hidden_size: ...}}")
        return models

    @field_validator("hardware", mode="before")
    @classmethod
    def _resolve_hardware(cls, v: list, info) -> list[HardwareProfile]:
        spec_dir = info.data.get("spec_dir")
        profiles = [resolve_hardware(x, spec_dir) for x in _as_list(v)]
        _one_per_name([(h.name, h) for h in profiles], "different hardware profiles",
                      "edit the `name:` of one profile YAML (a calibrated profile keeps the "
                      "name of the catalogue entry it started from)")
        return profiles

    @property
    def experiment(self) -> str:
        return self.tracking.experiment or self.name

    def axis_values(self) -> dict[str, list]:
        """Each axis' values as trials show them (names, plain values): what a search draws from."""
        return {a: [shown(v) for v in getattr(self, a)] for a in AXES}

    @property
    def name_axes(self) -> tuple[str, ...]:
        """Axes beyond the layout that this study sweeps: its trials' names show them."""
        return tuple(a for a in AXES if a not in LAYOUT_NAME_AXES and len(getattr(self, a)) > 1)


def shown(value: Any) -> Any:
    """An axis value as trials, names and searches show it: a model's or hardware's name, an
    enum's value, anything else itself."""
    if isinstance(value, (NamedModel, HardwareProfile)):
        return value.name
    return value.value if isinstance(value, Enum) else value


def _one_per_name(named: list[tuple[str, Any]], what: str, fix: str) -> None:
    """A name is its axis' column in the ledger, MLflow and every figure, and a trial's point
    (resolve_point) finds its model and hardware by name: two of one name would run, be drawn and
    be paired with predictions as one."""
    first: dict[str, Any] = {}
    for name, value in named:
        if first.setdefault(name, value) != value:
            raise ValueError(f"two {what} are both named {name!r}; {fix}")


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
        named = NamedModel(**x)
        if named.name in catalog.model_names() and named.dims != catalog.get_model(named.name):
            # a result row is rebuilt from the catalogue by its model name (spec.trial.config_from_row)
            raise ValueError(f"{named.name!r} is a catalogue model with other dims; give this one "
                             "a name of its own")
        return named
    if isinstance(x, dict):
        try:
            dims = ModelDims(**x)
        except ValidationError as err:
            e = err.errors()[0]
            raise ValueError(f"model dims: {'.'.join(map(str, e['loc']))}: {e['msg']}") from None
        name = f"custom-{dims.architecture}-h{dims.hidden_size}-l{dims.num_layers}"
        return NamedModel(name=name, dims=dims)
    raise ValueError("must be a catalogue name or a mapping of dims")


def resolve_hardware(x: Any, spec_dir: Path | None = None) -> HardwareProfile:
    """A catalogue name, a profile YAML path (also relative to the spec's folder) or a profile."""
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


def resolve_point(spec: StudySpec, axes: dict[str, Any]) -> dict[str, Any]:
    """Axis values as shown/sampled (names, plain values) -> the spec's typed objects."""
    point = dict(axes)
    point["model"] = next(m for m in spec.model if m.name == axes["model"])
    point["hardware"] = next(h for h in spec.hardware if h.name == axes["hardware"])
    point["precision"] = PrecisionChoice(axes["precision"])
    return point


def build_trial(spec: StudySpec, point: dict[str, Any]) -> PlannedTrial:
    """One grid point (typed, see resolve_point) -> PlannedTrial with its infeasibility reason."""
    axes = {k: shown(v) for k, v in point.items()}
    hw: HardwareProfile = point["hardware"]
    degrees = (point["world_size"], point["tp"], point["pp"], point["micro_batch"],
               point["global_batch"], hw.gpus_per_node)
    try:
        layout, reason = Layout.of(*degrees), None
    except InfeasibleTrial as err:
        layout, reason = Layout.lenient(*degrees), str(err)
    cfg = _trial_config(spec, point, layout)
    if reason is None:
        try:
            check_trial(spec, cfg)
        except InfeasibleTrial as err:
            reason = str(err)
    return PlannedTrial(axes=axes, config=cfg, reason=reason)


def check_trial(spec: StudySpec, cfg: TrialConfig) -> None:
    """What makes a trial of a valid spec unrunnable, beyond its degrees (checked by the layout)."""
    hw = cfg.hardware_profile
    cfg.layout.check_model(cfg.model_dims, cfg.seq_len)
    if cfg.precision not in hw.peak_tflops:
        raise InfeasibleTrial(f"hardware {hw.name} has no {cfg.precision.value} peak figure")
    if hw.kind == "cpu" and cfg.precision is Precision.fp16:
        raise InfeasibleTrial("fp16 training needs a GPU; use bf16 or fp32 on CPU")
    if spec.backend is Backend.measure and cfg.pp > 1:
        raise InfeasibleTrial("pp > 1 is not supported by the measure backend (use simulate)")
    if spec.backend is Backend.measure:
        # An elastic trial runs at whatever size the cluster holds: the check at its start
        # (train/placement.py) keeps its TP groups on one node.
        cfg.layout.check_placement(hw.name, whole_nodes=spec.elastic is None)
    if spec.elastic is not None:
        check_elastic(spec.elastic, cfg.layout)


def check_elastic(el: Elastic, layout: Layout) -> None:
    """Every world size the trial may run at must keep the global batch exactly."""
    if not el.min_workers <= layout.world_size <= el.max_workers:
        raise InfeasibleTrial(f"world_size {layout.world_size} outside elastic "
                              f"[{el.min_workers}, {el.max_workers}]")
    for w in range(el.min_workers, el.max_workers + 1):
        try:
            layout.resized(w)
        except InfeasibleTrial as err:
            raise InfeasibleTrial(
                f"elastic world size {w} cannot keep the global batch: {err}; narrow "
                "elastic.min_workers/max_workers or choose a global_batch every size divides"
            ) from None


def _trial_config(spec: StudySpec, point: dict[str, Any], layout: Layout) -> TrialConfig:
    model: NamedModel = point["model"]
    hw: HardwareProfile = point["hardware"]
    return TrialConfig(
        study=spec.name,
        backend=spec.backend,
        model=model.name,
        hardware=hw.name,
        world_size=layout.world_size,
        nodes=layout.nodes,
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        zero_stage=point["zero_stage"],
        micro_batch=layout.micro_batch,
        grad_accum=layout.grad_accum,
        global_batch=layout.global_batch,
        seq_len=point["seq_len"],
        precision=resolve_precision(point["precision"], hw),
        precision_requested=point["precision"],
        activation_checkpointing=point["activation_checkpointing"],
        steps=spec.steps,
        seed=spec.seed,
        learning_rate=spec.learning_rate,
        trial_timeout_s=spec.trial_timeout_s,
        placement_timeout_s=spec.placement_timeout_s,
        fault_tolerance=spec.fault_tolerance,
        elastic=spec.elastic,
        model_dims=model.dims,
        hardware_profile=hw,
        name_axes=spec.name_axes,
    )


def expand(spec: StudySpec) -> list[PlannedTrial]:
    """The full grid in a fixed order (axes in AXES order, values in spec order)."""
    return [
        build_trial(spec, dict(zip(AXES, values)))
        for values in itertools.product(*(getattr(spec, a) for a in AXES))
    ]
