"""Catalogue parameter counts and FLOPs/MFU formulas against hand computations (degrees: test_layout.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scalestudy import metrics as M
from scalestudy.measure.throughput import percentile, throughput_metrics
from scalestudy.perfmodel.flops import hardware_flops_per_token, model_flops_per_token
from scalestudy.spec import catalog
from scalestudy.spec.load import load_spec
from scalestudy.plan import plan_study

REPO = Path(__file__).parents[2]


@pytest.mark.parametrize(
    "name, published_b", [("llama2-7b", 6.74), ("llama2-13b", 13.02), ("llama2-70b", 68.98),
                               ("tinyllama-1.1b", 1.10)]
)
def test_parameter_counts(name, published_b):
    n = catalog.get_model(name).num_params() / 1e9
    assert abs(n - published_b) / published_b < 0.005, n


def test_every_catalogue_entry_loads():
    for name in catalog.model_names():
        assert catalog.get_model(name).num_params() > 0
    for name in catalog.hardware_names():
        hw = catalog.get_hardware(name)
        assert hw.peak_flops(catalog.Precision.bf16) > 0 and hw.hbm_gib > 0


def test_llama2_70b_is_gqa_and_gpt3_has_4h_mlp():
    assert catalog.get_model("llama2-70b").kv_heads == 8
    gpt = catalog.get_model("gpt3-175b")
    assert gpt.ffn == 4 * gpt.hidden_size and gpt.lm_head_params() == 0
    assert abs(gpt.num_params() / 1e9 - 175) / 175 < 0.01


def test_flops_per_token_by_hand():
    m = catalog.get_model("llama2-7b")
    # matmul params = all - token embedding (lm_head is untied, so it stays).
    n_matmul = 6_738_415_616 - 32000 * 4096
    assert model_flops_per_token(m, 4096) == 6 * n_matmul + 12 * 32 * 4096 * 4096
    assert hardware_flops_per_token(m, 4096, True) == pytest.approx(
        8 * n_matmul + 16 * 32 * 4096 * 4096
    )


def test_mfu_by_hand():
    spec = load_spec(REPO / "experiments/quickstart.yaml", ["world_size=2", "zero_stage=0"])
    cfg = plan_study(spec)[0].config
    times = [0.5, 0.4, 0.6, 0.5, 0.45]
    got = throughput_metrics(cfg, times)
    tokens = 8 * 128  # micro_batch 4 x dp 2 x seq 128
    assert got[M.TOKENS_PER_S] == pytest.approx(tokens / 0.5)
    assert got[M.TOKENS_PER_S_PER_DEVICE] == pytest.approx(tokens / 0.5 / 2)
    dims = catalog.get_model("llama2-tiny")
    flops = 6 * (dims.num_params() - 2048 * 64) + 12 * 2 * 64 * 128
    peak = cfg.hardware_profile.peak_flops(cfg.precision)
    assert got[M.MFU] == pytest.approx(flops * tokens / 0.5 / 2 / peak)
    assert got[M.HFU] == got[M.MFU]  # no activation checkpointing
    assert got[M.STEP_TIME_P90_S] == pytest.approx(0.56)


def test_percentile_matches_numpy_linear():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([3.0], 90) == 3.0


def test_trial_id_is_stable_and_distinct():
    planned = plan_study(load_spec(REPO / "experiments/quickstart.yaml"))
    ids = [p.config.trial_id for p in planned]
    assert len(set(ids)) == len(ids)
    again = [p.config.trial_id for p in plan_study(load_spec(REPO / "experiments/quickstart.yaml"))]
    assert ids == again


def test_no_platform_package_shadows_stdlib():
    assert not (REPO / "platform" / "__init__.py").exists()
    assert not (REPO / "platform.py").exists()
    out = subprocess.run(
        [sys.executable, "-c", "import platform; print(platform.system())"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() in {"Linux", "Darwin", "Windows"}
