"""The spec reference page (docs/spec-reference.md), generated from the pydantic schema.

    python -m scalestudy.spec.reference > docs/spec-reference.md

Walks StudySpec's fields and the models nested in them (steps, search, tracking, fault_tolerance,
elastic, workers, a model's {name, dims} and its dims): each key's YAML type, its default and one
line. A field's own `Field(description=...)` wins; until spec/ carries one, DESCRIPTIONS below holds
the line. Generated rather than written, so the page cannot drift from the schema:
tests/unit/test_spec_reference.py fails when docs/spec-reference.md is stale or a key has no line.
"""

from __future__ import annotations

import enum
import re
import types
import typing
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from scalestudy.spec import catalog, sections
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.study import StudySpec
from scalestudy.spec.trial import AXES

REGENERATE = "python -m scalestudy.spec.reference > docs/spec-reference.md"
UNDESCRIBED = "(no description: add Field(description=...) or an entry in spec/reference.py)"

# One line per key, by its path in the YAML ("steps.warmup"; "model" is the {name, dims} form).
DESCRIPTIONS: dict[str, str] = {
    "name": "Study name: the ledger folder (`<results root>/<name>/`), the MLflow experiment "
            "(unless `tracking.experiment`) and the report's title.",
    "model": "What to train: a catalogue name, a mapping of dims (named "
             "`custom-<architecture>-h<width>-l<depth>`), or `{name, dims}`.",
    "hardware": "Where it runs: a catalogue profile, or a profile YAML written by "
                "`scalestudy calibrate` (a path relative to the working directory or the spec's "
                "folder).",
    "backend": "`measure`: real trials (Ray Tune x Ray Train x DeepSpeed); `simulate`: the "
               "performance model predicts the same metrics.",
    "seq_len": "Tokens per sequence; above the model's `max_seq_len` a trial is infeasible.",
    "precision": "Training precision; `auto` is bf16 on GPUs and on CPUs with native bf16, else "
                 "fp32, resolved per trial.",
    "world_size": "Devices (Ray Train workers) per trial; dp = world_size / (tp x pp).",
    "zero_stage": "DeepSpeed ZeRO stage: 0 none, 1 shards optimizer states, 2 also gradients, "
                  "3 also parameters (FSDP-like).",
    "tp": "Tensor-parallel degree (DeepSpeed AutoTP); a TP group stays within one node.",
    "pp": "Pipeline-parallel degree; the measure backend runs pp 1 only (larger is infeasible "
          "there).",
    "micro_batch": "Sequences per device per forward and backward pass.",
    "global_batch": "Sequences per optimizer step; null: weak scaling (micro_batch x dp); an int: "
                    "strong scaling, grad_accum = global_batch / (micro_batch x dp) must be whole.",
    "activation_checkpointing": "Recompute each block's activations in backward: less memory, "
                                "more compute (HFU counts it, MFU does not).",
    "steps": "Warm-up, timed and profiled steps of every trial.",
    "search": "Which grid points run: all of them, or a sample drawn by Ray Tune's searchers.",
    "tracking": "Where the MLflow runs go.",
    "seed": "Seed of the synthetic tokens, the initial weights and the searches.",
    "learning_rate": "AdamW learning rate of every trial.",
    "trial_timeout_s": "A measured trial still running this long after its worker group started "
                       "is stopped and recorded as `timeout`.",
    "placement_timeout_s": "How long a measured trial waits for its nodes (an autoscaler takes "
                           "minutes) before it is recorded as a placement timeout.",
    "fault_tolerance": "Restarts of a measured trial's worker group after a lost worker, resuming "
                       "from DeepSpeed checkpoints.",
    "elastic": "null: a fixed world size; a mapping: Ray Train elastic scaling between "
               "min_workers and max_workers.",
    "workers": "How a measured sweep starts its trials' worker processes (not part of a trial's "
               "identity).",
    "steps.warmup": "Steps run before the timed window, not measured.",
    "steps.measure": "Timed steps; step time is their median.",
    "steps.profile": "Steps under torch.profiler after the timed window, for the communication "
                     "metrics; 0 skips it (those metrics are then NaN with the reason).",
    "search.algorithm": "`grid`: every point; `random` or `optuna`: `num_samples` points drawn "
                        "from the axes' values.",
    "search.num_samples": "Points a random or optuna search draws; null: as many as the "
                          "runnable grid points.",
    "search.metric": "The TrialResult metric a search optimises.",
    "search.mode": "Whether the search maximises (`max`) or minimises (`min`) that metric.",
    "tracking.mlflow_uri": "MLflow tracking URI; null: `$MLFLOW_TRACKING_URI`, else "
                           "`sqlite:///mlflow.db`.",
    "tracking.experiment": "MLflow experiment; null: the study name.",
    "fault_tolerance.max_failures": "Worker-group restarts per trial (Ray Train FailureConfig); "
                                    "0: a lost worker fails the trial.",
    "fault_tolerance.checkpoint_every": "Steps between DeepSpeed checkpoints once max_failures > 0 "
                                        "or the trial is elastic (taken outside the timed steps).",
    "elastic.min_workers": "Fewest workers the trial runs with.",
    "elastic.max_workers": "Most workers the trial grows to; every size in between must keep the "
                           "global batch.",
    "elastic.resize_check_s": "How often a running trial checks whether the cluster could hold "
                              "more workers; growing restarts it from the last checkpoint.",
    "workers.reuse": "true: consecutive trials of one worker shape share a warm group of worker "
                     "processes; false: every trial starts its own.",
    "model.name": "The model's name in results, MLflow and figures; a catalogue name only with "
                  "the catalogue's dims.",
    "model.dims": "The model's dimensions (model.dims below).",
    "model.dims.architecture": "`llama` blocks, or `gpt` (GPT-2-style blocks built as Hugging "
                               "Face's OPT; multi-head attention only).",
    "model.dims.hidden_size": "Model width.",
    "model.dims.num_layers": "Transformer blocks.",
    "model.dims.num_heads": "Attention heads; the head dim is hidden_size / num_heads.",
    "model.dims.num_kv_heads": "Key/value heads (grouped-query attention); null: num_heads.",
    "model.dims.ffn_hidden_size": "MLP width; null: 4 x hidden (gpt), or Llama's 8/3 x hidden "
                                  "rounded up to a multiple of 256.",
    "model.dims.vocab_size": "Vocabulary size: rows of the embedding and of the LM head.",
    "model.dims.max_seq_len": "Longest sequence the model takes.",
}

