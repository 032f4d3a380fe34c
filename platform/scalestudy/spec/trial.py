"""One point of a study (TrialConfig): the config columns of every result, its identity and its name.

TrialConfig owns the config columns. The result schema (metrics.TrialResult) derives its config
fields from `config_columns()`, the ledger and MLflow store `config_fields()`, and a row comes back as
a TrialConfig through `config_from_row`, the one way back for the ledger, the fit and the analysis.
TRIAL_KEY is the design point a row measured or predicted, independent of how (backend, profile,
steps): the columns that pair a prediction with its measurement.
"""

from __future__ import annotations

import functools
import hashlib
import json
import typing
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict

from scalestudy.parallel.layout import Layout, stage_layer_counts
from scalestudy.spec import catalog
from scalestudy.spec.catalog import HardwareProfile, ModelDims, Precision
from scalestudy.errors import ReasonClass
from scalestudy.spec.errors import SpecError
from scalestudy.spec.options import (LAYOUT_AXES, LAYOUT_DEFAULTS, PIPELINE_DEFAULTS, Backend,
                                     Elastic, FaultTolerance, GatherGranularity, PipelineSchedule,
                                     RecomputeGranularity, Steps, pipeline_option_field,
                                     layout_option_field)
from scalestudy.spec.precision import PrecisionChoice


# The axes a study sweeps, in expansion order. A row's values of them (global_batch and precision
# as resolved) are the design point it measured: the trial-identity key.
AXES = (
    "model", "hardware", "seq_len", "precision", "world_size", "zero_stage", "tp", "pp",
    "micro_batch", "global_batch", "activation_checkpointing", *LAYOUT_AXES,
)
TRIAL_KEY: tuple[str, ...] = (*AXES, "recompute_granularity")

# TrialConfig fields that are not flat config columns: nested objects (their scalars are flattened
# into steps_* or come back from the catalogues by name) and how the trial is named in its study.
_NOT_COLUMNS = frozenset({"model_dims", "hardware_profile", "steps", "fault_tolerance", "elastic",
                          "name_axes", "placement_timeout_s"})
# Fields that do not change what a trial measures, so not its identity: the study it belongs to,
# how it survives faults, the precision as written in the spec (the resolved one is hashed) and
# the axes its name shows.
_NOT_HASHED = frozenset({"study", "fault_tolerance", "precision_requested", "name_axes",
                         "placement_timeout_s"})


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
    # The pipeline (pp > 1): its schedule, chunks per rank (interleaved only) and how many blocks
    # fewer the first and last stages take (parallel/layout.py stage_layer_counts).
    schedule: PipelineSchedule = pipeline_option_field("schedule")
    virtual_stages: int = pipeline_option_field("virtual_stages")
    first_stage_fewer_layers: int = pipeline_option_field("first_stage_fewer_layers")
    last_stage_fewer_layers: int = pipeline_option_field("last_stage_fewer_layers")
    zero_stage: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    precision: Precision  # the precision the trial runs at (auto resolved, spec/precision.py)
    # As the spec wrote it (auto, or a precision); None in ledgers written before auto existed.
    precision_requested: PrecisionChoice | None = None
    activation_checkpointing: bool
    # Issue 35's layout options (LAYOUT_DEFAULTS; perfmodel/layouts.py). dp counts the context-
    # parallel ranks: they hold the same weights and reduce gradients together (Megatron's dp x cp
    # group); a micro-batch's sequence is split over its cp ranks.
    recompute_granularity: RecomputeGranularity = layout_option_field("recompute_granularity")
    sequence_parallel: bool = layout_option_field("sequence_parallel")
    cp: int = layout_option_field("cp")
    gather_granularity: GatherGranularity = layout_option_field("gather_granularity")
    tp_comm_overlap: bool = layout_option_field("tp_comm_overlap")
    fp8: bool = layout_option_field("fp8")
    steps: Steps
    seed: int
    learning_rate: float
    trial_timeout_s: float  # from the start of the trial's worker group (launch/deadline.py)
    # How long the trial may wait for its nodes before it starts; how long it waits is not what it
    # measures, so neither a column nor part of its id.
    placement_timeout_s: float = 1800.0
    fault_tolerance: FaultTolerance = FaultTolerance()
    elastic: Elastic | None = None
    model_dims: ModelDims
    hardware_profile: HardwareProfile
    # Axes beyond the layout that the trial's name shows, because its study sweeps them.
    name_axes: tuple[str, ...] = ()

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def layout(self) -> Layout:
        """The trial's layout (for an infeasible point, the rounded-down one it was recorded with)."""
        return Layout(self.world_size, self.dp, self.tp, self.pp, self.micro_batch, self.grad_accum,
                      self.global_batch, self.hardware_profile.gpus_per_node)

    @property
    def stage_layers(self) -> list[int]:
        """Transformer blocks of each pipeline stage (pp * virtual_stages of them, in stage order);
        InfeasibleTrial when they do not split (the spec check refuses such a trial first)."""
        return stage_layer_counts(self.model_dims.num_layers, self.pp, self.virtual_stages,
                                  self.first_stage_fewer_layers, self.last_stage_fewer_layers)

    @functools.cached_property
    def trial_id(self) -> str:
        """Stable hash of everything that defines what the trial measures (not its study). Cached:
        the config is frozen, and a model sweep asks for it once per column set (model_copy below
        drops the cache, since pydantic copies the instance dict with it)."""
        return self._hashed_id(self._dump())

    def _dump(self) -> dict[str, Any]:
        """Every field but the profile, JSON-ready: the id and the columns are both read from it."""
        return self.model_dump(mode="json", exclude={"hardware_profile"})

    def _hashed_id(self, dump: dict[str, Any]) -> str:
        payload = {k: v for k, v in dump.items() if k not in _NOT_HASHED}
        if self.elastic is None:  # elastic bounds change the trial; their absence keeps old ids
            payload.pop("elastic")
        # The profile's JSON (placement fields left out) comes cached from the profile, spliced in
        # where json.dumps(..., sort_keys=True) of the whole payload puts it: the same bytes as ever.
        blob = _sorted_json_with(payload, "hardware_profile", self.hardware_profile.identity_json)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> TrialConfig:
        copied = super().model_copy(update=update, deep=deep)
        copied.__dict__.pop("trial_id", None)
        return copied

    @property
    def run_name(self) -> str:
        return trial_name(self, self.name_axes)

    def config_fields(self) -> dict[str, Any]:
        """Flat, scalar config columns (what the ledger, MLflow params and tables show)."""
        d = self._dump()
        if "trial_id" not in self.__dict__:  # not cached yet: hash the same dump (one, not two)
            self.__dict__["trial_id"] = self._hashed_id(d)
        d["trial_id"] = self.trial_id
        d.update({f"steps_{k}": v for k, v in d["steps"].items()})
        d.update({k: getattr(v, "value", v) for k, v in PIPELINE_DEFAULTS.items() if k not in d})
        d.update({k: getattr(v, "value", v) for k, v in LAYOUT_DEFAULTS.items() if k not in d})
        return {k: d[k] for k in config_columns()}


