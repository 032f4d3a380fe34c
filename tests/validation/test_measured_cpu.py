"""The performance model against this machine, on shapes calibration never ran (issue 15).

Calibrate `cpu-local` (quick, --local: no Ray) in fp32 and bf16, sweep the held-out study
experiments/cpu_heldout.yaml for real in both precisions (gpt2-tiny, sequence lengths 64 and 256,
gradient accumulation 2, tp 2, world 1 and 2), predict the same trials with the calibrated profile
and compare tokens/s. Two tables, kept apart:
  * in sample: the reference steps calibrate solved its step factors from (llama2-calib,
    2 x 192 tokens, world 1 and 2, and tp 2): what calibrate can replay, near 0 by construction;
  * out of sample: every held-out trial, which shares no model, sequence length or tokens per
    micro-batch with anything calibrate ran (tests/unit/test_calibrate_local.py). Bound: MAPE 25%
    per precision over the study's trials and over its tp-1 trials (target 15%); the tp-2 trials'
    MAPE is printed apart.
A trial whose steps varied a lot (p90 step over STEADY_P90 x the median: other processes took the
cores mid-window) is shown but not scored; with fewer than MIN_TRIALS steady trials in a precision
the test skips and says so. On a CPU without native bf16 (or with ONEDNN_MAX_CPU_ISA=AVX2
SCALESTUDY_CPU_NATIVE_BF16=0) bf16 is emulated, an order of magnitude slower than fp32; it is held
to the same bound.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from scalestudy.calibrate.reference_step import in_sample
from scalestudy.perfmodel.predict import predict
from scalestudy.spec import catalog
from scalestudy.spec.load import load_spec
from scalestudy.plan import plan_study
from scalestudy.spec.precision import cpu_has_native_bf16
from scalestudy.spec.trial import trial_name

HELDOUT = Path(__file__).resolve().parents[2] / "experiments" / "cpu_heldout.yaml"
PRECISIONS = ["fp32", "bf16"]
MAPE_BOUND = 0.25
STEADY_P90 = 1.3
MIN_TRIALS = 3

pytestmark = [pytest.mark.slow, pytest.mark.quiet_machine]


@pytest.fixture(scope="module")
def calibrated():
    """Before any Ray process starts: the quick calibration as `make demo` runs it."""
    from scalestudy.calibrate.local import calibrate_local

    t0 = time.perf_counter()
    profile = calibrate_local(catalog.get_hardware("cpu-local"), quick=True, precisions=PRECISIONS)
    print(f"\nquick calibrate --local ({', '.join(PRECISIONS)}): {time.perf_counter() - t0:.0f} s; "
          f"native bf16: {cpu_has_native_bf16()}; in_step_slowdown "
          f"{profile.calibration['in_step_slowdown']:.3f}, shared_node_slowdown "
          f"{profile.calibration.get('shared_node_slowdown', 1.0):.3f}")
    return profile


@pytest.fixture(scope="module")
def heldout(calibrated, ray_session, tmp_path_factory):
    """(config, result) of every held-out trial with gradient accumulation 2, both precisions."""
    from scalestudy.sweep.driver import run_sweep

    root = tmp_path_factory.mktemp("heldout")
    spec = load_spec(HELDOUT, [f"tracking.mlflow_uri=sqlite:///{root / 'mlflow.db'}",
                               f"precision=[{', '.join(PRECISIONS)}]"])
    planned = [p for p in plan_study(spec) if p.feasible and p.config.grad_accum == 2]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    outcome = run_sweep(spec, planned, HELDOUT.read_text(), max_concurrent=1,
                        results_root=root / "results", show_progress=False)
    print(f"held-out sweep: {len(planned)} trials in {time.perf_counter() - t0:.0f} s "
          f"(load average {load:.1f} before, {os.getloadavg()[0]:.1f} after)")
    configs = {p.config.trial_id: p.config for p in planned}
    return [(configs[r.trial_id], r) for r in outcome.results]


def test_in_sample_reference_steps(calibrated):
    """The shapes calibrate solved from, printed apart (a clamped factor shows here as an error)."""
    print(f"\nIN SAMPLE (reference steps calibrate solved its factors from)\n"
          f"{'reference':34s} {'measured s':>11s} {'predicted':>10s} {'error':>7s}")
    rows = in_sample(calibrated)
    for r in rows:
        print(f"{r.name:34s} {r.measured_s:11.4f} {r.predicted_s:10.4f} {r.error:+7.1%}"
              + ("" if r.reproduced else "  (not reproduced: calibrate warned)"))
    assert len(rows) >= len(PRECISIONS)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_out_of_sample_heldout_mape(calibrated, heldout, precision):
    print(f"\nOUT OF SAMPLE ({precision}, {'native' if cpu_has_native_bf16() else 'emulated'} bf16 "
          f"CPU)\n{'trial':34s} {'measured tok/s':>15s} {'predicted':>10s} {'error':>7s} "
          f"{'p90/median':>10s}")
    errors: dict[int, list[float]] = {1: [], 2: []}  # by tp degree
    for cfg, r in heldout:
        if cfg.precision.value != precision:
            continue
        if r.status.value != "completed":
            print(f"{trial_name(r):34s} {r.status.value}: {r.reason}")
            continue
        pred = predict(cfg, hardware=calibrated)
        err = pred.tokens_per_s / r.tokens_per_s - 1
        jitter = r.step_time_p90_s / r.step_time_s
        steady = jitter <= STEADY_P90
        if steady:
            errors[cfg.tp].append(abs(err))
        print(f"{trial_name(r, ('seq_len',)):34s} {r.tokens_per_s:15.0f} {pred.tokens_per_s:10.0f} "
              f"{err:+7.1%} {jitter:10.2f}{'' if steady else '  (disturbed: not scored)'}")
    scored = errors[1] + errors[2]
    mape = {tp: sum(e) / len(e) for tp, e in errors.items() if e}
    for tp, value in mape.items():
        print(f"{precision} tp {tp} MAPE {value:.1%} over {len(errors[tp])} trials")
    if len(errors[1]) < MIN_TRIALS:
        pytest.skip(f"{precision}: only {len(errors[1])} steady tp-1 trials (need {MIN_TRIALS}): the "
                    "machine was too busy to score the model")
    study = sum(scored) / len(scored)
    print(f"{precision} study MAPE {study:.1%} over {len(scored)} trials (bound {MAPE_BOUND:.0%}, "
          "target 15%)")
    # Held to the bound in both precisions on every CPU, the study and its tp-1 trials apart. With
    # bf16 emulated the model once predicted these trials 5-7x too slow (MAPE 76%, 2026-12-04):
    # calibrate timed one GEMM layout, which emulated bf16 runs several times slower than the three
    # an nn.Linear runs (kernels.gemm_curve). The tp-2 trials were once put at -1% to +102% (two
    # per precision, printed apart above): AutoTP's all-reduce per column-parallel Linear and the
    # in-step cost of each TP all-reduce were not in the model (params.tp_all_reduce_per_linear,
    # tp_collective_overhead_s, which calibrate now solves from its reference step at tp 2). With
    # the LM head priced vocab-parallel the bf16 tp-2 trials came out +25% to +48% too fast (CI and
    # here, 2026-12-07): AutoTP keeps gpt2-tiny's tied head whole on every rank and gathers an
    # untied head's logits (layouts.lm_head_split). And one quick calibration whose fp32 parts ran
    # 28% over its step put the fp32 trials 27% too slow: the step factors are now solved per
    # precision (params.PER_PRECISION).
    assert mape[1] <= MAPE_BOUND
    assert study <= MAPE_BOUND
