"""One large model or several smaller ones at once, measured (experiments/ensembles_cpu.yaml): one
llama2-tiny on both of 2 workers, then two members on one worker each trained at the same time,
recorded with every comparison metric, read back from the ledger as one comparison and logged to
MLflow under the sweep's parent run. One sweep, no repeats (the 15-minute suite on 2 cores)."""

from __future__ import annotations

import math

import mlflow

from scalestudy import metrics as M
from scalestudy.metrics import EnsembleRole, Status
from scalestudy.plan import plan_study
from scalestudy.spec.load import load_spec
from scalestudy.sweep.driver import run_sweep
from scalestudy.track.ledger import Ledger, row_to_result
from tests.conftest import REPO

SPEC = REPO / "experiments" / "ensembles_cpu.yaml"
# Every figure of the comparison a row carries, finite whatever the machine's meters.
ALWAYS = (M.TIMED_WINDOW_START_EPOCH_S, M.TIMED_WINDOW_END_EPOCH_S, M.DEVICE_S_PER_TOKEN,
          M.TIME_TO_BUDGET_S, M.ENSEMBLE_TOKENS_PER_S, M.ENSEMBLE_MODEL_FLOPS_PER_DEVICE_S,
          M.ENSEMBLE_DEVICE_S_PER_TOKEN, M.ENSEMBLE_TIME_TO_BUDGET_S)
# ... and those in joules: finite where the machine has RAPL, else NaN with the reason.
ENERGY = (M.ENERGY_ATTRIBUTED_J, M.MODEL_FLOPS_PER_J, M.ENERGY_TO_BUDGET_J, M.ENSEMBLE_TOKENS_PER_J,
          M.ENSEMBLE_MODEL_FLOPS_PER_J, M.ENSEMBLE_ENERGY_TO_BUDGET_J)


def _check_row(r):
    assert r.status is Status.completed, r.reason
    for name in ALWAYS:
        assert math.isfinite(getattr(r, name)), name
    for name in ENERGY:
        value = getattr(r, name)
        assert math.isfinite(value) or r.missing[name], name
    assert (r.ensemble_energy_source == "rapl") == math.isfinite(r.ensemble_tokens_per_j)


def test_one_model_on_two_workers_against_two_members_at_once(ray_session, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = load_spec(SPEC, [f"tracking.mlflow_uri={uri}"])
    outcome = run_sweep(spec, plan_study(spec), SPEC.read_text(), results_root=tmp_path / "results",
                        show_progress=False)
    assert outcome.mlflow_error is None

    rows = [row_to_result(row) for row in Ledger(outcome.ledger).rows()]
    assert len(rows) == 3 and len({r.ensemble_id for r in rows}) == 1  # one comparison
    single = next(r for r in rows if r.ensemble_role is EnsembleRole.single)
    members = sorted((r for r in rows if r.ensemble_role is EnsembleRole.member),
                     key=lambda r: r.member_index)
    assert (single.world_size, single.ensemble_k) == (2, 1)
    assert [(m.world_size, m.ensemble_k, m.member_index) for m in members] == [(1, 2, 0), (1, 2, 1)]
    for r in rows:
        _check_row(r)

    # the members ran at the same time: their timed windows overlap (the acceptance: by at
    # least 80% of the shorter one), and the group's figures are the members' sums
    a, b = members
    windows = [(m.timed_window_start_epoch_s, m.timed_window_end_epoch_s) for m in members]
    assert a.ensemble_overlap_fraction == b.ensemble_overlap_fraction >= 0.8, windows
    assert a.ensemble_tokens_per_s == a.tokens_per_s + b.tokens_per_s
    assert a.ensemble_time_to_budget_s == max(a.time_to_budget_s, b.time_to_budget_s)
    assert single.missing[M.ENSEMBLE_OVERLAP_FRACTION]  # a group of one

    # MLflow: each trial a child run with the comparison's figures, the aggregates on the parent
    client = mlflow.tracking.MlflowClient(uri)
    exp = client.get_experiment_by_name(spec.experiment)
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parent = next(r for r in runs if r.data.tags.get("scalestudy.role") == "sweep")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 3
    assert sorted(c.data.metrics[M.ENSEMBLE_K] for c in children) == [1, 2, 2]
    name = f"{M.ENSEMBLE_TOKENS_PER_S}/n2/llama2-tiny/k2"
    assert parent.data.metrics[name] == a.ensemble_tokens_per_s