_SPLICE = "\x00spliced\x00"  # placeholder of the spliced value (see _sorted_json_with)
_SPLICE_JSON = json.dumps(_SPLICE)


def _sorted_json_with(payload: dict[str, Any], key: str, value_json: str) -> str:
    """json.dumps({**payload, key: value}, sort_keys=True) for a value given as its JSON already:
    dumped with a placeholder in its place, then the placeholder replaced (one dump is cheaper than
    two; a payload that happens to hold the placeholder itself is dumped whole instead)."""
    blob = json.dumps({**payload, key: _SPLICE}, sort_keys=True)
    if blob.count(_SPLICE_JSON) == 1:
        return blob.replace(_SPLICE_JSON, value_json)
    return json.dumps({**payload, key: json.loads(value_json)}, sort_keys=True)


def _column_type(annotation: Any) -> Any:
    """A field's type as a column holds it: enums as their string values."""
    args = typing.get_args(annotation)
    if args:
        return typing.Union[tuple(_column_type(a) for a in args)]  # noqa: UP007 - built at runtime
    return str if isinstance(annotation, type) and issubclass(annotation, Enum) else annotation


@functools.cache
def config_columns() -> dict[str, tuple[Any, Any]]:
    """Config column -> (type, default) in schema order: TrialConfig's scalar fields, its trial_id
    after the study, and the steps flattened. The result schema is built from this."""
    cols: dict[str, tuple[Any, Any]] = {}
    for name, info in TrialConfig.model_fields.items():
        if name in _NOT_COLUMNS:
            continue
        default = ... if info.is_required() else info.default
        cols[name] = (_column_type(info.annotation), default)
        if name == "study":
            cols["trial_id"] = (str, ...)
    for name, info in Steps.model_fields.items():
        cols[f"steps_{name}"] = (int, ...)
    return cols


def _getter(row: Mapping[str, Any] | Any):
    if isinstance(row, Mapping):
        return row.get
    return lambda key, default=None: getattr(row, key, default)


def trial_key(row: Mapping[str, Any] | Any) -> tuple:
    """The design point of a config, result or ledger row (TRIAL_KEY's values)."""
    get = _getter(row)
    return tuple(getattr(v, "value", v) for v in (_or_default(k, get(k)) for k in TRIAL_KEY))


def _or_default(key: str, value: Any) -> Any:
    """A layout option missing from a row written before it existed (None, or NaN in a frame) is
    at its default: the design point that row measured."""
    if key in LAYOUT_DEFAULTS and (value is None or value != value):
        return LAYOUT_DEFAULTS[key]
    return value


