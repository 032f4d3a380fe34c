"""`scalestudy plan` past --dry-run, for real: the chosen layouts run as Ray Tune x Ray Train x
DeepSpeed trials (the session's Ray, warm groups), land in the ledger and MLflow as a sweep's do,
the model is refitted on them, and the answer names a measured layout and writes a plan.yaml that
`scalestudy validate` accepts."""

from __future__ import annotations

import json
import re

import pandas as pd
import yaml
from typer.testing import CliRunner

from scalestudy.cli import app
from scalestudy.track.ledger import Ledger, ledger_path
from scalestudy_analysis.figures_plan import PLAN_ATTR, plan_rounds
from scalestudy_analysis.report import plan_record

ARGS = ["plan", "llama2-tiny", "--hardware", "cpu-local", "--devices", "2", "--global-batch", "8",
        "--seq-len", "64", "--space", "zero", "--top-k", "2", "--rounds", "2", "--budget", "3",
        "--measure-steps", "3"]


def test_plan_measures_refits_and_recommends_a_measured_layout(ray_session, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    root = tmp_path / "results"
    res = CliRunner().invoke(app, [*ARGS, "--results-root", str(root), "--tracking-uri", uri],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    out = res.output
    assert "round 1: measuring 2 layouts" in out  # the best of each family: zero3 and data
    # Then a second round within the budget of 3, or none: whether the measurements rule the rest
    # out (converged) depends on what they measured, this machine's timings.
    spent = int(re.search(r"spent: (\d+) trials", out).group(1))
    stop = re.search(r"stopped: (.*)", out).group(1)
    assert spent in (2, 3) and (stop == "budget spent" or stop.startswith("converged")), out
    assert spent == 3 or stop.startswith("converged"), out  # 2 trials: the budget was not spent
    assert ("round 2: measuring 1 layouts" in out) == (spent == 3)
    assert "recommended: ws2-" in out and "leave-one-out" in out and "(in sample)" in out

    study = next(p.name for p in root.iterdir() if p.is_dir())
    rows = Ledger(ledger_path(study, root)).rows()
    assert len(rows) == spent and all(r["status"] == "completed" for r in rows), rows
    assert len({r["trial_id"] for r in rows}) == spent
    assert len({r["sweep_id"] for r in rows}) == 1  # every round in one Tune experiment

    assert (root / study / "fitted-cpu-local.yaml").is_file()  # what the study's report predicts with
    record = plan_record(study, root)  # what the report's plan figure draws
    assert len(record["layouts"]) == spent and record["stop_reason"] == stop.strip()
    assert record["recommended"] == max(record["layouts"], key=lambda r: r["measured"])["trial"]
    frame = pd.DataFrame()
    frame.attrs[PLAN_ATTR] = record
    assert plan_rounds(frame).axes
    plan_file = root / study / "plan.yaml"
    spec = yaml.safe_load(plan_file.read_text())
    best = max(rows, key=lambda r: r["tokens_per_s"])
    assert (spec["zero_stage"], spec["micro_batch"]) == (best["zero_stage"], best["micro_batch"])
    check = CliRunner().invoke(app, ["validate", str(plan_file), "--json"])
    assert check.exit_code == 0, check.output
    planned = [json.loads(ln) for ln in check.output.splitlines()]
    assert len(planned) == 1 and planned[0]["verdict"]["runnable"]

    # The same plan again on the same root, as --json: what the ledger holds is used, not run
    # again, and stdout holds the rows alone (Tune's banner goes to stderr).
    again = CliRunner().invoke(app, [*ARGS, "--results-root", str(root), "--tracking-uri", uri,
                                     "--json"])
    assert again.exit_code == 0, again.output
    rows_again = [json.loads(ln) for ln in again.stdout.splitlines()]
    assert len(Ledger(ledger_path(study, root)).rows()) == spent
    assert ({(r["trial"], r["measured"]) for r in rows_again}
            == {(r["trial"], r["measured"]) for r in record["layouts"]})
