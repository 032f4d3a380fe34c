"""An ensemble study's spec and plan (spec `ensemble:`, plan/ensemble.py): what is refused with one
line, and what a comparison holds (the single model, then k members on N / k devices each, every
trial planned by the one planner with a trial id of its own)."""

from __future__ import annotations

import pytest

from scalestudy.errors import SpecError
from scalestudy.metrics import EnsembleRole
from scalestudy.plan import plan_point, plan_study
from scalestudy.plan.ensemble import plan_ensemble
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import resolve_point
from scalestudy.sweep.ensemble import EnsembleSweep

CPU = {"name": "ens", "model": "llama2-tiny", "hardware": "cpu-local", "world_size": 2,
       "micro_batch": 4}
PAPER = {"name": "ens", "model": "llama2-70b", "hardware": "h100-80gb", "backend": "simulate",
         "seq_len": 4096, "precision": "bf16", "world_size": [1024, 2048], "zero_stage": 3,
         "global_batch": 2048, "activation_checkpointing": True,
         "ensemble": {"members": [1, 2, 4, 8, 16, 32], "member_model": ["llama2-7b", "llama2-13b"],
                      "zero_stage": 3, "global_batch": None}}


def _plan(data):
    spec = validate_spec(data)
    return spec, plan_ensemble(spec, plan_study(spec))


@pytest.mark.parametrize("ensemble, extra, says", [
    ({"members": [3]}, {}, "world_size 2 does not divide into 3 members"),
    ({"members": [2, 2]}, {}, "repeat a value"),
    ({"members": [2]}, {"zero_stage": [0, 1]}, "zero_stage lists 2 values"),
    ({"members": [2]}, {"search": {"algorithm": "random"}}, "use search: {algorithm: grid}"),
    ({"members": [2]}, {"fault_tolerance": {"max_failures": 1}}, "keep no checkpoints"),
    ({"members": [2], "member_model": "no-such-model"}, {}, "unknown model"),
    ({"members": [2], "tp": 0}, {}, "ensemble.tp"),
])
def test_a_bad_ensemble_is_one_line_naming_it(ensemble, extra, says):
    with pytest.raises(SpecError) as err:
        validate_spec({**CPU, **extra, "ensemble": ensemble})
    msg = str(err.value)
    assert says in msg and msg.startswith("ensemble") and "\n" not in msg


def test_a_member_the_planner_refuses_is_an_error_of_the_spec():
    with pytest.raises(SpecError) as err:
        _plan({**CPU, "ensemble": {"members": [1, 2], "tp": 2}})
    msg = str(err.value)
    assert msg.startswith("ensemble.members: invalid value 2") and "\n" not in msg
    assert "llama2-tiny on 1 devices" in msg and "layout" in msg and "tp*pp = 2" in msg


def test_the_cpu_comparison_is_the_single_model_then_two_members_on_one_device_each():
    spec, [c] = _plan({**CPU, "ensemble": {"members": [1, 2]}})
    assert c.devices == 2 and [len(g) for g in c.runs] == [1, 2]  # k = 1 of its model is the single
    single, (m0, m1) = c.single, c.groups[0]
    assert single.role is EnsembleRole.single and single.entry.config.world_size == 2
    assert [m.k for m in (m0, m1)] == [2, 2] and [m.member_index for m in (m0, m1)] == [0, 1]
    assert {m.entry.config.world_size for m in (m0, m1)} == {1}
    # weak scaling, as the single model: each member's batch is its share
    assert single.entry.config.global_batch == 8 and m0.entry.config.global_batch == 4
    ids = {s.entry.config.trial_id for s in c.slots}
    assert len(ids) == 3  # independent members: a seed, so a trial id, of their own
    # ... and each is exactly the one planner's entry of its point
    point = resolve_point(spec, m0.entry.axes)
    seeded = spec.model_copy(update={"seed": spec.seed + 1})  # member 0 of 2: seed + k(k-1)/2
    assert plan_point(seeded, point).config.trial_id == m0.entry.config.trial_id
    assert [m.entry.config.seed for m in (m0, m1)] == [1, 2]
    assert c.ensemble_id == _plan({**CPU, "ensemble": {"members": [1, 2]}})[1][0].ensemble_id


def test_members_of_one_size_in_two_comparisons_stay_distinct_trials():
    """64 GPUs each: 16 members of 1,024 and 32 of 2,048; the ledger keeps one row per trial id."""
    _, comparisons = _plan(PAPER)
    slots = [s for c in comparisons for s in c.slots]
    assert len(slots) == 2 * (1 + 2 * (1 + 2 + 4 + 8 + 16 + 32))
    assert len({s.entry.config.trial_id for s in slots}) == len(slots)
    assert len({c.ensemble_id for c in comparisons}) == 2
    layouts = {(s.entry.config.model, s.entry.config.world_size, s.entry.config.zero_stage)
               for s in slots if s.role is EnsembleRole.member}
    assert ("llama2-13b", 64, 3) in layouts and ("llama2-7b", 2048, 3) in layouts


def test_resume_runs_a_group_again_unless_all_its_members_are_in_the_ledger():
    spec, [c] = _plan({**CPU, "ensemble": {"members": [1, 2]}})
    single = c.single.entry.config.trial_id
    m0, m1 = [s.entry.config.trial_id for s in c.groups[0]]
    sweep = EnsembleSweep(spec, plan_study(spec), {single, m0})
    assert sweep.total == 2 and [len(g) for _, g in sweep.todo] == [2]
    assert EnsembleSweep(spec, plan_study(spec), {single, m0, m1}).total == 0
