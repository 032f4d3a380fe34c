"""Tensor-parallel all-reduces per block as each implementation issues them (perfmodel/parallelism.py):
Megatron's two in backward, DeepSpeed AutoTP's one per column-parallel Linear."""

from __future__ import annotations

import pytest

from scalestudy.perfmodel import parallelism as par
from scalestudy.perfmodel.params import params_for
from scalestudy.spec import catalog
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand
from scalestudy.spec.trial import Backend


def _cfg(model: str, hardware: str = "h100-80gb", **axes):
    data = {"name": "t", "model": model, "hardware": hardware, "backend": "simulate",
            "world_size": 8, "tp": 8, "seq_len": 2048, "micro_batch": 1, "zero_stage": 1, **axes}
    (p,) = expand(validate_spec(data))
    assert p.config is not None, p.reason
    return p.config


def _tp_calls_per_layer(cfg, **params) -> float:
    p = params_for(cfg.hardware_profile, **params)
    # The blocks' all-reduces: the most frequent TP collective (AutoTP's gathered LM head adds
    # one all-gather and one all-reduce per micro-batch: test below)
    tp = max((c for c in par.communication(cfg, p) if c.group == "tp"), key=lambda c: c.calls_per_step)
    return tp.calls_per_step / (cfg.grad_accum * cfg.model_dims.num_layers)


@pytest.mark.parametrize("model, autotp_backward", [("llama2-7b", 5), ("gpt2-tiny", 4)])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_backward_all_reduces_megatron_against_autotp(model, autotp_backward, checkpointing):
    cfg = _cfg(model, activation_checkpointing=checkpointing)
    recompute = 2 if checkpointing else 0  # the row-parallel forward all-reduces, again
    assert _tp_calls_per_layer(cfg) == 2 + 2 + recompute  # the catalogue's default: Megatron
    assert _tp_calls_per_layer(cfg, tp_all_reduce_per_linear=True) == 2 + autotp_backward + recompute


def test_profiles_of_this_platforms_trials_price_autotp():
    """cpu-local only ever runs this platform's trials; a published-row GPU profile keeps Megatron."""
    assert params_for(catalog.get_hardware("cpu-local")).tp_all_reduce_per_linear
    assert not params_for(catalog.get_hardware("a100-80gb")).tp_all_reduce_per_linear


def test_a_measured_trial_is_priced_as_the_autotp_it_ran():
    """The TP implementation is how a trial runs, not what the hardware is: a trial of the measure
    backend ran this platform's AutoTP, so a catalogue GPU profile (Megatron by default) prices its
    backward all-reduces per column-parallel Linear; a simulated point keeps the profile's choice."""
    simulated = _cfg("llama2-7b")
    measured = simulated.model_copy(update={"backend": Backend.measure})
    assert _tp_calls_per_layer(simulated) == 2 + 2
    assert _tp_calls_per_layer(measured) == 2 + 5


@pytest.mark.parametrize("model, head_ranks, gathers", [("llama2-7b", 8, 1), ("gpt2-tiny", 1, 0)])
def test_autotp_lm_head_as_deepspeed_splits_it(model, head_ranks, gathers):
    """AutoTP (training): an untied head column-parallel, its logits all-gathered before a loss over
    the whole vocabulary; a head tied to the embedding (gpt2-tiny's OPT blocks) left whole on every
    rank. Megatron: a vocab-parallel head and loss. perfmodel/layouts.lm_head_split."""
    from scalestudy.perfmodel import layouts
    from scalestudy.perfmodel.compute import compute_times

    cfg = _cfg(model, seq_len=512)
    megatron, autotp = params_for(cfg.hardware_profile), params_for(
        cfg.hardware_profile, tp_all_reduce_per_linear=True)
    vocab = cfg.model_dims.vocab_size
    assert layouts.lm_head_split(cfg, megatron) == (8, vocab / 8)
    assert layouts.lm_head_split(cfg, autotp) == (head_ranks, vocab)
    logits = [c for c in par.communication(cfg, autotp) if c.group == "tp" and c.kind == "all_gather"]
    assert len(logits) == gathers
    if gathers:
        assert logits[0].bytes_per_call == cfg.micro_batch * cfg.seq_len * vocab * 2  # bf16 logits
    assert not [c for c in par.communication(cfg, megatron) if c.kind == "all_gather"]
    # The tied head's whole GEMM and the whole-vocabulary loss cost more compute than Megatron's
    assert compute_times(cfg, autotp).forward_s > compute_times(cfg, megatron).forward_s


def test_zero3_gathers_autotp_embedding_whole():
    """Under AutoTP every tp rank holds the whole embedding (checked with torchrun: Embedding
    (3072, 128) at tp 2), so ZeRO-3 gathers all of it; Megatron's vocab-parallel embedding 1/tp."""
    cfg = _cfg("llama2-7b", world_size=16, tp=8, zero_stage=3)
    megatron, autotp = params_for(cfg.hardware_profile), params_for(
        cfg.hardware_profile, tp_all_reduce_per_linear=True)
    whole = cfg.model_dims.embedding_params()
    assert par._plan(cfg, autotp).emb == whole
    assert par._plan(cfg, megatron).emb == pytest.approx(whole / 8)
    assert par._plan(cfg, autotp).head == par._plan(cfg, megatron).head  # untied: split either way
