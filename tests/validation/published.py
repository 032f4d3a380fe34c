"""Published training rows (data/calibration.yaml, data/validation.yaml) as the performance model sees
them: a TrialConfig, the row's own hardware profile and model parameters, and the published
throughput in tokens/s per GPU. Schema and provenance: data/SOURCES.md and the files' headers.

What a row does not print is assumed in the data file, per row (`assumed`, `assumed_reason`), and
how a source maps onto the model beyond its rows is the source's `model_settings` in the data file:
each with its reason from the source or its software's era and whether it was chosen before or after
the rows were first scored (a row carrying an after-scoring setting keeps, in `without`, the
parameters it would have without them, so the test can print both errors). Two mapping rules hold
for every source, written here:
  * uneven pipeline stages run at the pace of the fullest stage (see _row);
  * FSDP hybrid sharding (HSDP) is scored as full sharding over every GPU: the model has no
    replicated-shard groups, and full sharding moves more bytes over the network (a bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from scalestudy.perfmodel.memory import memory_breakdown
from scalestudy.perfmodel.params import FIELDS, ModelParams, params_for
from scalestudy.spec import catalog
from scalestudy.spec.catalog import HardwareProfile, ModelDims
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import TrialConfig, expand

DATA = Path(__file__).parent / "data"
BEFORE, AFTER = "before_first_scoring", "after_first_scoring"
NETWORK = "network_gbit_per_node"
ROW_FIELDS = ("activation_checkpointing",)  # settings that correct a row field rather than a parameter
FILTERS = ("zero_stage", "activation_checkpointing_mode")  # row fields a setting may be limited to
LAYOUT_KEYS = ("sequence_parallel", "cp", "tp_comm_overlap", "fp8", "gather_granularity")


@dataclass
class Row:
    id: str
    source: str
    group: str
    published: float            # tokens/s per GPU
    cfg: TrialConfig | None     # None: the spec rejects the row (reason says why)
    hardware: HardwareProfile | None
    params: ModelParams | None
    reason: str = ""
    core: bool = False
    notes: list[str] = field(default_factory=list)
    after_scoring: list[str] = field(default_factory=list)  # settings chosen after first scoring
    # (config, hardware, params) without the after-scoring settings; None when the row has none
    without: tuple[TrialConfig, HardwareProfile, ModelParams] | None = None
    memory_gib: float = 0.0     # what the memory model says the row needs per device
    # A row over the row bound that was investigated and left as it was (the data's `known_miss`:
    # error when first seen over the bound, and where the investigation is written). Recorded, never
    # tuned away: the row is still scored and counted in the MAPE.
    known_miss: dict | None = None
    # The software stack the run used (issue 35, item 8): the unit its software_efficiency is
    # fitted over (from the family's rows of the other sources only, test_published.py).
    family: str = ""

    @property
    def chip(self) -> str:
        """Rows of one chip share compute efficiencies (a100-40gb and a100-80gb are one A100)."""
        return self.hardware.name.split("-")[0] if self.hardware else ""

    @property
    def layout(self) -> str:
        c = self.cfg
        return f"tp{c.tp}pp{c.pp}z{c.zero_stage}mb{c.micro_batch}" if c else ""

    @property
    def memory_disagrees(self) -> bool:
        """The memory model says this published run, which ran, does not fit its device."""
        return bool(self.hardware) and self.memory_gib > self.hardware.hbm_gib


def _dims(model) -> ModelDims:
    return catalog.get_model(model) if isinstance(model, str) else ModelDims(**model)


def tokens_per_s_per_gpu(row: dict, dims: ModelDims) -> float:
    """The published figure as tokens/s per GPU, with the source's own FLOP count."""
    if "tokens_per_s_per_gpu" in row:
        return float(row["tokens_per_s_per_gpu"])
    s = row["seq_len"]
    if row.get("flops_formula") == "megatron_eq3":  # Narayanan et al. 2021, eq. (3)
        h, l, v = dims.hidden_size, dims.num_layers, dims.vocab_size
        per_token = 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    elif row.get("flops_formula") == "nemo_llama2":  # NeMo flops_formulas.llama2, no causal halving
        h, l, v, f = dims.hidden_size, dims.num_layers, dims.vocab_size, dims.ffn
        per_token = l * h * h * (12 + 12 * dims.kv_heads / dims.num_heads + 18 * f / h
                                 + 12 * s / h + 6 * v / (l * h))
    else:  # palm_6n_attn: 6 N (all parameters) + 12 l h s
        per_token = 6 * dims.num_params() + 12 * dims.num_layers * dims.hidden_size * s
    if "tflops_per_gpu" in row:
        return row["tflops_per_gpu"] * 1e12 / per_token
    return row["mfu"] * row["mfu_peak_tflops"] * 1e12 / per_token


def settings_for(src: dict, row: dict) -> list[dict]:
    """The source's model_settings that apply to this row (filters: FILTERS, hardware)."""
    out = []
    for s in src.get("model_settings", []):
        if s["chosen"] not in (BEFORE, AFTER) or not s.get("reason"):
            raise ValueError(f"{src['source_group']}: setting {s['setting']} needs a reason and "
                             f"chosen: {BEFORE} | {AFTER}")
        if s["setting"] not in (NETWORK, *ROW_FIELDS, *FIELDS):
            raise ValueError(f"{src['source_group']}: unknown setting {s['setting']}")
        if any(k in s and s[k] != row.get(k) for k in FILTERS):
            continue
        if "hardware" in s and s["hardware"] != src["hardware"]:
            continue
        out.append(s)
    return out


