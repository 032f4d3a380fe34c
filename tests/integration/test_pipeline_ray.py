"""A pipeline trial (pp 2) under Ray Train, the way a sweep runs it (issue 33): the same trial body
as every trial (train/body.py -> train/pipeline_trial.py), its pipeline figures in the result, the
ledger row and the MLflow metrics. Losses against pp 1 are tests/integration/test_pipeline_exactness.py's
(plain processes, faster); this is the one pipeline trial through Ray."""

from __future__ import annotations

import math

from scalestudy import metrics as M
from scalestudy.launch.ray_train import run_trial
from scalestudy.metrics import Status
from scalestudy.track.ledger import result_to_row, row_to_result
from tests.conftest import trial


def test_pp2_trial_under_ray_train(ray_session, ray_storage):
    cfg = trial(["world_size=2", "pp=2", "zero_stage=1", "micro_batch=2", "global_batch=8",
                 "precision=fp32", "schedule=gpipe", "steps={warmup: 2, measure: 4, profile: 1}"])
    r = run_trial(cfg, ray_storage)
    assert r.status is Status.completed, r.reason
    assert (r.pp, r.dp, r.grad_accum, r.schedule) == (2, 1, 4, "gpipe")
    assert 0 < r.bubble_fraction < 1 and r.bubble_time_s > 0 and r.stage_imbalance >= 1
    assert [s["stage"] for s in r.pipeline_stages] == [0, 1]
    assert all(s["blocks"] == 1 and s["busy_s"] > 0 for s in r.pipeline_stages)
    # GPipe holds every micro-batch's activations on both stages
    assert all(s["activation_peak_gib"] > 0 for s in r.pipeline_stages)
    p2p = r.comm[M.SEND_RECV]
    assert p2p.count == 8 and p2p.bytes == 8 * 2 * 128 * 64 * 4  # 4 micro-batches of 2 x 128 x h64
    assert math.isfinite(r.comm_exposed_s) and r.loss_last < r.loss_first
    metrics = r.scalar_metrics()
    assert {M.BUBBLE_FRACTION, M.STAGE_IMBALANCE, "stage/1/busy_s",
            f"comm/{M.SEND_RECV}/bytes"} <= metrics.keys()
    back = row_to_result(result_to_row(r))
    assert back.pipeline_stages == r.pipeline_stages and back.bubble_fraction == r.bubble_fraction


def test_pipeline_trials_one_after_another_on_a_warm_group(warm_trial):
    """A sweep runs consecutive pipeline trials on one warm group. The second used to fail with
    "Could not resolve the process group registered under the name ...": the first trial's device
    mesh was cached, and its groups destroyed at the end of that trial (train/reentry.py). Now each
    trial trains as the first did (fp32: the same losses)."""
    sets = ["world_size=2", "pp=2", "micro_batch=2", "global_batch=8", "precision=fp32",
            "steps={warmup: 1, measure: 2, profile: 0}"]
    first = warm_trial(trial([*sets, "zero_stage=0"]))
    again = warm_trial(trial([*sets, "zero_stage=0"]))
    other = warm_trial(trial([*sets, "zero_stage=1", "schedule=gpipe"]))
    for r in (first, again, other):
        assert r.status is Status.completed, r.reason
    assert again.extra["worker_group"]["trials_before"] == 1
    assert other.extra["worker_group"]["trials_before"] == 2
    assert again.losses == first.losses
