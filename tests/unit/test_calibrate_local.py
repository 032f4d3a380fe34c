"""Calibrate's shapes are off every scored CPU study's (issue 15: a calibrated profile scored on the
shapes it was solved from would test replay, not prediction), and its defaults benchmark only the
precision the studies run at."""

from __future__ import annotations

from pathlib import Path

import pytest

from scalestudy.calibrate import run
from scalestudy.calibrate.reference_step import REFERENCE, reference_config
from scalestudy.spec import catalog
from scalestudy.spec.load import load_spec
from scalestudy.plan import plan_study

REPO = Path(__file__).resolve().parents[2]
SCORED = [REPO / "experiments" / "quickstart.yaml", REPO / "experiments" / "cpu_heldout.yaml"]


def _scored_configs():
    return [p.config for spec in SCORED for p in plan_study(load_spec(spec)) if p.feasible]


def test_reference_step_shares_no_model_sequence_or_tokens_with_a_scored_study():
    cfgs = _scored_configs()
    assert len({c.study for c in cfgs}) == 2
    ref = reference_config("fp32", 1)
    assert ref.model not in {c.model for c in cfgs}
    assert ref.seq_len not in {c.seq_len for c in cfgs}
    assert ref.micro_batch * ref.seq_len not in {c.micro_batch * c.seq_len for c in cfgs}
    assert REFERENCE["model"] in catalog.model_names()


@pytest.mark.parametrize("quick", [True, False])
def test_benchmark_shapes_avoid_the_scored_token_counts_and_sequence_lengths(quick):
    cfgs = _scored_configs()
    tokens = {c.micro_batch * c.seq_len for c in cfgs}
    seqs = {c.seq_len for c in cfgs}
    gemm = run.QUICK_SHAPES if quick else run.SHAPES
    attention = run.QUICK_ATTENTION_SHAPES if quick else run.ATTENTION_SHAPES
    loss = run.QUICK_LOSS_SHAPES if quick else run.LOSS_SHAPES
    assert not {m for m, _, _ in gemm} & tokens
    assert not {s for _, _, s, _ in attention} & seqs
    assert not {b * s for b, _, s, _ in attention} & tokens
    assert not {t for t, _ in loss} & tokens
    # The curve reaches past the studies' largest GEMM (the LM head at 2 x 256 tokens).
    largest = max(2 * c.micro_batch * c.seq_len * c.model_dims.hidden_size * c.model_dims.vocab_size
                  for c in cfgs)
    assert max(2 * m * k * n for m, k, n in gemm) > largest


def test_default_precisions_are_what_auto_resolves_to_and_fp32(monkeypatch):
    base = catalog.get_hardware("cpu-local")
    monkeypatch.setenv("SCALESTUDY_CPU_NATIVE_BF16", "0")
    assert run.default_precisions(base) == ["fp32"]  # bf16 emulated: asked for explicitly
    monkeypatch.setenv("SCALESTUDY_CPU_NATIVE_BF16", "1")
    assert run.default_precisions(base) == ["bf16", "fp32"]
    assert run.default_precisions(catalog.get_hardware("h100-80gb")) == ["bf16", "fp32"]


def test_progress_prints_one_line_per_benchmark(capsys):
    say = run.Progress(True, "ws1")
    assert say("gemm fp32", lambda: 3) == 3
    run.Progress(False, "ws2")("silent", lambda: None)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("calibrate [ws1] gemm fp32: ")