def config_from_row(row: Mapping[str, Any] | Any, hardware: HardwareProfile | None = None
                    ) -> TrialConfig:
    """The TrialConfig a result (or its ledger/MLflow row) was produced from. Model dimensions come
    back from the catalogue by name, the hardware profile from the catalogue or `hardware`; a row
    of anything else cannot be rebuilt (SpecError naming it)."""
    get = _getter(row)
    model = get("model")
    if model not in catalog.model_names():
        raise SpecError("model", model, "only catalogue models can be rebuilt from a result row")
    if hardware is None:
        if get("hardware") not in catalog.hardware_names():
            raise SpecError("hardware", get("hardware"), "not in the catalogue; give its profile")
        hardware = catalog.get_hardware(get("hardware"))
    fields = {k: get(k) for k in config_columns() if k in TrialConfig.model_fields}
    fields = {k: v for k, v in fields.items() if v is not None and v == v}  # NaN: a missing cell
    steps = {k: int(get(f"steps_{k}")) for k in Steps.model_fields if get(f"steps_{k}") is not None}
    fields.update(hardware=hardware.name, hardware_profile=hardware,
                  model_dims=catalog.get_model(model), steps=Steps(**steps))
    return TrialConfig(**fields)


# How each axis beyond the layout shows in a name: (prefix?, format).
_NAME_PARTS = {
    "model": (True, "{}"), "hardware": (True, "{}"), "seq_len": (False, "s{}"),
    "precision": (False, "{}"), "global_batch": (False, "gb{}"),
    "activation_checkpointing": (False, "ac{}"),
    "sequence_parallel": (False, "sp{:d}"), "cp": (False, "cp{}"),
    "gather_granularity": (False, "{}gather"),
    "tp_comm_overlap": (False, "tpoverlap{:d}"), "fp8": (False, "fp8gemm{:d}"),
}
LAYOUT_NAME_AXES = ("world_size", "tp", "pp", "zero_stage", "micro_batch")


def trial_name(t: Mapping[str, Any] | Any, name_axes: Iterable[str] = ()) -> str:
    """Short human name of a trial (`ws2-tp1-z3-mb2`), for a TrialConfig, a TrialResult or a row.

    The layout always shows (pp and accumulation when above 1); every other axis in `name_axes`
    (those its study sweeps, see `name_axes_of`) shows too, so no two trials of a study share a
    name: `llama2-7b-ws8-tp1-z3-mb1-ac1`."""
    raw = _getter(t)

    def get(key: str) -> Any:  # a float column of whole numbers (pandas, MLflow) prints as an int
        v = raw(key)
        return int(v) if isinstance(v, float) and v.is_integer() else v

    name = f"ws{get('world_size')}-tp{get('tp')}" + (f"-pp{get('pp')}" if get("pp") > 1 else "")
    name += _schedule_part(get) if get("pp") > 1 else ""
    name += f"-z{get('zero_stage')}-mb{get('micro_batch')}"
    name += f"-ga{get('grad_accum')}" if (get("grad_accum") or 1) > 1 else ""
    chosen = set(name_axes)
    before, after = [], []
    for axis, (prefix, fmt) in _NAME_PARTS.items():
        if axis in chosen:
            value = _name_value(get, axis)
            (before if prefix else after).append(fmt.format(getattr(value, "value", value)))
    return "-".join([*before, name, *after])


def _name_value(get, axis: str) -> Any:
    """An axis' value as a name shows it: checkpointing as 0, 1 or `sel` (selective recompute),
    a layout option missing from an older row at its default."""
    value = _or_default(axis, get(axis))
    if axis == "activation_checkpointing":
        selective = _or_default("recompute_granularity", get("recompute_granularity"))
        return "sel" if value and getattr(selective, "value", selective) == "selective" else int(value)
    return value


def _schedule_part(get) -> str:
    """A pipeline's schedule in a name when it is not the default: `-gpipe`, `-interleaved_1f1bv2`."""
    schedule = getattr(get("schedule"), "value", get("schedule"))
    part = "" if schedule in (None, PIPELINE_DEFAULTS["schedule"].value) else f"-{schedule}"
    virtual = get("virtual_stages")
    return part + (f"v{virtual}" if virtual and virtual > 1 else "")


def name_axes_of(rows: Iterable[Mapping[str, Any] | Any]) -> tuple[str, ...]:
    """The axes beyond the layout that take more than one value among a study's rows: what its
    trials' names must show. (StudySpec.name_axes says the same from the spec.)"""
    rows = list(rows)
    def shown(r: Any, axis: str) -> Any:
        value = _name_value(_getter(r), axis)
        return getattr(value, "value", value)

    return tuple(a for a in _NAME_PARTS if len({shown(r, a) for r in rows}) > 1)


class PlannedTrial(BaseModel):
    """A trial as expanded from the grid: its config, and why it cannot run when it cannot.

    Infeasible points keep a config (derived values rounded down) so their results share the
    schema of every other trial."""

    model_config = ConfigDict(frozen=True)
    axes: dict[str, Any]
    config: TrialConfig
    reason: str | None = None
    reason_class: ReasonClass | None = None

    @property
    def feasible(self) -> bool:
        return self.reason is None
