"""Tensor parallelism (DeepSpeed AutoTP) composed with ZeRO: same maths as data parallelism. The
trials run on warm worker groups (one per world size, for the module), as a sweep runs them."""

from __future__ import annotations

import math

import pytest

from scalestudy.metrics import Status
from scalestudy.spec import catalog
from tests.conftest import trial

FP32 = ["precision=fp32", "steps={warmup: 2, measure: 8, profile: 0}"]
TP_STAGES = (0, 1, 2, 3)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-3) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference(warm_trial):
    r = warm_trial(trial(["world_size=2", "tp=1", "zero_stage=0", "micro_batch=2",
                          "global_batch=4", *FP32]))
    assert r.status is Status.completed, r.reason
    return r


@pytest.mark.parametrize("stage", TP_STAGES)
def test_tp2_matches_tp1(reference, warm_trial, stage):
    r = warm_trial(trial(["world_size=2", "tp=2", f"zero_stage={stage}", "micro_batch=2",
                          "global_batch=4", *FP32]))
    assert r.status is Status.completed, r.reason
    assert (r.tp, r.dp, r.grad_accum) == (2, 1, 2)
    assert _close(r.losses, reference.losses), (r.losses, reference.losses)
    dims = catalog.get_model(r.model)
    for shapes in r.extra["shard_shapes"]:
        assert shapes["layers.0.self_attn.q_proj.weight"] == [dims.hidden_size // 2, dims.hidden_size]
        assert shapes["layers.0.mlp.down_proj.weight"] == [dims.hidden_size, dims.ffn // 2]


@pytest.mark.slow
def test_tp2_dp2_matches_tp1_dp4(warm_trial):
    common = ["world_size=4", "zero_stage=1", "micro_batch=1", "global_batch=4", *FP32]
    a = warm_trial(trial(["tp=2", *common]))
    b = warm_trial(trial(["tp=1", *common]))
    assert a.status is Status.completed and b.status is Status.completed, (a.reason, b.reason)
    assert (a.dp, a.grad_accum, b.dp) == (2, 2, 4)
    assert _close(a.losses, b.losses), (a.losses, b.losses)