def _apply(hw: HardwareProfile, row: dict, settings: list[dict]) -> tuple[HardwareProfile, ModelParams]:
    gbit = next((s["value"] for s in settings if s["setting"] == NETWORK), None)
    if gbit:
        hw = hw.model_copy(update={"network_gbps_per_gpu": gbit / 8 / hw.gpus_per_node})
    software = {s["setting"]: s["value"] for s in settings
                if s["setting"] != NETWORK and s["setting"] not in ROW_FIELDS}
    if row.get("virtual_stages"):  # the row's printed interleaving (VP): chunks per pipeline rank
        software.setdefault("pipeline_virtual_stages", row["virtual_stages"])
    return hw, params_for(hw, fused_attention=row["attention"] == "flash", **software)


def _build(src: dict, row: dict, dims: ModelDims, settings: list[dict], notes: list[str]):
    """(planned trial, hardware, params) of a row under the given settings."""
    row = {**row, **{s["setting"]: s["value"] for s in settings if s["setting"] in ROW_FIELDS}}
    (planned,) = expand(validate_spec(_spec(src, row, dims, notes)))
    if not planned.feasible:
        return planned, None, None
    hw, params = _apply(planned.config.hardware_profile, row, settings)
    return planned, hw, params


def _spec(src: dict, row: dict, dims: ModelDims, notes: list[str]) -> dict:
    spec = {"name": "published", "backend": "simulate", "model": row["model"],
            "hardware": src["hardware"], "seq_len": row["seq_len"], "precision": row["precision"],
            "world_size": row["gpus"], "tp": row["tp"], "pp": row["pp"],
            "zero_stage": row["zero_stage"], "micro_batch": row["micro_batch"],
            "global_batch": row["global_batch"],
            "activation_checkpointing": row["activation_checkpointing"]}
    # Issue 35's layout options, as the row prints (or assumes) them.
    spec.update({k: row[k] for k in LAYOUT_KEYS if k in row})
    if dims.num_layers % row["pp"]:
        # Uneven stages (Megatron/DeepSpeed allow them; the spec does not): the pipeline runs at the
        # pace of its fullest stage, ceil(L / pp) blocks, so the row is scored as a model whose
        # every stage holds that many (+1.6% blocks for Llama 3 405B, +2.9% for BLOOM).
        blocks = row["pp"] * -(-dims.num_layers // row["pp"])
        spec["model"] = dims.model_copy(update={"num_layers": blocks}).model_dump()
        notes.append(f"stages of {blocks // row['pp']} blocks")
    if row.get("fsdp_mode", "").startswith("hybrid"):
        notes.append("HSDP as full shard")
    if row.get("fsdp_mode") and row["zero_stage"] == 3:
        # PyTorch FSDP wraps every transformer block as one unit (issue 35's mapping rule for
        # every FSDP row alike): one gather per block, not DeepSpeed's per-module fetch.
        spec["gather_granularity"] = "block"
    return spec


def _known_miss(row: dict) -> dict | None:
    miss = row.get("known_miss")
    if miss is None:
        return None
    if set(miss) != {"first_seen", "error_when_seen", "investigated"} or len(miss["investigated"]) < 20:
        raise ValueError(f"{row['id']}: known_miss needs first_seen, error_when_seen and where the "
                         f"investigation is written (investigated); got {miss}")
    return miss


def _row(src: dict, row: dict) -> Row:
    dims = _dims(row["model"])
    base = dict(id=row["id"], source=src["source"], group=src["source_group"],
                published=tokens_per_s_per_gpu(row, dims), core=bool(row.get("core")),
                known_miss=_known_miss(row),
                family=row.get("framework_family") or src.get("framework_family", ""))
    notes: list[str] = []
    settings = settings_for(src, row)
    planned, hw, params = _build(src, row, dims, settings, notes)
    if not planned.feasible:
        return Row(**base, cfg=None, hardware=None, params=None, reason=planned.reason)
    after = [s for s in settings if s["chosen"] == AFTER]
    without = None
    if after:
        first, hw0, params0 = _build(src, row, dims, [s for s in settings if s not in after], [])
        if first.feasible:
            without = (first.config.model_copy(update={"hardware_profile": hw0}), hw0, params0)
    notes += [f"{s['setting']}={s['value']}" for s in settings]
    cfg = planned.config.model_copy(update={"hardware_profile": hw})
    memory = memory_breakdown(cfg, fused_attention=params.fused_attention).total_gib
    return Row(**base, cfg=cfg, hardware=hw, params=params, notes=notes,
               after_scoring=[f"{s['setting']}={s['value']}" for s in after], without=without,
               memory_gib=memory)


def load(name: str, kind: str = "end_to_end") -> list[Row]:
    """Rows of data/<name>.yaml (calibration kernel rows are skipped unless kind='kernel')."""
    out = []
    for src in yaml.safe_load((DATA / name).read_text()):
        if src.get("kind", "end_to_end") != kind:
            continue
        out += [_row(src, row) for row in src["rows"]]
    return out


def raw(name: str) -> list[dict]:
    return yaml.safe_load((DATA / name).read_text())