# Keys whose YAML form is not their stored type: the validators accept more than the field holds.
TYPE_OVERRIDES: dict[str, str] = {
    "model": "catalogue name, dims mapping ([model.dims](#modeldims)) or "
             "[`{name, dims}`](#model); or a list of these (swept)",
    "hardware": "catalogue name or profile path; or a list of these (swept)",
}

# A line under a section's heading where its model has no docstring of its own.
SECTION_NOTES: dict[str, str] = {
    "model": "`model: {name: my-model, dims: {...}}`: a model of your own dimensions under a "
             "name of your choice.",
    "model.dims": "A model's dimensions, written as `model: {hidden_size: ..., num_layers: ..., "
                  "...}` or under `dims:`; the catalogue's models are listed at the end of this "
                  "page.",
    "steps": "Every trial runs `warmup` steps, then `measure` timed steps, then `profile` "
             "profiled steps.",
    "search": "With `grid`, every runnable point of the axes runs; the others draw a sample.",
}

# Constraints that spec/study.py writes as AfterValidator functions, by function name (a function
# not listed here fails tests/unit/test_spec_reference.py: say what it accepts).
_VALIDATOR_TEXT = {"_positive": "> 0", "_zero_stage": "0, 1, 2 or 3",
                   "_world_size": f"> 0, at most {sections.MAX_WORLD_SIZE:,}"}
_SCALARS = {int: "int", float: "float", str: "string", bool: "bool"}
_SKIP = (HardwareProfile,)  # a profile is a catalogue entry or a file, never keys written in a spec


class Section(typing.NamedTuple):
    path: str  # "" for the top level, "steps", "model.dims", ...
    model: type[BaseModel]


def sections() -> list[Section]:
    """StudySpec, then every model nested in its fields, depth first in field order."""
    found: list[Section] = []

    def walk(path: str, model: type[BaseModel]) -> None:
        found.append(Section(path, model))
        for name, field in _fields(model).items():
            for nested in _models_in(field.annotation):
                walk(f"{path}.{name}" if path else name, nested)

    walk("", StudySpec)
    return found


