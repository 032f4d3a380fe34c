"""The performance model against published training throughput (data/published_anchors.yaml).

One parameter set for every row (the catalogue profile's); a row only states its own setup (model,
degrees, batch, precision, checkpointing, attention kernel). Prints a per-row error table and fails
past a mean absolute percentage error of 25% (target 15%).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from scalestudy.perfmodel.params import params_for
from scalestudy.perfmodel.predict import predict
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand

DATA = Path(__file__).parent / "data" / "published_anchors.yaml"
MAPE_BOUND = 0.25


def _megatron_tokens_per_s(row: dict, seq_len: int) -> float:
    m = row["model"]
    h, l, v = m["hidden_size"], m["num_layers"], m.get("vocab_size", 51200)
    flops = 96 * l * h * h * (1 + seq_len / (6 * h) + v / (16 * l * h))
    return row["tflops_per_gpu"] * 1e12 / flops


def anchor_rows() -> list[dict]:
    out = []
    for src in yaml.safe_load(DATA.read_text()):
        for row in src["rows"]:
            spec = {
                "name": "published", "backend": "simulate", "model": row["model"],
                "hardware": src["hardware"], "seq_len": src["seq_len"],
                "precision": src["precision"], "world_size": row["gpus"],
                "tp": row.get("tp", 1), "pp": row.get("pp", 1),
                "zero_stage": src["zero_stage"], "micro_batch": row["micro_batch"],
                "global_batch": row.get("global_batch"),
                "activation_checkpointing": row.get("activation_checkpointing",
                                                    src.get("activation_checkpointing", False)),
            }
            (planned,) = expand(validate_spec(spec))
            assert planned.feasible, planned.reason
            published = (row["tokens_per_s_per_gpu"] if "tokens_per_s_per_gpu" in row
                         else _megatron_tokens_per_s(row, src["seq_len"]))
            out.append({"source": src["source"].split(",")[0], "cfg": planned.config,
                        "fused_attention": src["fused_attention"], "published": published})
    return out


def test_published_throughput_mape():
    errors = []
    print(f"\n{'source':38s} {'model':26s} {'gpus':>5s} {'published':>10s} {'predicted':>10s} {'error':>7s}")
    for row in anchor_rows():
        cfg = row["cfg"]
        params = params_for(cfg.hardware_profile, fused_attention=row["fused_attention"])
        result = predict(cfg, params=params)
        assert result.status.value == "completed", result.reason
        err = result.tokens_per_s_per_device / row["published"] - 1
        errors.append(abs(err))
        print(f"{row['source'][:38]:38s} {cfg.model[:26]:26s} {cfg.world_size:5d} "
              f"{row['published']:10.1f} {result.tokens_per_s_per_device:10.1f} {err:+7.1%}")
    mape = sum(errors) / len(errors)
    print(f"MAPE {mape:.1%} over {len(errors)} rows (bound {MAPE_BOUND:.0%}, target 15%)")
    assert mape <= MAPE_BOUND
