"""Pipeline parallelism trains the same model: per-step losses of pp > 1 against pp = 1 (issue 33).

fp32, one seed, equal global batch, 5 steps, on gloo in plain processes (no Ray):
  * pp = 1: the trial body's own path (train/body.py build: DeepSpeed ZeRO-0, world 1);
  * pp = 2 under each schedule (gpipe, 1f1b, interleaved_1f1b with 2 chunks per rank): within 1e-5;
  * world 4 as pp 2 x tp 2 and as pp 2 x dp 2 with ZeRO-1: within 1e-4.
Four processes are started once and run every layout in turn, each in a fresh process group of its
own world size (the ranks beyond it wait): the imports are paid once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

STEPS = 5
MODEL = {"name": "pp-exact", "dims": {"architecture": "llama", "hidden_size": 64, "num_layers": 4,
                                      "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 176,
                                      "vocab_size": 256, "max_seq_len": 128}}
BASE = {"name": "pp-exact", "model": MODEL, "hardware": "cpu-local", "precision": "fp32",
        "seq_len": 32, "micro_batch": 1, "global_batch": 8,
        "steps": {"warmup": 0, "measure": STEPS, "profile": 0}}
LAYOUTS = {
    "pp1": {"world_size": 1},
    "gpipe": {"world_size": 2, "pp": 2, "schedule": "gpipe"},
    "1f1b": {"world_size": 2, "pp": 2, "schedule": "1f1b"},
    "interleaved": {"world_size": 2, "pp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2},
    "pp2xtp2": {"world_size": 4, "pp": 2, "tp": 2},
    "pp2xdp2-z1": {"world_size": 4, "pp": 2, "zero_stage": 1},
}


def config(layout: dict):
    from scalestudy.plan import plan_study
    from scalestudy.spec.load import validate_spec

    (planned,) = plan_study(validate_spec({**BASE, **layout}))
    assert planned.feasible, planned.reason
    return planned.config


def run_layout(name: str, cfg, rank: int) -> dict:
    """The losses of STEPS steps of ``cfg`` on this rank's process group (and, for a pipeline,
    the activations each stage held at most, its p2p operations and bytes per step)."""
    import torch

    device = torch.device("cpu")
    if cfg.pp == 1:
        import deepspeed

        from scalestudy.train.body import build

        deepspeed.init_distributed(dist_backend="gloo")
        trial = build(cfg, device)
        return {"losses": [trial.step(s).item() for s in range(STEPS)]}
    from scalestudy.train.schedules import PipelineTrainer, mean_losses, process_groups

    trainer = PipelineTrainer(cfg, cfg.layout, device, process_groups(cfg.layout, "cpu"))
    losses = mean_losses([trainer.step(s) for s in range(STEPS)], cfg.layout, device)
    reading = trainer.reading(range(STEPS))
    return {"losses": losses, "held": [s.activation_peak_gib * 2**30 for s in reading.stages],
            "p2p_ops": reading.p2p_ops, "p2p_bytes": reading.p2p_bytes}


def _rank_main(rank: int, jobs: list[tuple[str, dict]], folder: str) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch
    import torch.distributed as dist

    from tests.fixtures.ranks import leave

    torch.set_num_threads(1)
    for name, layout in jobs:
        cfg = config(layout)
        if rank >= cfg.world_size:
            continue
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.world_size))
        # A file store per job, not a port chosen up front: a port picked before the first job
        # was taken by a connection of an earlier one once (EADDRINUSE in the suite).
        dist.init_process_group("gloo", init_method=f"file://{folder}/{name}.store", rank=rank,
                                world_size=cfg.world_size)
        try:
            result = run_layout(name, cfg, rank)
        finally:
            dist.destroy_process_group()
        if rank == 0:
            Path(folder, f"{name}.json").write_text(json.dumps(result))
    leave()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    import torch.multiprocessing as mp

    folder = tmp_path_factory.mktemp("pp-exact")
    jobs = list(LAYOUTS.items())
    mp.start_processes(_rank_main, args=(jobs, str(folder)), nprocs=4, start_method="spawn")
    return {name: json.loads((folder / f"{name}.json").read_text()) for name in LAYOUTS}


@pytest.fixture(scope="module")
def losses(runs) -> dict[str, list[float]]:
    return {name: run["losses"] for name, run in runs.items()}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_pp2_schedules_match_pp1(losses, name):
    ref, got = losses["pp1"], losses[name]
    print(f"\n{name}: {got}\npp1: {ref}")
    assert len(got) == len(ref) == STEPS
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-5, (got, ref)
    assert ref[-1] < ref[0]  # it trains: the comparison is not of constant losses


@pytest.mark.parametrize("name", ["pp2xtp2", "pp2xdp2-z1"])
def test_world4_compositions_match_world1(losses, name):
    ref, got = losses["pp1"], losses[name]
    print(f"\n{name}: {got}\npp1: {ref}")
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-4, (got, ref)


def test_the_schedule_decides_what_each_stage_holds(runs):
    """1F1B: the first stage holds the activations of up to pp micro-batches, the last one of one;
    GPipe: every stage all m = 8 (exact counts of saved tensors: no timing). Two blocks a stage;
    the last stage's loss adds its logits' share."""
    gpipe, one_f_one_b = runs["gpipe"]["held"], runs["1f1b"]["held"]
    print(f"\nactivations held at most (bytes): gpipe {gpipe}, 1f1b {one_f_one_b}")
    assert one_f_one_b[0] >= one_f_one_b[1]
    assert gpipe[0] == 4 * one_f_one_b[0]  # 8 micro-batches against 2, the same blocks
    assert gpipe[1] > 4 * one_f_one_b[1]


def test_p2p_traffic_per_step(runs):
    """pp 2, 8 micro-batches: each rank sends 8 and receives 8 tensors of 32 x 64 fp32 (8 KiB) a
    step, as the performance model counts them (parallelism.p2p_ops_per_rank)."""
    for name in ("gpipe", "1f1b"):
        assert runs[name]["p2p_ops"] == 16 and runs[name]["p2p_bytes"] == 16 * 32 * 64 * 4
    assert runs["interleaved"]["p2p_ops"] == 4 * 8 * 3 / 2  # 3 boundaries between 4 chunks
