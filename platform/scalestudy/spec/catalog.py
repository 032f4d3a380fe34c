"""Model and hardware catalogues: dimensions and device figures as typed data.

Parameter counts are derived from the dimensions so they cannot drift from the architecture.
"""

from __future__ import annotations

import functools
import json
from enum import Enum
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

_HERE = Path(__file__).parent


class Precision(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"

    @property
    def bytes(self) -> int:
        return 4 if self is Precision.fp32 else 2


class ModelDims(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: Literal["llama", "gpt"] = "llama"
    hidden_size: PositiveInt
    num_layers: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt | None = None  # None: multi-head attention (= num_heads)
    ffn_hidden_size: PositiveInt | None = None  # None: 4h (gpt) or Llama's 8/3 h rounded to 256
    vocab_size: PositiveInt = 32000
    max_seq_len: PositiveInt = 4096

    @model_validator(mode="after")
    def _buildable(self) -> "ModelDims":
        """Dims the model factory (train/model_factory.py) can build: checked when the spec loads,
        not when a worker builds the model minutes later."""
        h, a = self.hidden_size, self.num_heads
        if h % a:
            raise ValueError(f"hidden_size {h} is not divisible by num_heads {a}: each head gets "
                             "hidden_size / num_heads channels; choose dims that divide")
        if self.architecture == "llama" and (h // a) % 2:
            # rotary embeddings rotate channel pairs: an odd head_dim leaves one channel unpaired
            raise ValueError(f"head_dim = hidden_size / num_heads = {h // a} is odd: Llama's rotary "
                             "embeddings need an even head_dim; choose dims that give one")
        if self.num_kv_heads is not None and a % self.num_kv_heads:
            raise ValueError(f"num_heads {a} is not divisible by num_kv_heads {self.num_kv_heads}: "
                             "grouped-query attention shares each KV head among whole groups")
        # The gpt blocks are built as Hugging Face's OPT (train/model_factory.py), which has no GQA.
        if self.architecture == "gpt" and self.num_kv_heads not in (None, self.num_heads):
            raise ValueError(f"num_kv_heads {self.num_kv_heads}: gpt blocks use multi-head attention; "
                             f"set it to num_heads ({self.num_heads}) or leave it out")
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.architecture == "gpt":
            return 4 * self.hidden_size
        return 256 * ((int(8 * self.hidden_size / 3) + 255) // 256)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        h, f = self.hidden_size, self.ffn
        kv = self.kv_heads * self.head_dim
        if self.architecture == "llama":
            attn = h * h + 2 * h * kv + h * h  # q, k, v (GQA-narrowed), o; no biases
            mlp = 3 * h * f  # gate, up, down (SwiGLU)
            norms = 2 * h  # RMSNorm weights
        else:
            attn = (h * h + 2 * h * kv + h * h) + (h + 2 * kv + h)  # with biases
            mlp = 2 * h * f + f + h
            norms = 2 * 2 * h  # LayerNorm weight + bias
        return attn + mlp + norms

    def embedding_params(self) -> int:
        """Lookup tables (token, and learned positions for gpt): no matmul FLOPs."""
        pos = self.max_seq_len * self.hidden_size if self.architecture == "gpt" else 0
        return self.vocab_size * self.hidden_size + pos

    def lm_head_params(self) -> int:
        """Output projection weights stored separately (0 when tied to the embedding, as in GPT)."""
        return 0 if self.architecture == "gpt" else self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        final_norm = self.hidden_size * (2 if self.architecture == "gpt" else 1)
        return (
            self.embedding_params()
            + self.num_layers * self.layer_params()
            + final_norm
            + self.lm_head_params()
        )


# Profile fields that say where a trial runs or what it costs, not what it measures: left out of
# trial ids.
PLACEMENT_FIELDS = frozenset({"accelerator_type", "cpus_per_device", "device_resource",
                              "usd_per_device_hour"})


class HardwareProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: Literal["gpu", "cpu"]
    description: str = ""
    peak_tflops: dict[Precision, PositiveFloat]
    hbm_gib: PositiveFloat
    hbm_gbps: PositiveFloat
    gpus_per_node: PositiveInt
    nvlink_gbps_per_gpu: PositiveFloat
    network_gbps_per_gpu: PositiveFloat
    tdp_w: PositiveFloat
    idle_w: float = Field(ge=0)
    node_overhead_w: float = Field(ge=0)
    # Where a measured trial runs (launch/placement.py), not what it measures, so not hashed into
    # trial ids: Ray's accelerator type of the device (ray.util.accelerators, as Ray detects it on a
    # node: "A100", "H100"), the CPUs each worker reserves beside its device (a DGX node's cores
    # shared by its GPUs; a cpu profile's device is itself a core) and the Ray resource one device
    # is (None: "GPU" on gpu profiles, "CPU" on cpu ones; a custom name on fake test clusters).
    accelerator_type: str | None = None
    cpus_per_device: PositiveFloat = 1.0
    device_resource: str | None = None
    # What one device costs an hour (`scalestudy plan --objective usd_per_token`); None: not known,
    # give --usd-per-device-hour. Catalogue figures are list prices: override with yours.
    usd_per_device_hour: PositiveFloat | None = None
    # Filled by `scalestudy calibrate`/`fit`; the performance model reads them when present.
    calibration: dict[str, float | list[list[float]]] = Field(default_factory=dict)

    def peak_flops(self, precision: Precision) -> float:
        return self.peak_tflops[precision] * 1e12

    # The one place that tells a GPU profile from a CPU one: everything that differs by device
    # kind (process-group backend, Ray resources, meters, memory overheads) asks these.
    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    @property
    def process_group_backend(self) -> str:
        """torch.distributed backend of a trial's workers: NCCL between GPUs, gloo between cores."""
        return "nccl" if self.is_gpu else "gloo"

    @property
    def ray_device_resource(self) -> str:
        """The Ray resource one device is: "GPU", "CPU" (a cpu profile's device is a core), or a
        custom name on fake test clusters."""
        return self.device_resource or ("GPU" if self.is_gpu else "CPU")

    def ray_resources_per_worker(self) -> dict[str, float]:
        """One device and the profile's CPUs beside it (a cpu profile's device is its core)."""
        device = self.ray_device_resource
        if device == "CPU":
            return {"CPU": self.cpus_per_device}
        return {device: 1.0, "CPU": self.cpus_per_device}

    @functools.cached_property
    def identity_json(self) -> str:
        """What the profile measures as canonical JSON (sorted keys, placement fields left out): its
        part of every trial id. Cached because its calibration curves are most of a trial's hashed
        payload and one profile object is shared by the trials of a sweep (get_hardware)."""
        return json.dumps(self.model_dump(mode="json", exclude=set(PLACEMENT_FIELDS)), sort_keys=True)

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> HardwareProfile:
        copied = super().model_copy(update=update, deep=deep)
        copied.__dict__.pop("identity_json", None)  # pydantic copies the instance dict, cache too
        return copied


@functools.cache
def _load(name: str) -> dict:
    with open(_HERE / name) as f:
        return yaml.safe_load(f)


def model_names() -> list[str]:
    return list(_load("models.yaml"))


def hardware_names() -> list[str]:
    return list(_load("hardware.yaml"))


def get_model(name: str) -> ModelDims:
    return ModelDims(**_load("models.yaml")[name])


@functools.cache
def get_hardware(name: str) -> HardwareProfile:
    """The catalogue's profile of that name: one shared (frozen) object per name, so the trials of
    a sweep share it and its cached identity_json."""
    return HardwareProfile(name=name, **_load("hardware.yaml")[name])


def load_hardware_file(path: Path) -> HardwareProfile:
    """A profile YAML -> HardwareProfile. A file that is not UTF-8 YAML of a mapping raises
    ValueError with one line (callers turn it into a SpecError); bad fields raise ValidationError."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"profile {path}: not UTF-8 text (byte {err.start}); give a profile "
                         "YAML written by `scalestudy calibrate`") from None
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"profile {path}: malformed YAML ({problem})") from None
    if not isinstance(data, dict):
        raise ValueError(f"profile {path}: a hardware profile must be a mapping of keys")
    data.setdefault("name", path.stem)
    return HardwareProfile(**data)


def profile_from_file(path: Path, field: str) -> HardwareProfile:
    """A profile file named on the command line (`field`: the option) or SpecError's one line."""
    from pydantic import ValidationError

    from scalestudy.errors import SpecError

    try:
        return load_hardware_file(Path(path))
    except ValidationError as err:
        e = err.errors()[0]
        raise SpecError(field, str(path), f"{'.'.join(map(str, e['loc']))}: {e['msg']}; give a "
                        "profile written by `scalestudy calibrate`") from None
    except (ValueError, OSError) as err:
        raise SpecError(field, str(path), str(err)) from None


def profile_yaml(profile: HardwareProfile) -> str:
    """A profile as YAML that `load_hardware_file` (and a spec's `hardware:`) reads back."""
    return yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False, default_flow_style=None)


def write_profile(profile: HardwareProfile, path: Path) -> None:
    path.write_text(profile_yaml(profile))
