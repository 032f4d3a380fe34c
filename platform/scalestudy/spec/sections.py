"""The study spec's small sections (search, tracking, workers), its named models and the
per-element validators of its axes (an error names the offending list element and its value)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, PositiveInt

from scalestudy.spec.catalog import ModelDims


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


def as_list(v: Any) -> list:
    """Sweepable axes take a scalar or a list; both are stored as a non-empty list."""
    if isinstance(v, list):
        if not v:
            raise ValueError("an axis list must not be empty")
        return v
    return [v]
