"""Pipeline parallelism measured on this machine against the performance model (issue 33).

Three checks, on pipelines of two stages over this machine's cores (gloo, one core per rank, fp32,
torch.distributed.pipelining through train/schedules.py, the path a pp > 1 trial runs):
  * the bubble: GPipe over two balanced stages (eight equal blocks, a 128-token vocabulary, so the
    LM head and loss weigh little) with m = 2, 4, 8 micro-batches; the measured bubble fraction (a
    stage's idle share of the schedule, from the timestamps of its micro-batches' forwards and
    backwards) against Narayanan et al.'s (p - 1) / (m + p - 1), within 0.05;
  * memory under 1F1B: the first stage keeps up to pp micro-batches' activations, the last one, so
    stage 0's peak memory is at least the last stage's (blocks wide enough that activations, not
    the LM head, decide: 8 micro-batches of 4 x 256 tokens at width 256);
  * the model out of sample: `calibrate --local --quick` (fp32) measures the send/recv curve and
    the pipeline reference step (llama2-calib at pp 2, 4 x 2 x 192 tokens, calibrate/reference_step.py);
    the calibrated profile then predicts pipeline trials that share neither its model nor its
    tokens per micro-batch: GPipe, 1F1B, interleaved 1F1B and a stage split with fewer blocks on
    the last stage. Bound: MAPE of the step time <= 20% per trial, each printed.
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
MAPE_BOUND = 0.20


def _dims(h: int, layers: int, ffn: int, vocab: int, heads: int = 4) -> dict:
    return {"architecture": "llama", "hidden_size": h, "num_layers": layers, "num_heads": heads,
            "num_kv_heads": heads, "ffn_hidden_size": ffn, "vocab_size": vocab, "max_seq_len": 512}


BALANCED = {"name": "pp-balanced", "dims": _dims(128, 8, 352, 128)}
WIDE = {"name": "pp-wide", "dims": _dims(256, 4, 688, 256)}
HELDOUT = {"name": "pp-heldout", "dims": _dims(96, 6, 256, 1024)}  # head_dim 24, as gpt2-tiny

# name -> spec of a world-2, pp-2 trial (fp32, cpu-local)
BUBBLE = {f"gpipe-m{m}": {"model": BALANCED, "seq_len": 128, "micro_batch": 2,
                          "global_batch": 2 * m, "schedule": "gpipe"} for m in (2, 4, 8)}
MEMORY = {"1f1b-memory": {"model": WIDE, "seq_len": 256, "micro_batch": 4, "global_batch": 32,
                          "schedule": "1f1b"}}
SCORED = {
    "gpipe-s64-m4": {"model": HELDOUT, "seq_len": 64, "micro_batch": 2, "global_batch": 8,
                     "schedule": "gpipe"},
    "1f1b-s128-m8": {"model": HELDOUT, "seq_len": 128, "micro_batch": 1, "global_batch": 8,
                     "schedule": "1f1b"},
    "interleaved-v3-m4": {"model": HELDOUT, "seq_len": 128, "micro_batch": 2, "global_batch": 8,
                          "schedule": "interleaved_1f1b", "virtual_stages": 3},
    "1f1b-last-fewer2": {"model": HELDOUT, "seq_len": 256, "micro_batch": 1, "global_batch": 4,
                         "schedule": "1f1b", "last_stage_fewer_layers": 2},
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


def _measure(jobs: dict, folder: Path) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = folder / "measured.json"
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    mp.start_processes(_rank_main, args=(jobs, port, str(out)), nprocs=2, start_method="spawn")
    print(f"\n{len(jobs)} pipeline trials in {time.perf_counter() - t0:.0f} s (load average "
          f"{load:.1f} before, {os.getloadavg()[0]:.1f} after)")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def calibrated():
    """Before the trials: the quick local calibration, fp32 (as `make demo` runs it)."""
    from scalestudy.calibrate.local import calibrate_local
    from scalestudy.spec import catalog

    profile = calibrate_local(catalog.get_hardware("cpu-local"), quick=True, precisions=["fp32"])
    cal = profile.calibration
    print(f"\ncalibrated: send/recv {cal['busbw_gbps_send_recv']}; pipeline reference step "
          f"{cal.get('reference_step_s_fp32_ws2_pp2', float('nan')):.4f} s")
    return profile


@pytest.fixture(scope="module")
def measured(calibrated, tmp_path_factory):
    return _measure({**BUBBLE, **MEMORY, **SCORED}, tmp_path_factory.mktemp("pp-measured"))


def test_gpipe_bubble_follows_narayanan(measured):
    from scalestudy.train.pipeline_summary import PipelineReading

    print("\nGPIPE, pp 2: bubble fraction measured (per stage) vs (p-1)/(m+p-1)")
    misses = []
    for name in BUBBLE:
        r = PipelineReading(**measured[name]["reading"])
        stages = ", ".join(f"{s.bubble_fraction:.3f}" for s in r.stages)
        print(f"  {name}: {r.bubble_fraction:.3f} ({stages}) vs {r.expected_bubble_fraction:.3f}; "
              f"imbalance {r.stage_imbalance:.3f}, p2p {r.p2p_ops:.0f} ops {r.p2p_bytes / 1e6:.2f} MB "
              f"{r.p2p_time_s * 1e3:.1f} ms blocked, step {statistics.median(measured[name]['times']):.3f} s")
        if abs(r.bubble_fraction - r.expected_bubble_fraction) > BUBBLE_TOLERANCE:
            misses.append(name)
    assert not misses, misses


def test_first_stage_holds_more_memory_under_1f1b(measured):
    from scalestudy.train.pipeline_summary import PipelineReading

    r = PipelineReading(**measured["1f1b-memory"]["reading"])
    first, last = r.stages[0].peak_memory_gib, r.stages[-1].peak_memory_gib
    print(f"\n1F1B peak memory (process RSS): stage 0 {first:.3f} GiB, stage 1 {last:.3f} GiB")
    assert first >= last


def test_model_out_of_sample(calibrated, measured):
    from scalestudy.perfmodel.predict import predict

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
    print(f"  MAPE {mape:.1%}")
    assert all(abs(e) <= MAPE_BOUND for e in errors.values()), errors
