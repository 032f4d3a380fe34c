"""Pipeline parallelism measured on this machine against the performance model (issue 33).

Three checks, on pipelines of two stages over this machine's cores (gloo, one core per rank, fp32,
torch.distributed.pipelining through train/schedules.py, the path a pp > 1 trial runs):
  * the bubble: GPipe over two balanced stages (eight equal blocks of width 256, a 256-token
    vocabulary, so the LM head and loss weigh little) with m = 2, 4, 8 micro-batches of 4 x 256
    tokens; the measured bubble fraction (a stage's idle share of the schedule, from the timestamps
    of its micro-batches' forwards and backwards) against Narayanan et al.'s (p - 1) / (m + p - 1),
    within 0.05. Why micro-batches of ~0.35 s: on this machine a p2p transfer waits
    several ms for its sender's core (gloo's threads share it with the compute) and adds to the
    receiver's idle time once per micro-batch; with 30 ms micro-batches that alone put m = 8 at
    0.21 against 0.11, with 0.19 s ones at 0.175 (2026-12-06). The other way, a stage computing alone in the fill or drain
    runs up to 2x faster than when both cores compute (shared_node_slowdown), which pulls the
    measured bubble of small m below the formula;
  * memory under 1F1B: the first stage keeps up to pp micro-batches' activations, the last one, so
    stage 0 holds at least what the last stage holds (blocks wide enough that activations, not the
    LM head, decide: 8 micro-batches of 4 x 256 tokens at width 256);
  * the model out of sample: `calibrate --local --quick` (fp32) measures the send/recv curve and
    the pipeline reference step (llama2-calib at pp 2, 4 x 2 x 192 tokens, calibrate/reference_step.py);
    the calibrated profile then predicts pipeline trials that share neither its model nor its
    tokens per micro-batch: GPipe, 1F1B, interleaved 1F1B and a stage split with fewer blocks on
    the last stage. Each trial's error printed; bound: see MAPE_BOUND.
Marked slow and quiet_machine (timings of this machine, as tests/validation/test_measured_cpu.py):
other processes taking the cores mid-window distort what is measured.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.quiet_machine]

WARMUP, STEPS = 2, 6
BUBBLE_TOLERANCE = 0.05
# A run whose step times spread wider than this (p90 / median) was disturbed by another process: its
# idle time inside the step is not the schedule's, so it is reported and not scored (as
# test_measured_cpu.py does with its held-out trials).
STEADY_JITTER = 1.10
# Issue 33's bound: MAPE <= 20% over the scored trials, none beyond 35%. History: 2026-12-06 (AMD
# EPYC, native bf16) 22% (+14, +17, +32, +26%), the compute model over-predicting these blocks by
# 22-35%. Three changes since (2026-12-07, AMD EPYC Zen 3 without native bf16, quiet): the stages
# as the trial splits them (predict passes stage_layers and virtual stages to the step time),
# attention rows chosen by tile shape, not batch x heads (compute.py), and pipeline_compute_factor
# solved from the pipeline reference step by calibrate (params.py). Re-scored on one measured set:
# 25.9% (blocks only), 21% (+ attention rows), 12.2% (+ the factor): -15, -3, +9, +22%.
MAPE_BOUND, TRIAL_BOUND = 0.20, 0.35


def _dims(h: int, layers: int, ffn: int, vocab: int, heads: int = 4) -> dict:
    return {"architecture": "llama", "hidden_size": h, "num_layers": layers, "num_heads": heads,
            "num_kv_heads": heads, "ffn_hidden_size": ffn, "vocab_size": vocab, "max_seq_len": 512}


BALANCED = {"name": "pp-balanced", "dims": _dims(256, 8, 688, 256)}
WIDE = {"name": "pp-wide", "dims": _dims(256, 4, 688, 256)}
HELDOUT = {"name": "pp-heldout", "dims": _dims(192, 6, 512, 1024)}  # head_dim 48

# name -> spec of a world-2, pp-2 trial (fp32, cpu-local)
BUBBLE = {f"gpipe-m{m}": {"model": BALANCED, "seq_len": 256, "micro_batch": 4,
                          "global_batch": 4 * m, "schedule": "gpipe"} for m in (2, 4, 8)}
MEMORY = {"1f1b-memory": {"model": WIDE, "seq_len": 256, "micro_batch": 4, "global_batch": 32,
                          "schedule": "1f1b"}}
# 256, 512 and 1,024 tokens per micro-batch (the reference runs 384); every schedule and a split
# with fewer blocks on the last stage.
SCORED = {
    "gpipe-s128-mb2-m4": {"model": HELDOUT, "seq_len": 128, "micro_batch": 2, "global_batch": 8,
                          "schedule": "gpipe"},
    "1f1b-s256-mb2-m8": {"model": HELDOUT, "seq_len": 256, "micro_batch": 2, "global_batch": 16,
                         "schedule": "1f1b"},
    "interleaved-v3-s128-mb4-m4": {"model": HELDOUT, "seq_len": 128, "micro_batch": 4,
                                   "global_batch": 16, "schedule": "interleaved_1f1b",
                                   "virtual_stages": 3},
    "1f1b-last-fewer2-s256-mb4-m4": {"model": HELDOUT, "seq_len": 256, "micro_batch": 4,
                                     "global_batch": 16, "schedule": "1f1b",
                                     "last_stage_fewer_layers": 2},
}


def config(spec: dict, hardware="cpu-local"):
    from scalestudy.spec.load import validate_spec
    from scalestudy.spec.study import expand

    (p,) = expand(validate_spec({"name": "pp-validation", "hardware": hardware, "precision": "fp32",
                                 "world_size": 2, "pp": 2, **spec}))
    assert p.feasible, p.reason
    return p.config


def _rank_main(rank: int, jobs: dict, port: int, out: str) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from scalestudy.train.host_memory import retain_freed_memory
    from scalestudy.train.schedules import measure_steps
    from tests.fixtures.ranks import leave

    retain_freed_memory()  # as every CPU trial process (train/process.py)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for name, spec in jobs.items():
        times, reading = measure_steps(config(spec), torch.device("cpu"), WARMUP, STEPS)
        results[name] = {"times": times, "reading": reading.model_dump()}
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    leave()


def _measure(jobs: dict, folder: Path) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = folder / "measured.json"  # kept, as the profile
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    mp.start_processes(_rank_main, args=(jobs, port, str(out)), nprocs=2, start_method="spawn")
    print(f"\n{len(jobs)} pipeline trials in {time.perf_counter() - t0:.0f} s (load average "
          f"{load:.1f} before, {os.getloadavg()[0]:.1f} after)")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """Before the trials: the quick local calibration, fp32 (as `make demo` runs it), kept beside
    the measurements (pytest's temporary folder) to look at afterwards."""
    from scalestudy.calibrate.local import calibrate_local
    from scalestudy.spec import catalog
    from scalestudy.spec.catalog import write_profile

    profile = calibrate_local(catalog.get_hardware("cpu-local"), quick=True, precisions=["fp32"])
    cal = profile.calibration
    path = tmp_path_factory.mktemp("pp-profile") / "calibrated-cpu-local.yaml"
    write_profile(profile, path)
    print(f"\ncalibrated ({path}): send/recv {cal['busbw_gbps_send_recv']}; pipeline reference "
          f"step {cal.get('reference_step_s_fp32_ws2_pp2', float('nan')):.4f} s")
    return profile


@pytest.fixture(scope="module")
def measured(calibrated, tmp_path_factory):
    return _measure({**BUBBLE, **MEMORY, **SCORED}, tmp_path_factory.mktemp("pp-measured"))


def test_gpipe_bubble_follows_narayanan(measured):
    from scalestudy.train.pipeline_summary import PipelineReading

    print("\nGPIPE, pp 2: bubble fraction measured (per stage) vs (p-1)/(m+p-1)")
    misses, disturbed = [], []
    for name in BUBBLE:
        r = PipelineReading(**measured[name]["reading"])
        stages = ", ".join(f"{s.bubble_fraction:.3f}" for s in r.stages)
        print(f"  {name}: {r.bubble_fraction:.3f} ({stages}) vs {r.expected_bubble_fraction:.3f}; "
              f"imbalance {r.stage_imbalance:.3f}, p2p {r.p2p_ops:.0f} ops {r.p2p_bytes / 1e6:.2f} MB "
              f"{r.p2p_time_s * 1e3:.1f} ms blocked, step {statistics.median(measured[name]['times']):.3f} s")
        times = sorted(measured[name]["times"])
        jitter = times[int(0.9 * (len(times) - 1))] / statistics.median(times)
        if jitter > STEADY_JITTER:  # another process took the cores mid-window: idle time not ours
            print(f"    disturbed (step p90/median {jitter:.2f}): not scored")
            disturbed.append(name)
        elif abs(r.bubble_fraction - r.expected_bubble_fraction) > BUBBLE_TOLERANCE:
            misses.append(name)
    if len(disturbed) == len(BUBBLE):
        pytest.skip(f"every gpipe run was disturbed (step p90/median > {STEADY_JITTER}): no bubble "
                    "measured on this machine now")
    assert not misses, misses


def test_first_stage_holds_more_memory_under_1f1b(measured):
    """The schedule's memory: activations held for backwards (exact byte counts of the saved
    tensors, train/schedules.ActivationTracker). The process RSS is printed beside it: on CPU it
    is the allocator's retained heap since the warm-up (train/host_memory.py), the interpreter and
    the libraries, where a stage's extra micro-batch is a few percent."""
    from scalestudy.train.pipeline_summary import PipelineReading

    r = PipelineReading(**measured["1f1b-memory"]["reading"])
    first, last = r.stages[0], r.stages[-1]
    print(f"\n1F1B activations held at most: stage 0 {first.activation_peak_gib * 1024:.1f} MiB, "
          f"stage 1 {last.activation_peak_gib * 1024:.1f} MiB; process peak RSS: stage 0 "
          f"{first.peak_memory_gib:.3f} GiB, stage 1 {last.peak_memory_gib:.3f} GiB")
    assert first.activation_peak_gib >= last.activation_peak_gib


def test_model_out_of_sample(calibrated, measured):
    from scalestudy.perfmodel.predict import predict

    ref = calibrated.calibration.get("reference_step_s_fp32_ws2_pp2")
    if ref:
        from scalestudy.calibrate.reference_step import reference_config

        cfg = reference_config("fp32", 2, pp=2).model_copy(
            update={"hardware_profile": calibrated, "hardware": calibrated.name})
        print(f"\npipeline_compute_factor {calibrated.calibration.get('pipeline_compute_factor')}")
        print(f"IN SAMPLE: the pipeline reference step {ref:.4f} s, predicted "
              f"{predict(cfg).step_time_s:.4f} s")
    print("\nOUT OF SAMPLE (pp 2, world 2): step time measured vs predicted")
    errors = {}
    for name, spec in SCORED.items():
        cfg = config(spec).model_copy(update={"hardware_profile": calibrated,
                                              "hardware": calibrated.name})
        pred = predict(cfg)
        got = statistics.median(measured[name]["times"])
        reading = measured[name]["reading"]
        errors[name] = pred.step_time_s / got - 1
        print(f"  {name}: measured {got:.4f} s (bubble {reading['bubble_fraction']:.3f}), "
              f"predicted {pred.step_time_s:.4f} s (bubble {pred.bubble_time_s / pred.step_time_s:.3f}"
              f" of it): {errors[name]:+.1%}")
    mape = statistics.fmean(abs(e) for e in errors.values())
    print(f"  MAPE {mape:.1%} (issue 33's bound {MAPE_BOUND:.0%}: "
          f"{'met' if mape <= MAPE_BOUND else 'not met'})")
    assert mape <= MAPE_BOUND and all(abs(e) <= TRIAL_BOUND for e in errors.values()), errors
