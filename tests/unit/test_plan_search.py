"""sweep/plan_search.py: the plan's rounds as a Ray Tune searcher, driven here as Tune's controller
drives it (ask for trials while slots are free, report each one complete) on a known truth
(tests/fixtures/plan_machine.py). The Tune experiment itself runs in
tests/integration/test_plan_measure.py."""

from __future__ import annotations

from ray.tune.search import Searcher

from scalestudy.metrics import Status
from scalestudy.plan.build import plan_point
from scalestudy.plan.rounds import PlanBudget, PlanLoop, run_plan
from scalestudy.plan.space import space_spec
from scalestudy.spec import catalog
from scalestudy.sweep.plan_search import PlanSearcher
from scalestudy.sweep.trainable import RESULT_KEY, WINDOW_KEY, trial_point
from tests.fixtures.plan_machine import REQ, Machine

SETTINGS = {"steps": {"warmup": 2, "measure": 6, "profile": 0}}
LOOP = {"top_k": 3, "rounds": 4, "budget": PlanBudget(trials=14)}


def _searcher(known=None, **loop):
    hw = catalog.get_hardware("cpu-local")
    spec = space_spec(REQ, hw, **SETTINGS)
    loop = PlanLoop(REQ, hw, **{**LOOP, **loop}, **SETTINGS)
    return PlanSearcher(loop, spec, known), spec


def _drive(searcher, spec, machine, slots=2, fail=()):
    """Tune's side: fill the free slots, then complete the oldest running trial; until FINISHED.
    Returns every config handed out, in order."""
    running, handed, n = [], [], 0
    while True:
        while len(running) < slots:
            n += 1
            config = searcher.suggest(f"t{n}")
            if config == Searcher.FINISHED or config is None:
                break
            running.append((f"t{n}", config))
            handed.append(config)
        if not running:
            assert config == Searcher.FINISHED, "the searcher waits on nothing"
            return handed
        trial_id, config = running.pop(0)
        entry = plan_point(*trial_point(spec, config))
        if entry.config.run_name in fail:
            searcher.on_trial_complete(trial_id, None, error=True)
            continue
        # as the trainable reports it: under the trial's own id (the truth predicts on another profile)
        result = machine.measure([entry])[0].model_copy(update={"trial_id": entry.config.trial_id})
        searcher.on_trial_complete(trial_id, {RESULT_KEY: result.model_dump_json()})


def test_the_searcher_measures_what_the_loop_measures_with_a_function():
    hw = catalog.get_hardware("cpu-local")
    direct = run_plan(REQ, hw, Machine(), **LOOP, **SETTINGS)
    searcher, spec = _searcher()
    handed = _drive(searcher, spec, Machine())
    tuned = searcher.loop.outcome
    assert len(handed) == tuned.spent_trials == direct.spent_trials
    assert sorted(tuned.measured) == sorted(direct.measured)
    assert [r.chosen for r in tuned.rounds] == [r.chosen for r in direct.rounds]
    assert tuned.stop_reason == direct.stop_reason
    assert tuned.recommended.name == direct.recommended.name
    # a batch is handed out whole before its round ends: no trial of round 2 before round 1's last
    assert len(tuned.rounds) >= 2


def test_a_layout_in_the_ledger_is_not_run_again():
    first, spec = _searcher()
    _drive(first, spec, Machine())
    known = {r.trial_id: r for r in first.loop.outcome.runs}
    again, spec = _searcher(known)
    assert _drive(again, spec, Machine()) == []  # every round completes from the ledger
    assert len(again.reused) == first.loop.outcome.spent_trials
    assert again.loop.outcome.recommended.name == first.loop.outcome.recommended.name


def test_a_failed_trial_is_recorded_as_failed_and_the_plan_goes_on():
    probe, spec = _searcher()
    first = plan_point(*trial_point(spec, probe.suggest("t0")))
    searcher, spec = _searcher()
    handed = _drive(searcher, spec, Machine(), fail={first.config.run_name})
    out = searcher.loop.outcome
    failed = [m for m in out.measured.values() if m.result.status is Status.failed]
    assert [m.name for m in failed] == [first.config.run_name]
    assert "no result" in failed[0].result.reason or "failed" in failed[0].result.reason
    names = [plan_point(*trial_point(spec, c)).config.run_name for c in handed]
    assert names.count(first.config.run_name) == 1  # not suggested again
    assert out.recommended is not None and out.recommended.name != first.config.run_name


def test_a_halving_window_is_the_trials_own_step_count():
    searcher, spec = _searcher(top_k=4, halving_steps=2)
    handed = _drive(searcher, spec, Machine(), slots=3)
    short = [c for c in handed if c.get(WINDOW_KEY) == 2]
    assert short and len(short) < len(handed)  # round 1's short window, then its better half full
    trial = plan_point(*trial_point(spec, short[0])).config
    full = plan_point(*trial_point(spec, {"point": short[0]["point"]})).config
    assert trial.steps.measure == 2 and full.steps.measure == SETTINGS["steps"]["measure"]
    assert trial.trial_id != full.trial_id  # the ledger keeps both windows' rows
    windows = {m.window for m in searcher.loop.outcome.measured.values()}
    assert windows == {"short", "full"}
