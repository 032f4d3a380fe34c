"""The performance model against this machine, on shapes calibration never ran (issue 15).

Calibrate `cpu-local` (quick, --local: no Ray) in fp32 and bf16, sweep the held-out study
experiments/cpu_heldout.yaml for real in both precisions (gpt2-tiny, sequence lengths 64 and 256,
gradient accumulation 2, tp 2, world 1 and 2), predict the same trials with the calibrated profile
and compare tokens/s. Two tables, kept apart:
  * in sample: the reference steps calibrate solved its two step factors from (llama2-calib,
    2 x 192 tokens, world 1 and 2): what calibrate can replay, near 0 by construction;
  * out of sample: every held-out trial, which shares no model, sequence length or tokens per
    micro-batch with anything calibrate ran (tests/unit/test_calibrate_local.py). Bound: MAPE 25%
    per precision over the tp-1 trials (target 15%); the tp-2 trials are scored apart and a miss
    of the bound there is an expected failure with its measured causes (see the test).
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

from scalestudy.calibrate.reference_step import reference_config
from scalestudy.perfmodel.predict import predict
from scalestudy.spec import catalog
from scalestudy.spec.load import load_spec, plan
from scalestudy.spec.precision import cpu_has_native_bf16
from scalestudy.spec.trial import trial_name

HELDOUT = Path(__file__).resolve().parents[2] / "experiments" / "cpu_heldout.yaml"
PRECISIONS = ["fp32", "bf16"]
MAPE_BOUND = 0.25
STEADY_P90 = 1.3
MIN_TRIALS = 3

pytestmark = pytest.mark.slow


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
    planned = [p for p in plan(spec) if p.feasible and p.config.grad_accum == 2]
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
          f"{'reference':28s} {'measured s':>11s} {'predicted':>10s} {'error':>7s}")
    world = int(calibrated.calibration.get("calibration_world_size", 1))
    rows = 0
    for prec in PRECISIONS:
        for ws in sorted({1, world}):
            measured = calibrated.calibration.get(f"reference_step_s_{prec}_ws{ws}")
            if measured is None:
                continue
            cfg = reference_config(prec, ws).model_copy(
                update={"hardware_profile": calibrated, "hardware": calibrated.name})
            pred = predict(cfg, hardware=calibrated).step_time_s
            print(f"{trial_name(cfg):28s} {measured:11.4f} {pred:10.4f} {pred / measured - 1:+7.1%}")
            rows += 1
    assert rows >= len(PRECISIONS)


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
    mape = {tp: sum(e) / len(e) for tp, e in errors.items() if e}
    for tp, value in mape.items():
        print(f"{precision} tp {tp} MAPE {value:.1%} over {len(errors[tp])} trials (bound "
              f"{MAPE_BOUND:.0%}, target 15%)")
    if len(errors[1]) < MIN_TRIALS:
        pytest.skip(f"{precision}: only {len(errors[1])} steady tp-1 trials (need {MIN_TRIALS}): the "
                    "machine was too busy to score the model")
    # Held to the bound in both precisions on every CPU. With bf16 emulated the model once predicted
    # these trials 5-7x too slow (MAPE 76%, 2026-12-04): calibrate timed one GEMM layout, which
    # emulated bf16 runs several times slower than the three an nn.Linear runs (kernels.gemm_curve).
    assert mape[1] <= MAPE_BOUND
    if not errors[2]:
        pytest.skip(f"{precision}: no steady tp-2 trial to score")
    if mape[2] > MAPE_BOUND:
        # Known miss, measured 2026-12-04 (EPYC, 2 cores): tp 2 has run since the gpt blocks became
        # OPT (it never ran before), and over four runs the model put its trials at -1% to +98%.
        # Two causes seen: DeepSpeed's AutoTP all-reduces the input gradient of every column-parallel
        # Linear in backward (q, k, v, fc1: 4 per block) where the model counts Megatron's 2
        # (perfmodel/parallelism.py), and the quick calibration's small all_reduce (4 KiB, gloo)
        # varies several-fold run to run. The bound is unmet for tp 2 (issue 15, deliverable 5).
        pytest.xfail(f"tp 2: MAPE {mape[2]:.1%} > {MAPE_BOUND:.0%} (known miss: AutoTP's per-Linear "
                     "backward all-reduces are not in the model; noisy small all_reduce calibration)")
