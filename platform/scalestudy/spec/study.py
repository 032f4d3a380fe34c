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
from scalestudy.errors import InfeasibleTrial, ReasonClass
from scalestudy.spec.precision import PrecisionChoice, resolve_precision
from scalestudy.spec.trial import (
    AXES,
    LAYOUT_AXES,
    LAYOUT_DEFAULTS,
    GatherGranularity,
    RecomputeGranularity,
    LAYOUT_NAME_AXES,
    Backend,
    Elastic,
    FaultTolerance,
    PipelineSchedule,
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
    # null: tokens_per_s_per_device (metrics.search_metric); the plan checks a name is a metric
    metric: str | None = None
    mode: Literal["max", "min"] = "max"


class Tracking(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mlflow_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    experiment: str | None = None  # None: the study name


class Workers(BaseModel):
    """How a measured sweep starts its trials' worker processes (launch/warm.py)."""

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


# The largest world a spec may ask for. Published training runs reach tens of thousands of devices
# (Llama 3: 16,384 H100s); 2**20 leaves room for any study of them and refuses a typo of 10**8
# devices that the model would otherwise "predict" as 5x10**7 nodes.
MAX_WORLD_SIZE = 1 << 20


def _world_size(v: int) -> int:
    _positive(v)
    if v > MAX_WORLD_SIZE:
        raise ValueError(f"at most {MAX_WORLD_SIZE:,} devices (2**20); published runs use up to "
                         "tens of thousands")
    return v


def _zero_stage(v: int) -> int:
    if v not in (0, 1, 2, 3):
        raise ValueError("must be one of 0, 1, 2, 3 (DeepSpeed ZeRO stage)")
    return v


# Per-element checks, so an error names the offending list element (zero_stage[1]) and its value.
PosInt = Annotated[int, AfterValidator(_positive)]
WorldSize = Annotated[int, AfterValidator(_world_size)]
ZeroStage = Annotated[int, AfterValidator(_zero_stage)]


def _as_list(v: Any) -> list:
    """Sweepable axes take a scalar or a list; both are stored as a non-empty list."""
    if isinstance(v, list):
        if not v:
            raise ValueError("an axis list must not be empty")
        return v
    return [v]


class Ensemble(BaseModel):
    """One large model or several smaller ones on the same devices (plan/ensemble.py,
    sweep/ensemble.py): for each member count k, k independent members train at the same time, each
    on world_size / k devices with its own layout, beside the study's own trial on all world_size
    devices (the single model). The layout keys below are the members'; omitted, the single
    model's."""

    model_config = ConfigDict(extra="forbid")
    members: list[PosInt] = Field(description=(
        "Member counts k: each runs k members at once, each on world_size / k devices (every world "
        "size must divide by every k); k = 1 with the study's own model is the single model."))
    # Stored as written (a catalogue name or dims, as `model:`), resolved by member_models().
    member_model: list[str | dict[str, Any]] | None = Field(None, description=(
        "The members' model, or a list of models compared in turn: a catalogue name or a dims "
        "mapping, as `model:`; null: the study's model."))
    token_budget: PositiveFloat = Field(1e12, description=(
        "Tokens each model trains on, for time_to_budget_s and energy_to_budget_j (the single "
        "model and every member alike)."))
    zero_stage: ZeroStage | None = Field(None, description="Members' ZeRO stage; null: the single's.")
    tp: PosInt | None = Field(None, description="Members' TP degree; null: the single model's.")
    pp: PosInt | None = Field(None, description="Members' PP degree; null: the single model's.")
    micro_batch: PosInt | None = Field(None, description="Members' micro-batch; null: the single's.")
    global_batch: PosInt | None = Field(None, description=(
        "Members' global batch in sequences; omitted: the single model's; written as null: weak "
        "scaling (micro_batch x dp of each member)."))

    @field_validator("members", mode="after")
    @classmethod
    def _distinct_members(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"member counts {v} repeat a value; list each k once")
        return sorted(v)

    @field_validator("member_model", mode="before")
    @classmethod
    def _member_models_resolve(cls, v: Any) -> list | None:
        if v is None:
            return None
        for x in _as_list(v):
            _resolve_model(x)  # the same errors as `model:`
        return [x.model_dump() if isinstance(x, NamedModel) else x for x in _as_list(v)]

    def member_models(self, study_models: list[NamedModel]) -> list[NamedModel]:
        return [_resolve_model(x) for x in self.member_model] if self.member_model else study_models

    def overrides(self) -> dict[str, Any]:
        """The members' layout axes given in the spec (global_batch: null given means weak)."""
        keys = ("zero_stage", "tp", "pp", "micro_batch")
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if "global_batch" in self.model_fields_set:
            out["global_batch"] = self.global_batch
        return out


def check_ensemble(ens: Ensemble, data: dict[str, Any]) -> Ensemble:
    """An ensemble study compares, per world size N, one single-model trial with k members on N / k
    devices each, started together on warm worker groups: one grid point per N, every k dividing
    every N, and no feature those groups lack (checkpoints, elastic sizes, a search's sampling)."""
    swept = [a for a in AXES if a != "world_size" and len(data.get(a) or [None]) > 1]
    if swept:
        raise ValueError(f"the single model is one trial per world size, but {swept[0]} lists "
                         f"{len(data[swept[0]])} values; give one (the members' own layout goes "
                         "under ensemble: zero_stage, tp, pp, micro_batch, global_batch)")
    for n in data.get("world_size") or []:
        bad = [k for k in ens.members if n % k]
        if bad:
            raise ValueError(f"world_size {n} does not divide into {bad[0]} members of equal "
                             f"shares; list member counts that divide every world size")
    ft, search = data.get("fault_tolerance"), data.get("search")
    if data.get("elastic") is not None or (ft is not None and ft.max_failures > 0):
        raise ValueError("ensemble members run on warm worker groups, which keep no checkpoints "
                         "and do not resize; leave elastic out and fault_tolerance.max_failures 0")
    if search is not None and search.algorithm is not SearchAlgorithm.grid:
        raise ValueError("an ensemble study runs every comparison; use search: {algorithm: grid}")
    return ens


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
    world_size: list[WorldSize] = [1]
    zero_stage: list[ZeroStage] = [0]
    tp: list[PosInt] = [1]
    pp: list[PosInt] = [1]
    micro_batch: list[PosInt] = [1]
    global_batch: list[PosInt | None] = [None]
    # false / none, true / full, or selective (the attention core only): see _checkpointing_words.
    activation_checkpointing: list[bool | Literal["selective"]] = Field([False], description=(
        "Recompute activations in backward: `none` (false), `full` (true: every block's forward "
        "again; less memory, more compute, which HFU counts and MFU does not) or `selective` (the "
        "attention core only, Korthikanti et al. 2022)."))
    # Issue 35's layout options (spec/trial.py LAYOUT_DEFAULTS; check_layout_options says what may
    # combine; perfmodel/layouts.py prices them).
    sequence_parallel: list[bool] = Field([False], description=(
        "Megatron sequence parallelism with tp > 1: norm and dropout activations sharded over the "
        "TP group, each all-reduce replaced by an all-gather and a reduce-scatter."))
    cp: list[PosInt] = Field([1], description=(
        "Context-parallel degree: a micro-batch's sequence split over cp ranks (ring attention, "
        "load-balanced causal chunks); dp counts them, as they share weights and gradients."))
    gather_granularity: list[GatherGranularity] = Field([GatherGranularity.module], description=(
        "ZeRO-3 parameter gathers: `module`, DeepSpeed's per-module fetch with its prefetch bucket; "
        "`block`, FSDP's one gather per transformer block, the next one prefetched."))
    tp_comm_overlap: list[bool] = Field([False], description=(
        "TP collectives overlapped with the GEMMs they feed (Megatron/Transformer Engine comm "
        "overlap); false: they block."))
    fp8: list[bool] = Field([False], description=(
        "GEMMs in FP8 (Transformer Engine recipe: casts and scaling around each GEMM, everything "
        "else bf16) on hardware with an FP8 peak; precision stays bf16."))
    # The pipeline of every pp > 1 trial (check_pipeline says what may combine): its schedule,
    # chunks per pipeline rank (interleaved_1f1b only, >= 2) and how many blocks fewer than the
    # others the first stage (it also embeds) and the last (norm, LM head, loss) take.
    schedule: PipelineSchedule = Field(PipelineSchedule.one_f_one_b, description=(
        "Pipeline schedule of pp > 1 trials: gpipe (all forwards, then all backwards), 1f1b (one "
        "forward, one backward in the steady state) or interleaved_1f1b (virtual_stages chunks per "
        "pipeline rank)."))
    virtual_stages: PositiveInt = Field(1, validate_default=True, description=(
        "Model chunks per pipeline rank: 1, or 2 and more with schedule interleaved_1f1b (the "
        "bubble shrinks by that factor, p2p traffic grows by it)."))
    first_stage_fewer_layers: int = Field(0, ge=0, description=(
        "Transformer blocks fewer than the other pipeline stages for the first one, which also "
        "runs the embedding."))
    last_stage_fewer_layers: int = Field(0, ge=0, description=(
        "Transformer blocks fewer than the other pipeline stages for the last one, which also runs "
        "the final norm, the LM head and the loss."))
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
    ensemble: Ensemble | None = Field(None, description=(
        "null: an ordinary study; a mapping: one large model (this study's trial) against k "
        "smaller ones trained at once on the same devices (issue 36)."))

    @field_validator("ensemble", mode="after")
    @classmethod
    def _ensemble_fits(cls, v: Ensemble | None, info) -> Ensemble | None:
        return check_ensemble(v, info.data) if v is not None else v  # every other key is validated

    @field_validator(
        "seq_len", "precision", "world_size", "zero_stage", "tp", "pp", "micro_batch",
        "global_batch", "activation_checkpointing", *LAYOUT_AXES, mode="before",
    )
    @classmethod
    def _listify(cls, v: Any) -> list:
        return _as_list(v)

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_words(cls, v: Any) -> list:
        """`none`, `full`, `selective`, or a bool as older specs write it (false = none, true =
        full, so their trials keep their ids)."""
        words = {"none": False, "full": True}
        return [words.get(x, x) if isinstance(x, str) else x for x in _as_list(v)]

    @field_validator(*AXES, mode="after")
    @classmethod
    def _distinct(cls, v: list) -> list:
        """A value listed twice is one grid point: two would be two trials of one trial id."""
        seen: set = set()
        return [x for x in v if not (shown(x) in seen or seen.add(shown(x)))]

    @field_validator("elastic", mode="after")
    @classmethod
    def _elastic_can_shrink(cls, v: Elastic | None, info) -> Elastic | None:
        """Ray Train shrinks an elastic trial only by restarting it after a worker is lost, and
        that restart counts against max_failures: with 0 a lost node fails the trial instead."""
        ft = info.data.get("fault_tolerance")  # declared before `elastic`: validated already
        if v is not None and ft is not None and ft.max_failures == 0:
            raise ValueError("an elastic trial shrinks only by a restart after a lost worker, which "
                             "counts against fault_tolerance.max_failures (0 here); set it to 1 or "
                             "more (e.g. fault_tolerance: {max_failures: 3}), or leave elastic out")
        return v

    @field_validator("virtual_stages", mode="after")
    @classmethod
    def _virtual_stages_interleave(cls, v: int, info) -> int:
        """Only the interleaved schedule runs several chunks per rank, and it needs two or more
        (validate_default: an interleaved schedule with virtual_stages left out is refused too)."""
        schedule = info.data.get("schedule")
        if schedule is PipelineSchedule.interleaved_1f1b and v < 2:
            raise ValueError("interleaved_1f1b runs 2 or more chunks per pipeline rank; set "
                             "virtual_stages: 2 (or more), or schedule: 1f1b")
        if schedule is not None and schedule is not PipelineSchedule.interleaved_1f1b and v != 1:
            raise ValueError(f"only schedule: interleaved_1f1b runs virtual stages ({schedule.value} "
                             "runs one chunk per rank); set virtual_stages: 1 or that schedule")
        return v

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
            where = ".".join(map(str, e["loc"]))
            msg = e["msg"].removeprefix("Value error, ")
            raise ValueError(f"model dims: {where + ': ' if where else ''}{msg}") from None
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
            except ValidationError as err:  # (a subclass of ValueError: first)
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
               _layout_batch(point), hw.gpus_per_node)
    refusal: InfeasibleTrial | None = None
    try:
        layout = Layout.of(*degrees)
    except InfeasibleTrial as err:
        layout, refusal = Layout.lenient(*degrees), err
    cfg = _trial_config(spec, point, layout)
    if refusal is None:
        try:
            check_trial(spec, cfg)
        except InfeasibleTrial as err:
            refusal = err
    if refusal is None:
        return PlannedTrial(axes=axes, config=cfg)
    return PlannedTrial(axes=axes, config=cfg, reason=str(refusal),
                        reason_class=refusal.reason_class)


def check_trial(spec: StudySpec, cfg: TrialConfig) -> None:
    """What makes a trial of a valid spec unrunnable, beyond its degrees (checked by the layout)."""
    hw = cfg.hardware_profile
    cfg.layout.check_model(cfg.model_dims, cfg.seq_len, cfg.virtual_stages,
                           cfg.first_stage_fewer_layers, cfg.last_stage_fewer_layers)
    if cfg.precision not in hw.peak_tflops:
        raise InfeasibleTrial(f"hardware {hw.name} has no {cfg.precision.value} peak figure",
                              ReasonClass.precision)
    if not hw.is_gpu and cfg.precision is Precision.fp16:
        raise InfeasibleTrial("fp16 training needs a GPU; use bf16 or fp32 on CPU",
                              ReasonClass.precision)
    check_pipeline(cfg, measured=spec.backend is Backend.measure)
    check_layout_options(cfg, measured=spec.backend is Backend.measure)
    if spec.backend is Backend.measure:
        # An elastic trial runs at whatever size the cluster holds: the check at its start
        # (launch/placement.py) keeps its TP groups on one node.
        cfg.layout.check_placement(hw.name, whole_nodes=spec.elastic is None)
    if spec.elastic is not None:
        check_elastic(spec.elastic, cfg.layout)


def check_pipeline(cfg: TrialConfig, measured: bool) -> None:
    """What a pipeline (pp > 1) needs beyond its stage split (Layout.check_model): a micro-batch per
    stage at least, a count the interleaved schedule can round, and, measured (train/pipeline.py,
    torch.distributed.pipelining), what the platform's pipeline implements."""
    if cfg.pp == 1:
        return
    m, pp = cfg.grad_accum, cfg.pp
    if m < pp:
        raise InfeasibleTrial(
            f"{m} micro-batch(es) per step (grad_accum) for pp {pp}: a pipeline schedule needs at "
            "least one per stage; raise global_batch or lower micro_batch", ReasonClass.layout)
    rounds = max(1, m // pp)
    if cfg.schedule is PipelineSchedule.interleaved_1f1b and m % rounds:
        raise InfeasibleTrial(
            f"interleaved_1f1b runs micro-batches in rounds of pp {pp}: grad_accum {m} is not a "
            f"multiple of its {rounds} rounds; choose a multiple of pp", ReasonClass.layout)
    if not measured:
        return
    if cfg.zero_stage >= 2:
        raise InfeasibleTrial(
            f"ZeRO-{cfg.zero_stage} with pp {pp}: the schedule runs every micro-batch's backward "
            "apart, so sharded gradients (and, at stage 3, weights) would be reduced (and "
            "gathered) once per micro-batch; pipelines shard optimizer states only (ZeRO-0/1), "
            "as DeepSpeed's and Megatron's do", ReasonClass.backend)
    if cfg.model_dims.architecture != "llama":
        raise InfeasibleTrial(
            f"pp > 1 is measured for llama models only (train/pipeline.py splits Hugging Face "
            f"Llama); {cfg.model} is a {cfg.model_dims.architecture} model", ReasonClass.backend)
    if cfg.precision is Precision.fp16:
        raise InfeasibleTrial("fp16 with pp > 1: the measured pipeline has no loss scaler; use "
                              "bf16 or fp32", ReasonClass.precision)
    if cfg.elastic is not None or cfg.fault_tolerance.max_failures > 0:
        raise InfeasibleTrial("pp > 1 with fault tolerance or elastic sizes: the measured "
                              "pipeline keeps no DeepSpeed checkpoint to resume from; leave "
                              "fault_tolerance.max_failures at 0 and elastic out",
                              ReasonClass.backend)


def check_elastic(el: Elastic, layout: Layout) -> None:
    """Every world size the trial may run at must keep the global batch exactly."""
    if not el.min_workers <= layout.world_size <= el.max_workers:
        raise InfeasibleTrial(f"world_size {layout.world_size} outside elastic "
                              f"[{el.min_workers}, {el.max_workers}]", ReasonClass.elastic)
    for w in range(el.min_workers, el.max_workers + 1):
        try:
            layout.resized(w)
        except InfeasibleTrial as err:
            raise InfeasibleTrial(
                f"elastic world size {w} cannot keep the global batch: {err}; narrow "
                "elastic.min_workers/max_workers or choose a global_batch every size divides",
                ReasonClass.elastic) from None


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
        **_pipeline_options(spec, layout.pp),
        zero_stage=point["zero_stage"],
        micro_batch=layout.micro_batch,
        grad_accum=layout.grad_accum,
        global_batch=layout.global_batch // point.get("cp", 1),
        seq_len=point["seq_len"],
        precision=resolve_precision(point["precision"], hw),
        precision_requested=point["precision"],
        **_layout_options(point),
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


def _pipeline_options(spec: StudySpec, pp: int) -> dict[str, Any]:
    """The spec's pipeline options for a pp > 1 trial; a pp = 1 trial has no pipeline, so it keeps
    the defaults (and the trial id a spec without them gives it)."""
    if pp == 1:
        return {}
    return {"schedule": spec.schedule, "virtual_stages": spec.virtual_stages,
            "first_stage_fewer_layers": spec.first_stage_fewer_layers,
            "last_stage_fewer_layers": spec.last_stage_fewer_layers}


def expand(spec: StudySpec) -> list[PlannedTrial]:
    """The full grid in a fixed order (axes in AXES order, values in spec order)."""
    return [
        build_trial(spec, dict(zip(AXES, values)))
        for values in itertools.product(*(getattr(spec, a) for a in AXES))
    ]


# Issue 35's layout options ------------------------------------------------------------------------

def _layout_batch(point: dict[str, Any]) -> int | None:
    """The global batch as the layout divides it. The layout's dp counts context-parallel ranks,
    which share a micro-batch (each holds a 1/cp slice of its sequence), so a step's sequences are
    global_batch * cp in the layout's terms; _trial_config divides them back."""
    gb, cp = point["global_batch"], point.get("cp", 1)
    return gb * cp if gb else gb


def _layout_options(point: dict[str, Any]) -> dict[str, Any]:
    """A point's checkpointing and layout options as TrialConfig fields (a point built before an
    option existed keeps its default)."""
    ac = point["activation_checkpointing"]
    selective = isinstance(ac, str) and ac == "selective"
    return {"activation_checkpointing": bool(ac),
            "recompute_granularity": (RecomputeGranularity.selective if selective
                                      else RecomputeGranularity.full),
            **{a: point.get(a, LAYOUT_DEFAULTS[a]) for a in LAYOUT_AXES}}


# hardware.yaml's FP8 dense tensor-core peak (calibration key): the hardware that has FP8 GEMMs.
FP8_PEAK_KEY = "fp8_dense_tflops"


def check_layout_options(cfg: TrialConfig, measured: bool) -> None:
    """What sequence/context parallelism, gather granularity, TP overlap and FP8 need; measured,
    the trial body runs none of them yet (it would measure the default layout under their name)."""
    def refuse(why: str, cls: ReasonClass = ReasonClass.layout) -> None:
        raise InfeasibleTrial(why, cls)

    if cfg.sequence_parallel and cfg.tp == 1:
        refuse("sequence_parallel shards the TP group's activations: it needs tp > 1")
    if cfg.tp_comm_overlap and cfg.tp == 1:
        refuse("tp_comm_overlap overlaps TP collectives: it needs tp > 1")
    if cfg.cp > 1 and cfg.dp % cfg.cp:
        refuse(f"cp {cfg.cp} does not divide the {cfg.dp} ranks outside tp x pp (dp x cp)")
    if cfg.cp > 1 and cfg.seq_len % (2 * cfg.cp):
        refuse(f"cp {cfg.cp} splits each sequence into 2 x cp load-balanced chunks: seq_len "
               f"{cfg.seq_len} is not a multiple of {2 * cfg.cp}", ReasonClass.model)
    if cfg.gather_granularity is GatherGranularity.block and cfg.zero_stage != 3:
        refuse(f"gather_granularity block is how ZeRO-3 gathers weights; zero_stage is "
               f"{cfg.zero_stage}: use module (the default)")
    hw = cfg.hardware_profile
    if cfg.fp8 and not hw.calibration.get(FP8_PEAK_KEY):
        refuse(f"fp8: hardware {hw.name} has no FP8 peak ({FP8_PEAK_KEY} in its calibration)",
               ReasonClass.precision)
    if cfg.fp8 and cfg.precision not in (Precision.bf16, Precision.fp16):
        refuse(f"fp8 runs GEMMs in FP8 around a bf16/fp16 model; precision is "
               f"{cfg.precision.value}", ReasonClass.precision)
    if not measured:
        return
    chosen = [k for k, v in LAYOUT_DEFAULTS.items() if getattr(cfg, k) != v]
    if chosen:
        refuse(f"{', '.join(chosen)}: the measure backend's trial body runs the default layout "
               "only (use backend simulate)", ReasonClass.backend)
