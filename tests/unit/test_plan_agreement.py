"""validate, predict and a simulate sweep give every point the same verdict and reason class.

Over 3,000+ random points (catalogue models and hardware, ZeRO 0-3, tp, pp, world size, micro-batch,
checkpointing, sequence length, weak and strong scaling), each command is run as a user runs it
(`validate --json`, `predict --json`, `sweep` into a ledger) and their verdicts compared point by
point; so is the verdict a Tune trial reaches from its axes alone (plan_point, what a measured
sweep's trainable runs). Before the plan existed, one spec of 1,728 points got 1,632 runnable from
validate, 1,250 completed from predict and 1,232 from sweep.
"""

from __future__ import annotations

import json
import random

import yaml
from typer.testing import CliRunner

from scalestudy.cli import app
from scalestudy.plan import plan_point, plan_study
from scalestudy.spec import catalog
from scalestudy.spec.load import load_spec
from scalestudy.spec.study import AXES, resolve_point
from scalestudy.track.ledger import Ledger, ledger_path

MIN_POINTS = 3000
CHOICES = {
    "world_size": [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024],
    "zero_stage": [0, 1, 2, 3],
    "tp": [1, 2, 4, 8, 16],
    "pp": [1, 2, 4, 8],
    "micro_batch": [1, 2, 4, 8],
    "activation_checkpointing": [False, True],
    "seq_len": [512, 2048, 4096],
    "global_batch": [None, 256, 1024],
}


def _random_spec(rng: random.Random, i: int) -> dict:
    spec = {"name": f"agree{i}", "backend": "simulate",
            "model": rng.sample(catalog.model_names(), 2),
            "hardware": rng.sample(catalog.hardware_names(), 2),
            "precision": rng.choice(["auto", "bf16", "fp32"])}
    for axis, values in CHOICES.items():
        spec[axis] = rng.sample(values, min(len(values), rng.choice([2, 3])))
    return spec


def _by_id(lines: str) -> dict[str, tuple]:
    out = {}
    for line in lines.splitlines():
        row = json.loads(line)
        if "verdict" in row:  # validate --json: a plan entry
            v = row["verdict"]
            out[row["trial_id"]] = (v["runnable"], v["reason_class"])
        else:  # predict --json: a TrialResult
            out[row["trial_id"]] = (row["status"] != "infeasible", row["reason_class"])
    return out


def test_every_command_gives_every_point_the_same_verdict(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    rng, runner = random.Random(30), CliRunner()
    points = refused = 0
    classes: set[str] = set()
    for i in range(40):
        path = tmp_path / f"agree{i}.yaml"
        path.write_text(yaml.safe_dump(_random_spec(rng, i)))
        validated = runner.invoke(app, ["validate", str(path), "--json"])
        if validated.exit_code == 2:  # no point of this draw can run: a spec error, not a verdict
            continue
        assert validated.exit_code == 0, validated.output
        plan = _by_id(validated.output)
        predicted = _by_id(runner.invoke(app, ["predict", str(path), "--json"]).output)
        swept = runner.invoke(app, ["sweep", str(path), "--json", "--results-root",
                                    str(tmp_path / "results")])
        assert swept.exit_code in (0, 1), swept.output
        ledger = {r["trial_id"]: (r["status"] != "infeasible", r.get("reason_class"))
                  for r in Ledger(ledger_path(f"agree{i}", tmp_path / "results")).rows()}
        assert plan == predicted == ledger
        spec = load_spec(path)
        for entry in plan_study(spec):  # a Tune trial's own verdict, from its axes by name
            tuned = plan_point(spec, resolve_point(spec, {a: entry.axes[a] for a in AXES}))
            assert (tuned.feasible, tuned.reason_class) == (entry.feasible, entry.reason_class)
        points += len(plan)
        refused += sum(not ok for ok, _ in plan.values())
        classes |= {c for ok, c in plan.values() if not ok}
        if points >= MIN_POINTS:
            break
    assert points >= MIN_POINTS
    # the draw exercises both verdicts and the main rules, so agreement is not trivially of one kind
    assert 0 < refused < points and {"memory", "layout", "model"} <= classes, classes
