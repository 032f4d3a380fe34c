"""Construction at any size: a ~355M-parameter Llama at world 2 (two gloo ranks), built by the trial
body's constructor. Under ZeRO-3 (deepspeed.zero.Init) each rank's peak RSS while building stays below
0.6x the full fp32 model, and the model then trains (bf16, the precision CPU trials take on a CPU with
native bf16, and the dtype zero.Init builds in); the plain full fp32 build every rank made before is
measured beside it, so the test shows its measurement sees a whole model when one is built.

Peak RSS during construction: VmHWM after resetting it (``/proc/self/clear_refs`` = 5) just before the
build, minus VmRSS at that moment (imports, process group and its buffers, set up by a first
broadcast and all_reduce). ZeRO-3 is built first, then the plain model, so neither reuses the other's
freed heap.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch.multiprocessing as mp

from scalestudy.spec.catalog import ModelDims
from tests.conftest import trial

# hidden 1024, 24 layers, FFN 2560, vocab 32k, untied: 355.0M parameters (1.32 GiB in fp32).
DIMS = ModelDims(architecture="llama", hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=16,
                 ffn_hidden_size=2560, vocab_size=32000, max_seq_len=128)
SETS = ["world_size=2", "zero_stage=3", "precision=bf16", "micro_batch=1", "seq_len=32",
        "steps={warmup: 0, measure: 5, profile: 0}"]
GIB = 1024**3


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _construction_peak_gib(build) -> tuple[object, float]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = _status_kib("VmRSS")
    model = build()
    return model, (_status_kib("VmHWM") - base) / 1024**2


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    from scalestudy.parallel.deepspeed_config import deepspeed_config
    from scalestudy.train.body import Trial
    from scalestudy.train.construct import build_trial_model
    from scalestudy.train.model_factory import build_model
    from scalestudy.train.process import init_process_group

    cfg = trial(SETS).model_copy(update={"model_dims": DIMS})
    device = init_process_group(cfg, rank)
    ds_config = deepspeed_config(cfg)
    # The process group's first collectives set up its buffers: before the measured window.
    torch.distributed.broadcast(torch.zeros(64 << 20, dtype=torch.uint8), 0)
    torch.distributed.all_reduce(torch.zeros(1 << 20))
    model, zero_gib = _construction_peak_gib(lambda: build_trial_model(cfg, ds_config, device))
    full, full_gib = _construction_peak_gib(lambda: build_model(DIMS, cfg.seed))
    n_params = sum(p.numel() for p in full.parameters())
    del full
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    t = Trial(cfg, cfg.layout, engine, device, rank, ds_config)
    losses = [float(t.step(s)) for s in range(5)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"params": n_params, "full_gib": full_gib, "zero_init_gib": zero_gib,
                   "losses": losses, "threads": torch.get_num_threads()}, f)


@pytest.mark.slow
def test_zero3_builds_a_355m_llama_partitioned_and_trains(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(2, port, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    fp32_gib = ranks[0]["params"] * 4 / GIB
    assert 340e6 < ranks[0]["params"] < 370e6
    for r in ranks:
        print(f"peak RSS while building: zero.Init {r['zero_init_gib']:.3f} GiB = "
              f"{r['zero_init_gib'] / fp32_gib:.3f}x, plain {r['full_gib']:.3f} GiB = "
              f"{r['full_gib'] / fp32_gib:.3f}x of the {fp32_gib:.3f} GiB fp32 model")
        assert r["zero_init_gib"] < 0.6 * fp32_gib, r
        assert r["full_gib"] > 0.9 * fp32_gib, r  # the measurement sees a whole model when built
        assert r["losses"][-1] < r["losses"][0], r["losses"]