def _fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    return {n: f for n, f in model.model_fields.items() if n != "spec_dir"}


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [] if issubclass(annotation, _SKIP) else [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def anchor(path: str) -> str:
    """GitHub's heading anchor for `## path`."""
    return re.sub(r"[^a-z0-9_ -]", "", path.lower()).replace(" ", "-")


def type_text(annotation: Any, metadata: list[Any] = ()) -> str:
    """A field's type as a spec writer reads it: `int > 0`, `list of ...`, `bf16, fp16 or fp32`."""
    if typing.get_origin(annotation) is Annotated:
        base, *extra = typing.get_args(annotation)
        return type_text(base, [*metadata, *extra])
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        parts = [type_text(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if typing.get_origin(annotation) is list:
        return f"list of {type_text(args[0])}"
    if typing.get_origin(annotation) is Literal:
        return _one_of([str(a) for a in args])
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _one_of([m.value for m in annotation])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    text = _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))
    limits = [c for c in map(_constraint, metadata) if c]
    return " ".join([text, *limits])


def _one_of(values: list[str]) -> str:
    quoted = [f"`{v}`" for v in values]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _constraint(meta: Any) -> str | None:
    for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if getattr(meta, attr, None) is not None:
            return f"{op} {getattr(meta, attr)}"
    if getattr(meta, "pattern", None):
        return f"matching `{meta.pattern}`"
    func = getattr(meta, "func", None)
    return _VALIDATOR_TEXT.get(getattr(func, "__name__", ""))


def unexplained_validators() -> list[str]:
    """AfterValidator functions in the schema whose constraint _VALIDATOR_TEXT does not state."""
    found: set[str] = set()

    def walk(annotation: Any) -> None:
        if typing.get_origin(annotation) is Annotated:
            found.update(getattr(getattr(m, "func", None), "__name__", "") for m in
                         typing.get_args(annotation)[1:])
        for arg in typing.get_args(annotation):
            walk(arg)

    for _, _, field in _keys():
        walk(field.annotation)
    return sorted(found - {""} - set(_VALIDATOR_TEXT))


def key_type(path: str, name: str, field: FieldInfo) -> str:
    if path in TYPE_OVERRIDES:
        return TYPE_OVERRIDES[path]
    nested = _models_in(field.annotation)
    if nested:
        link = f"[mapping](#{anchor(path)})"
        return f"{link} or null" if not field.is_required() and field.default is None else link
    if path == name and name in AXES:  # a sweepable axis is stored as a list, written as either
        item = type_text(typing.get_args(field.annotation)[0])
        return f"{item}; or a list of these (swept)"
    return type_text(field.annotation, list(field.metadata))


def default_text(path: str, name: str, field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if path == name and name in AXES and isinstance(value, list) and len(value) == 1:
        value = value[0]  # an axis of one value is written as the value
    return f"`{_yaml(value)}`"


def _yaml(value: Any) -> str:
    plain = to_jsonable_python(value)
    text = yaml.safe_dump(plain, default_flow_style=True, sort_keys=False, width=10_000).strip()
    return text.removesuffix("...").strip()


def description(path: str, field: FieldInfo) -> str:
    return field.description or DESCRIPTIONS.get(path) or UNDESCRIBED


def undescribed() -> list[str]:
    """Key paths that have neither a Field description nor an entry in DESCRIPTIONS."""
    return [p for p, _, f in _keys() if description(p, f) == UNDESCRIBED]


def _keys() -> list[tuple[str, str, FieldInfo]]:
    return [(f"{s.path}.{n}" if s.path else n, n, f)
            for s in sections() for n, f in _fields(s.model).items()]


_INTRO = """\
# Study spec reference

<!-- GENERATED from the pydantic schema (platform/scalestudy/spec/study.py, spec/trial.py,
     spec/catalog.py) by `{cmd}`.
     Do not edit: tests/unit/test_spec_reference.py fails when this page is stale. -->

Every key a study YAML (`experiments/*.yaml`) may hold, with its default. A commented spec with
every key at its default, to copy for your own study:
[experiments/TEMPLATE.yaml](../experiments/TEMPLATE.yaml).
Unknown keys are refused (exit 2, one line naming the key and the valid ones). Any key marked
*swept* takes one value or a list; the study runs every combination of the listed values (the grid),
or a sample of it (`search`). `--set KEY=VALUE` on the command line overrides a key (`--set
steps.measure=5`, `--set "world_size=[1, 2]"`, `--set model.hidden_size=128`).
Derived per trial: dp = world_size / (tp x pp), grad_accum, tokens per step = global_batch x
seq_len, nodes ([concepts](concepts.md)).
"""


def _table(section: Section) -> list[str]:
    heading = "## Top-level keys" if not section.path else f"## {section.path}"
    doc = " ".join(line.strip() for line in (section.model.__doc__ or "").splitlines()).strip()
    note = SECTION_NOTES.get(section.path) or doc
    lines = [heading, ""] + ([note, ""] if section.path and note else [])
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in _fields(section.model).items():
        path = f"{section.path}.{name}" if section.path else name
        lines.append(f"| `{name}` | {key_type(path, name, field)} | "
                     f"{default_text(path, name, field)} | {description(path, field)} |")
    return [*lines, ""]


def render() -> str:
    lines = [_INTRO.format(cmd=REGENERATE)]
    for section in sections():
        lines += _table(section)
    lines += ["## Catalogues", "",
              "Models (`model:`): " + ", ".join(f"`{m}`" for m in catalog.model_names()) + ".", "",
              "Hardware (`hardware:`): " + ", ".join(f"`{h}`" for h in catalog.hardware_names())
              + ".", ""]
    return "\n".join(lines)


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
