"""`scalestudy plan`'s ranking: every layout of the space judged by the one planner, the best first,
model parallelism on top for a 70B model at 1,024 H100s (the study's finding), the memory cap
applied by the same rule."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from scalestudy.cli import app
from scalestudy.plan import plan_spec
from scalestudy.plan.space import PlanRequest, family_of, rank, space_spec


def test_70b_on_1024_h100_is_model_parallel_and_ranked():
    ranked = rank(PlanRequest(model="llama2-70b", hardware="h100-80gb", devices=1024))
    fit = [r for r in ranked if r.feasible]
    assert fit and all(a.score >= b.score for a, b in zip(fit, fit[1:]))
    top = fit[0].result
    assert top.tp > 1 or top.pp > 1, top.run_name if hasattr(top, "run_name") else top
    best_zero3 = next(r for r in fit if r.family == "zero3")
    assert fit[0].score > best_zero3.score
    # the space is the planner's: same verdicts as plan_spec of the in-memory spec
    spec = space_spec(PlanRequest(model="llama2-70b", hardware="h100-80gb", devices=1024))
    assert {e.config.trial_id: e.feasible for e in plan_spec(spec)} == {
        r.entry.config.trial_id: r.entry.feasible for r in ranked}
    for r in fit:
        assert r.low <= r.score <= r.high


def test_mem_cap_refuses_by_the_memory_rule():
    req = dict(model="llama2-7b", hardware="a100-80gb", devices=8, space=("zero", "micro_batch"))
    free = [r for r in rank(PlanRequest(**req)) if r.feasible]
    capped = rank(PlanRequest(**req, mem_cap_gib=30))
    assert all(r.result.peak_memory_gib <= 30 * 0.95 for r in capped if r.feasible)
    refused = [r for r in capped if not r.feasible and "--mem-cap 30" in (r.result.reason or "")]
    assert refused and len([r for r in capped if r.feasible]) < len(free)
    assert all(r.result.reason_class == "memory" for r in refused)


def test_families():
    assert family_of(1, 1, 3) == "zero3" and family_of(8, 1, 1) == "tensor"
    assert family_of(1, 4, 1) == "pipeline" and family_of(2, 2, 0) == "pipeline+tp"


def test_cli_dry_run_and_bad_input():
    res = CliRunner().invoke(app, ["plan", "llama2-13b", "--hardware", "a100-80gb", "--devices",
                                   "64", "--dry-run", "--top-k", "3"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "predicted, not measured" in res.output and "best of each family" in res.output
    rows = [json.loads(ln) for ln in CliRunner().invoke(app, [
        "plan", "llama2-13b", "--hardware", "a100-80gb", "--devices", "64", "--dry-run",
        "--json"]).output.splitlines()]
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    for args, field in ((["--space", "zero,warp"], "--space"), (["--objective", "fast"], "--objective")):
        bad = CliRunner().invoke(app, ["plan", "llama2-13b", "--hardware", "a100-80gb",
                                       "--devices", "64", "--dry-run", *args])
        assert bad.exit_code == 2 and field in bad.output, bad.output


def test_usd_objective_uses_the_catalogue_price_or_asks_for_one():
    ranked = rank(PlanRequest(model="llama2-7b", hardware="h100-80gb", devices=8,
                              objective="usd_per_token", space=("zero",)))
    best = next(r for r in ranked if r.feasible)
    assert best.score < 0  # USD per token, negated so larger is better
    per_token = 12.29 * 8 / 3600 / best.result.tokens_per_s
    assert -best.score == per_token


def test_layout_options_free_by_name_and_impossible_ones_refused_per_layout(tmp_path):
    """--space cp,sp,gather_granularity,selective: the spec's layout options become axes of the
    space; what cannot be (sp without tp, block gathers below ZeRO-3) is refused per layout with its
    reason, and a plan.yaml of a layout with options names them so a sweep runs that layout."""
    from scalestudy.cli_plan_rounds import write_plan_yaml
    from scalestudy.plan import plan_study
    from scalestudy.plan.rounds import Measured, PlanOutcome
    from scalestudy.spec.load import load_spec
    from scalestudy.spec.trial import RecomputeGranularity, trial_key

    base = dict(model="llama2-7b", hardware="h100-80gb", devices=64, global_batch=256,
                space=("zero", "tp"))
    plain = rank(PlanRequest(**base))
    options = ("cp", "sp", "gather_granularity", "selective")
    req = PlanRequest(**{**base, "space": ("zero", "tp", *options)})
    ranked = rank(req)
    assert len(ranked) == len(plain) * 4 * 2 * 2 * 3  # cp 1-8, sp, gather granularity, 3 recomputes
    fit = [r.entry.config for r in ranked if r.feasible]
    assert all(c.tp > 1 for c in fit if c.sequence_parallel)
    assert all(c.zero_stage == 3 for c in fit if c.gather_granularity.value == "block")
    assert {c.cp for c in fit} == {1, 2, 4, 8}
    assert any(c.recompute_granularity is RecomputeGranularity.selective for c in fit)
    reasons = {r.result.reason for r in ranked if not r.feasible}
    assert any("needs tp > 1" in (x or "") for x in reasons)
    assert len({r.entry.config.run_name for r in ranked}) == len(ranked)

    best = next(r for r in ranked if r.feasible and r.entry.config.cp > 1
                and r.entry.config.sequence_parallel
                and r.entry.config.recompute_granularity is RecomputeGranularity.selective)
    out = PlanOutcome(ranked, {trial_key(best.entry.config): Measured(best, best.result, best.score, 1)},
                      [], "test", best.entry.hardware)
    settings = {"steps": {"warmup": 2, "measure": 3, "profile": 0},
                "tracking": {"experiment": "plan-x"}}
    path = write_plan_yaml(out, req, "h100-80gb", settings, str(tmp_path), "plan-x")
    (planned,) = plan_study(load_spec(path, ["backend=simulate"]))
    assert trial_key(planned.config) == trial_key(best.entry.config)
