"""Construction at any size, at world 2 (two gloo ranks), built by the trial body's constructor:

* ZeRO-3: a ~355M-parameter Llama built under deepspeed.zero.Init: each rank's peak RSS while building
  stays below 0.6x the full fp32 model, and the model then trains (bf16, the precision CPU trials take
  on a CPU with native bf16, and the dtype zero.Init builds in).
* AutoTP at tp 2 (stage 0, fp32): a ~306M Llama built on meta and sharded there by
  deepspeed.initialize, each rank materialising only its shards: peak RSS through the build and
  deepspeed.initialize below 0.7x the full fp32 model (a rank's shards are 0.513x of it), then
  trains.

The plain full fp32 build every rank made before is measured beside each, so the test shows its
measurement sees a whole model when one is built.

Peak RSS during construction: VmHWM after resetting it (``/proc/self/clear_refs`` = 5) just before the
build, minus VmRSS at that moment (imports, the model's modules among them, and the process group
and its buffers, set up by a first broadcast and all_reduce). The trial's model is built first, then the plain one, so neither reuses the
other's freed heap.
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
COMMON = ["world_size=2", "micro_batch=1", "seq_len=32", "steps={warmup: 0, measure: 5, profile: 0}"]
ZERO3 = [*COMMON, "zero_stage=3", "precision=bf16"]
# AutoTP leaves the embedding replicated: a small vocabulary keeps the sharded blocks the bulk.
TP_DIMS = DIMS.model_copy(update={"vocab_size": 8000})  # 305.8M parameters
AUTOTP = [*COMMON, "zero_stage=0", "tp=2", "precision=fp32"]
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


def _worker(rank: int, world: int, port: int, out: str, sets: list[str], dims: dict,
            through_initialize: bool) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    import torch

    from scalestudy.parallel.deepspeed_config import deepspeed_config
    from scalestudy.train.body import Trial
    from scalestudy.train.construct import build_trial_model, check_materialised, model_class
    from scalestudy.train.model_factory import build_model
    from scalestudy.train.process import init_process_group

    model_dims = ModelDims(**dims)
    cfg = trial(sets).model_copy(update={"model_dims": model_dims})
    device = init_process_group(cfg, rank)
    ds_config = deepspeed_config(cfg)
    # The process group's first collectives set up its buffers, and the model's and AutoTP's
    # modules are imported (~0.13 GiB): before the measured window.
    torch.distributed.broadcast(torch.zeros(64 << 20, dtype=torch.uint8), 0)
    torch.distributed.all_reduce(torch.zeros(1 << 20))
    model_class(model_dims)
    import deepspeed.module_inject.auto_tp  # noqa: F401

    def build():
        model = build_trial_model(cfg, ds_config, device)
        if not through_initialize:
            return model, None
        # AutoTP shards (and the shards are materialised) inside initialize; fp32 stage 0 creates
        # no optimizer state there (torch's Adam allocates it at the first step).
        return model, deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)[0]

    (model, engine), built_gib = _construction_peak_gib(build)
    full, full_gib = _construction_peak_gib(lambda: build_model(model_dims, cfg.seed))
    n_params = sum(p.numel() for p in full.parameters())
    del full
    if engine is None:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config)
    check_materialised(engine.module)
    t = Trial(cfg, cfg.layout, engine, device, rank, ds_config)
    losses = [float(t.step(s)) for s in range(5)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"params": n_params, "full_gib": full_gib, "built_gib": built_gib,
                   "losses": losses, "threads": torch.get_num_threads()}, f)


def _run(tmp_path, sets: list[str], dims: ModelDims, through_initialize: bool) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(2, port, str(tmp_path), sets, dims.model_dump(), through_initialize),
                       nprocs=2, start_method="spawn")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _check(ranks: list[dict], label: str, bound: float) -> None:
    fp32_gib = ranks[0]["params"] * 4 / GIB
    for r in ranks:
        print(f"peak RSS while building: {label} {r['built_gib']:.3f} GiB = "
              f"{r['built_gib'] / fp32_gib:.3f}x, plain {r['full_gib']:.3f} GiB = "
              f"{r['full_gib'] / fp32_gib:.3f}x of the {fp32_gib:.3f} GiB fp32 model")
        assert r["built_gib"] < bound * fp32_gib, r
        assert r["full_gib"] > 0.9 * fp32_gib, r  # the measurement sees a whole model when built
        assert r["losses"][-1] < r["losses"][0], r["losses"]


@pytest.mark.slow
def test_zero3_builds_a_355m_llama_partitioned_and_trains(tmp_path):
    ranks = _run(tmp_path, ZERO3, DIMS, through_initialize=False)
    assert 340e6 < ranks[0]["params"] < 370e6
    _check(ranks, "zero.Init", 0.6)


@pytest.mark.slow
def test_autotp_builds_each_rank_its_shards_only_and_trains(tmp_path):
    ranks = _run(tmp_path, AUTOTP, TP_DIMS, through_initialize=True)
    assert 295e6 < ranks[0]["params"] < 315e6
    # A rank's shards are 0.513x of the fp32 model (the embedding is replicated); measured 0.56x and
    # 0.61x (AMD EPYC Zen 4): one full weight drawn at a time and the engine. Materialising the whole
    # model before AutoTP shards it, as before, peaks at >= 1.0x.
    _check(ranks, "AutoTP on meta", 0.7)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the TP group computes one model
