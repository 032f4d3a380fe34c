"""The performance model against this machine: calibrate `cpu-local`, sweep the quick-start study for
real (the session's quickstart fixture), predict the same trials with the calibrated profile, compare
tokens/s. Prints a per-trial error table and fails past a MAPE of 25% (target 15%).

Known gap (issue 6): eager kernels run slower inside a training step than in calibrate's isolated
microbenchmarks (allocator and cache state), and a two-worker DeepSpeed step costs more than its
collectives plus the measured core-sharing slowdown. The bound is kept at the issue's 25%, so the test
is an expected failure until the model closes that gap; it passes loudly (XPASS) when it does.
"""

from __future__ import annotations

import pytest

from scalestudy.perfmodel.predict import predict
from scalestudy.spec import catalog
from scalestudy.spec.load import load_spec, plan
from scalestudy.spec.study import trial_name
from tests.conftest import QUICKSTART

MAPE_BOUND = 0.25

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def calibrated_cpu(ray_session):
    from scalestudy.measure.calibrate import calibrate

    return calibrate(catalog.get_hardware("cpu-local"), quick=True, precisions=["bf16"])


@pytest.mark.xfail(reason="known gap, see the module doc: MAPE 59-70% on 2026-12-03", strict=False)
def test_calibrated_cpu_prediction_mape(quickstart_results, calibrated_cpu):
    configs = {p.config.trial_id: p.config for p in plan(load_spec(QUICKSTART))}
    errors = []
    print(f"\n{'trial':24s} {'measured tok/s':>15s} {'predicted':>10s} {'error':>7s}")
    for r in quickstart_results:
        if r.status.value != "completed":
            continue
        pred = predict(configs[r.trial_id], hardware=calibrated_cpu)
        err = pred.tokens_per_s / r.tokens_per_s - 1
        errors.append(abs(err))
        print(f"{trial_name(r):24s} {r.tokens_per_s:15.0f} {pred.tokens_per_s:10.0f} {err:+7.1%}")
    assert errors, "no completed quick-start trial to compare with"
    mape = sum(errors) / len(errors)
    print(f"MAPE {mape:.1%} over {len(errors)} trials (bound {MAPE_BOUND:.0%}, target 15%)")
    assert mape <= MAPE_BOUND
