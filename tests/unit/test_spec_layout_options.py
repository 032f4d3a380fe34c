"""Issue 35's spec fields: sequence_parallel, cp, gather_granularity, tp_comm_overlap, fp8 and the
activation_checkpointing words none | full | selective. At their defaults every trial keeps the id
it had before they existed; each combination that cannot run is refused with its reason."""

from __future__ import annotations

import pytest

from scalestudy.errors import ReasonClass
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand
from scalestudy.spec.trial import (
    TrialConfig, config_from_row, name_axes_of, trial_key, trial_name)

# Trial ids computed before the fields existed (the code at HEAD ef27d3a, 2026-12-06), for
# profiles issue 35 left unchanged (h100/h200 gained an FP8 peak, which is part of their ids).
GOLDEN = {
    ("g1", 64, 1, 1, True): "8887e4eb5c98", ("g1", 64, 1, 3, True): "c6f87765532a",
    ("g1", 512, 2, 3, False): "7c2a4cc7a9bd", ("g1", 64, 2, 1, True): "9f663ed7e4b0",
    ("g2", 2, 1, 3, False): "023254228438", ("g2", 1, 1, 0, False): "a093b87bd978",
}
SPECS = {
    "g1": {"name": "g1", "backend": "simulate", "model": "llama2-7b", "hardware": "a100-80gb",
           "seq_len": 4096, "precision": "bf16", "world_size": [64, 512], "zero_stage": [1, 3],
           "tp": [1, 2], "micro_batch": 1, "global_batch": 512,
           "activation_checkpointing": [False, True]},
    "g2": {"name": "g2", "backend": "measure", "model": "llama2-tiny", "hardware": "cpu-local",
           # bf16 named: `auto` resolved to it on the CPU (native bf16) where the ids were taken,
           # and to fp32 on one without (AMD Zen 3), whose ids differ by their precision
           "precision": "bf16", "seq_len": 128, "world_size": [1, 2], "zero_stage": [0, 3], "micro_batch": [1, 4]},
}


def _ids(spec: dict) -> dict:
    return {(spec["name"], c.world_size, c.tp, c.zero_stage, c.activation_checkpointing): c.trial_id
            for c in (p.config for p in expand(validate_spec(spec))) if c.micro_batch == 1}


def test_trial_ids_at_the_defaults_are_the_ids_before_the_fields():
    ids = {**_ids(SPECS["g1"]), **_ids(SPECS["g2"])}
    for key, value in GOLDEN.items():
        assert ids[key] == value, key
    # the words of the checkpointing axis name the booleans: same trials, same ids
    words = {**SPECS["g1"], "activation_checkpointing": ["none", "full"]}
    assert _ids(words) == _ids(SPECS["g1"])


@pytest.mark.parametrize("option", [{"sequence_parallel": True}, {"cp": 2},
                                    {"gather_granularity": "block"}, {"tp_comm_overlap": True},
                                    {"activation_checkpointing": "selective"}])
def test_each_option_is_part_of_the_id_and_the_key(option):
    base = {**SPECS["g1"], "world_size": 64, "zero_stage": 3, "tp": 2, "activation_checkpointing": True}
    (a,) = [p.config for p in expand(validate_spec(base))]
    (b,) = [p.config for p in expand(validate_spec({**base, **option}))]
    assert a.trial_id != b.trial_id and trial_key(a) != trial_key(b)
    # a ledger row written before the options existed has the defaults' key
    row = a.config_fields()
    old = {k: v for k, v in row.items() if k not in ("sequence_parallel", "cp", "gather_granularity",
                                                     "tp_comm_overlap", "fp8", "recompute_granularity")}
    assert trial_key(old) == trial_key(a)
    assert config_from_row(b.config_fields()).trial_id == b.trial_id


def _refusal(**kw):
    base = {"name": "r", "backend": "simulate", "model": "llama2-7b", "hardware": "h100-80gb",
            "seq_len": 4096, "precision": "bf16", "world_size": 64, "zero_stage": 3, "tp": 2,
            "micro_batch": 1, "global_batch": 64}
    (p,) = expand(validate_spec({**base, **kw}))
    return p.reason, p.reason_class


@pytest.mark.parametrize("kw, words, cls", [
    ({"sequence_parallel": True, "tp": 1}, "needs tp > 1", ReasonClass.layout),
    ({"tp_comm_overlap": True, "tp": 1}, "needs tp > 1", ReasonClass.layout),
    ({"cp": 3}, "does not divide", ReasonClass.layout),
    ({"cp": 4, "seq_len": 4092}, "multiple of 8", ReasonClass.model),
    ({"gather_granularity": "block", "zero_stage": 1}, "zero_stage is 1", ReasonClass.layout),
    ({"fp8": True, "hardware": "a100-80gb"}, "no FP8 peak", ReasonClass.precision),
    ({"fp8": True, "precision": "fp32"}, "precision is fp32", ReasonClass.precision),
    ({"sequence_parallel": True, "backend": "measure", "world_size": 8, "global_batch": 8},
     "measure backend", ReasonClass.backend),
])
def test_impossible_combinations_are_refused_with_their_reason(kw, words, cls):
    reason, reason_class = _refusal(**kw)
    assert reason and words in reason and reason_class is cls


def test_names_show_swept_options_and_selective_recomputation():
    spec = {**SPECS["g1"], "world_size": 64, "zero_stage": 3, "tp": 2,
            "activation_checkpointing": ["full", "selective"], "sequence_parallel": [False, True]}
    cfgs = [p.config for p in expand(validate_spec(spec))]
    names = [c.run_name for c in cfgs]
    assert len(set(names)) == len(names) == 4
    assert any(n.endswith("-acsel-sp1") for n in names)
    assert set(name_axes_of(cfgs)) == {"activation_checkpointing", "sequence_parallel"}
    assert trial_name(cfgs[0].config_fields(), name_axes_of(cfgs)) == names[0]
    assert isinstance(cfgs[0], TrialConfig)


def test_the_measure_backend_runs_selective_recomputation_and_refuses_the_other_options():
    base = {"backend": "measure", "world_size": 8, "global_batch": 8, "zero_stage": 1, "tp": 1}
    reason, _ = _refusal(**base, activation_checkpointing="selective")
    assert reason is None
    reason, cls = _refusal(**{**base, "global_batch": 4}, activation_checkpointing="selective",
                           cp=2)
    assert "cp" in reason and "recompute_granularity" not in reason and cls is ReasonClass.backend
