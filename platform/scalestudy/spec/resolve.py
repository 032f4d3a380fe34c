"""A spec's models and hardware resolved from what it writes: a catalogue name, a mapping of dims
or `{name, dims}`, a profile file (also relative to the spec's folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from scalestudy.spec import catalog
from scalestudy.spec.catalog import HardwareProfile, ModelDims
from scalestudy.spec.sections import NamedModel


def one_per_name(named: list[tuple[str, Any]], what: str, fix: str) -> None:
    """A name is its axis' column in the ledger, MLflow and every figure, and a trial's point
    (resolve_point) finds its model and hardware by name: two of one name would run, be drawn and
    be paired with predictions as one."""
    first: dict[str, Any] = {}
    for name, value in named:
        if first.setdefault(name, value) != value:
            raise ValueError(f"two {what} are both named {name!r}; {fix}")


def resolve_model(x: Any) -> NamedModel:
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
