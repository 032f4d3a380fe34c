"""plan/rounds.py: which layouts a round measures, when the rounds stop, what the budget allows.

The "machine" here is the model itself under other efficiencies and a family it gets wrong (the
tensor-parallel layouts run at a third of what it predicts): the loop's logic on a known truth. The
real measuring path (Ray Tune trials) is tests/integration/test_plan_measure.py's."""

from __future__ import annotations

import pytest

from scalestudy.errors import SpecError
from scalestudy.metrics import Status
from scalestudy.plan.rounds import PlanBudget, choose, run_plan
from scalestudy.plan.space import rank
from scalestudy.spec import catalog
from scalestudy.spec.trial import trial_key

from tests.fixtures.plan_machine import REQ, Machine


def test_a_round_takes_every_unmeasured_family_then_the_highest_bands():
    ranked = rank(REQ)
    picked = choose(ranked, {}, 2)
    families = {r.family for r in ranked if r.feasible}
    assert {r.family for r in picked} == families and len(picked) == len(families)
    highs = sorted((r.high for r in ranked if r.feasible), reverse=True)
    assert picked[0].high == max(r.high for r in picked) <= highs[0]
    more = choose(ranked, {}, len(families) + 3)
    assert len(more) == len(families) + 3 and len({id(r) for r in more}) == len(more)


def test_rounds_find_the_true_best_and_stop_within_the_budget():
    machine = Machine()
    out = run_plan(REQ, catalog.get_hardware("cpu-local"), machine, top_k=4, rounds=6,
                   budget=PlanBudget(trials=30))
    truth = machine.truth(rank(REQ))
    best_true = max(truth.values())
    rec = out.recommended
    assert rec is not None and rec.result.status is Status.completed
    assert rec.score >= 0.97 * best_true, (rec.score, best_true)
    assert out.spent_trials <= 30 and out.spent_trials < len(truth) / 2
    measured_ids = [t for call in machine.calls for t in call]
    assert len(measured_ids) == len(set(measured_ids))  # no layout measured twice
    # the tensor family was measured, found slow, and is not recommended
    assert any(m.chosen_as.family == "tensor" for m in out.measured.values())
    assert rec.chosen_as.family != "tensor"
    assert out.rounds[-1].refit and out.rounds[-1].in_sample_error >= 0
    assert out.spent_device_hours == pytest.approx(out.spent_trials * 90 * 2 / 3600)


def test_budget_in_trials_and_device_hours():
    machine = Machine()
    out = run_plan(REQ, catalog.get_hardware("cpu-local"), machine, top_k=3, rounds=5,
                   budget=PlanBudget(trials=5))
    assert out.spent_trials == 5 and out.stop_reason == "budget spent"
    machine = Machine()
    hours = run_plan(REQ, catalog.get_hardware("cpu-local"), machine, top_k=3, rounds=5,
                     budget=PlanBudget(device_hours=0.1))  # 90 s x 2 devices a trial: 2 trials
    assert len(machine.calls) == 1 and hours.stop_reason == "budget spent"


def test_mem_cap_keeps_refused_layouts_out_of_every_round():
    machine = Machine()
    req = REQ.model_copy(update={"mem_cap_gib": 0.84})  # 48 of the 80 layouts fit
    ranked = rank(req)
    assert 0 < sum(r.feasible for r in ranked) < len(ranked)
    refused = {r.entry.config.run_name for r in ranked if not r.feasible}
    run_plan(req, catalog.get_hardware("cpu-local"), machine, top_k=4, rounds=3,
             budget=PlanBudget())
    assert refused.isdisjoint(t for call in machine.calls for t in call)


@pytest.mark.parametrize("text, want", [("12", PlanBudget(trials=12)), ("0.5h", PlanBudget(device_hours=0.5)),
                                        (None, PlanBudget())])
def test_budget_parse(text, want):
    assert PlanBudget.parse(text) == want


@pytest.mark.parametrize("text", ["-3", "0", "1.5", "lots", "2d"])
def test_bad_budget_names_the_option(text):
    with pytest.raises(SpecError, match="--budget"):
        PlanBudget.parse(text)


def test_the_answer_rows_plan_yaml_and_refit(tmp_path, capsys):
    """What cli_plan_rounds prints and writes, on the known truth (no Ray): every measured layout
    once, plan.yaml a spec that validates to the recommended layout, the refit where fit puts one."""
    from scalestudy.cli_plan_rounds import _print_answer, measured_rows, write_plan_yaml, write_refit
    from scalestudy.plan import plan_study
    from scalestudy.spec.load import load_spec

    out = run_plan(REQ, catalog.get_hardware("cpu-local"), Machine(), top_k=3, rounds=2,
                   budget=PlanBudget())
    rows = measured_rows(out)
    assert len(rows) == out.spent_trials and rows[0]["measured"] == out.recommended.result.tokens_per_s
    settings = {"steps": {"warmup": 2, "measure": 3, "profile": 0},
                "tracking": {"experiment": "plan-x"}}
    path = write_plan_yaml(out, REQ, "cpu-local", settings, str(tmp_path), "plan-x")
    planned = plan_study(load_spec(path))
    rec = out.recommended.chosen_as.entry.config
    assert len(planned) == 1 and trial_key(planned[0].config) == trial_key(rec)
    assert write_refit(out, str(tmp_path), "plan-x") == str(tmp_path / "plan-x" / "fitted-cpu-local.yaml")
    _print_answer(out, rows, REQ, path, 1.0)
    printed = capsys.readouterr().out
    assert "recommended: " + out.recommended.name in printed and "stopped: " in printed


def test_successive_halving_runs_the_better_half_full():
    machine = Machine()
    out = run_plan(REQ, catalog.get_hardware("cpu-local"), machine, top_k=6, rounds=1,
                   budget=PlanBudget(), halving_steps=2)
    assert machine.steps == [2, None] and len(machine.calls[0]) == 6 and len(machine.calls[1]) == 3
    windows = sorted(m.window for m in out.measured.values())
    assert windows == ["full"] * 3 + ["short"] * 3 and out.spent_trials == 9
    assert out.recommended.window == "full"
    short = {m.name: m.score for m in out.measured.values() if m.window == "short"}
    assert max(short.values()) <= min(m.score for m in out.measured.values() if m.window == "full")
