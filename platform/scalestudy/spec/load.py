"""Load a study YAML (with command-line overrides) into a validated StudySpec.

Every failure becomes one SpecError line: the field, the bad value and what would be valid.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from scalestudy.spec import catalog
from scalestudy.spec.errors import SpecError
from scalestudy.spec.study import StudySpec


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings -> nested dict; VALUE is YAML (`[1, 2]`, `fp32`, `null` all work)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SpecError("--set", pair, "write KEY=VALUE, e.g. --set world_size=2")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _merge(base: dict, over: dict) -> dict:
    merged = dict(base)
    for k, v in over.items():
        merged[k] = _merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def _with_overrides(data: dict, over: dict) -> dict:
    """The spec with --set overrides merged in. `--set model.hidden_size=64` on a catalogue model
    changes that dimension and keeps the catalogue's others (a custom model, named by its dims)."""
    model, dims = data.get("model"), over.get("model")
    if (isinstance(dims, dict) and not {"name", "dims"} & set(dims) and isinstance(model, str)
            and model in catalog.model_names()):
        over = {**over, "model": {**catalog.get_model(model).model_dump(), **dims}}
    return _merge(data, over)


def _format_error(err: dict, data: dict) -> SpecError:
    loc = err["loc"]
    field = ".".join(str(p) for p in loc if not isinstance(p, int))
    idx = [p for p in loc if isinstance(p, int)]
    if idx and field and isinstance(data.get(str(loc[0])), list):
        field = f"{field}[{idx[0]}]"
    if err["type"] == "extra_forbidden":
        section = _section(loc[:-1])
        valid = [k for k in getattr(section, "model_fields", {}) if k != "spec_dir"]
        return SpecError(
            field, err["input"], f"unknown key; valid keys here are {', '.join(valid)}"
        )
    if err["type"] == "missing":
        return SpecError(field, None, "required key is missing")
    msg = err["msg"].removeprefix("Value error, ")
    return SpecError(field or "spec", err.get("input"), msg)


def _section(path: tuple) -> type:
    """The pydantic model a key path leads to (`elastic`, `ensemble`, `steps`...), through optional
    and list annotations; StudySpec for the top level."""
    model: Any = StudySpec
    for part in path:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(str(part))
        if field is None:
            return model
        model = field.annotation
        while typing.get_args(model):  # X | None, list[X]: the model inside
            inner = [a for a in typing.get_args(model) if hasattr(a, "model_fields")]
            if not inner:
                break
            model = inner[0]
    return model


def load_spec_data(path: Path) -> dict[str, Any]:
    if not path.is_file():
        what = "a folder" if path.is_dir() else "file not found"
        raise SpecError("spec", str(path), f"{what}; give the path of a study YAML")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise SpecError("spec", str(path), f"not UTF-8 text (byte {err.start}: "
                        f"{err.object[err.start:err.start + 1]!r}); save the study YAML as UTF-8",
                        source=str(path)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError(
            f"YAML{line}", path.name, f"malformed YAML ({problem}); fix the syntax there",
            source=str(path),
        ) from None
    if not isinstance(data, dict):
        raise SpecError("spec", type(data).__name__, "a study YAML must be a mapping of keys")
    return data


def load_spec(path: str | Path, overrides: list[str] | None = None) -> StudySpec:
    path = Path(path)
    data = _with_overrides(load_spec_data(path), parse_overrides(overrides or []))
    return validate_spec(data, spec_dir=path.parent, source=str(path))


def validate_spec(data: dict[str, Any], spec_dir: Path | None = None, source: str | None = None) -> StudySpec:
    try:
        return StudySpec.model_validate({"spec_dir": spec_dir, **data} if spec_dir else data)
    except ValidationError as err:
        e = _format_error(err.errors()[0], data)
        raise SpecError(e.field, e.value, e.fix, source=source) from None
