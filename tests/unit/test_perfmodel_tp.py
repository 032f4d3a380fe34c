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
    (tp,) = [c for c in par.communication(cfg, p) if c.group == "tp"]
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
