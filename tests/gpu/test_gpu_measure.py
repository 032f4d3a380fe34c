"""Measurement on real NVIDIA GPUs: NVML meters on the trial's own devices (by UUID), CUDA peak memory,
an NCCL collective metered through the per-node path, NCCL kernels classified in a real trace.

Marked ``gpu``: tests/conftest.py skips them where torch sees no CUDA device. The NCCL-trace test also
needs two GPUs (NCCL refuses two ranks on one GPU, and a one-rank NCCL all_reduce launches no
collective kernel to classify).
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _busy(device, seconds: float) -> None:
    """bf16 matmuls for ``seconds`` of wall time (a measurable power draw)."""
    import torch

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)


def test_nvml_meter_reads_the_trials_device():
    import torch

    from scalestudy.measure.devices import cuda_device_uuid
    from scalestudy.measure.energy import NvmlMeter

    device = torch.device("cuda", 0)
    uuid = cuda_device_uuid(device)
    assert uuid.startswith(("GPU-", "MIG-")), uuid
    meter = NvmlMeter(device_uuids=[uuid])  # found among NVML's devices whatever CUDA_VISIBLE_DEVICES says
    meter.start()
    _busy(device, 1.0)
    with meter.excluded():
        time.sleep(0.2)
    _busy(device, 1.0)
    r = meter.stop()
    assert r.source == "nvml" and list(r.power_w_per_device) == [uuid]
    assert r.energy_j > 0 and 20.0 < r.power_w < 2000.0, r  # a busy data-centre GPU board
    assert r.excluded_intervals == 1 and r.excluded_s >= 0.2 and r.duration_s >= 2.0


def test_cuda_peak_reserved_covers_allocated_and_nvml_sees_more():
    import torch

    from scalestudy.measure.memory import memory_reading, reset_peak

    device = torch.device("cuda", 0)
    reset_peak(device)
    keep = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # 256 MiB
    spike = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    del spike  # freed to the cache: allocated drops, reserved stays
    m = memory_reading(device)
    assert m.source == "cuda_allocator" and not m.missing, m.missing
    assert m.allocated_gib >= 0.75 and m.reserved_gib >= m.allocated_gib
    # NVML counts the CUDA context too (and whatever else runs on the GPU)
    assert m.device_used_gib >= m.reserved_gib
    del keep


def _nccl_meter_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from scalestudy.measure.devices import cuda_device_uuid, gather_node_devices
    from scalestudy.measure.meters import TrialMeters

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    node = gather_node_devices(device)
    meters = TrialMeters("gpu", node)
    x = torch.ones(64 * 2**20, device=device)  # 256 MiB fp32
    dist.all_reduce(x)  # NCCL communicators up before the window
    torch.cuda.synchronize(device)
    meters.start()
    t = time.perf_counter()
    while time.perf_counter() - t < 1.5:
        dist.all_reduce(x)
        torch.cuda.synchronize(device)
    meters.stop()
    res = meters.reduce(device)
    out = {"uuid": cuda_device_uuid(device), "node_uuids": node.uuids, "owner": node.is_owner,
           "energy": res.energy.energy_j, "source": res.energy.source, "power": res.energy.power_w,
           "util": res.utilization, "n_util": res.devices_utilization}
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def test_nccl_collective_metered_on_the_trials_devices(tmp_path):
    import torch.multiprocessing as mp

    world = min(2, _gpus())
    mp.spawn(_nccl_meter_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    rs = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]
    uuids = [r["uuid"] for r in rs]
    assert len(set(uuids)) == world
    assert rs[0]["owner"] and not any(r["owner"] for r in rs[1:])  # one meter on the node
    for r in rs:
        assert r["node_uuids"] == uuids  # the owner meters exactly the trial's devices
        assert r["source"] == "nvml" and r["energy"] > 0 and 20.0 < r["power"] < 2000.0, r
        assert r["n_util"] == world and 0 < r["util"] <= 100


def _nccl_trace_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from scalestudy.measure.profiled_window import run_profiled_micro_batches

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    a = torch.randn(4096, 4096, device=device)
    grad = torch.ones(16 * 2**20, device=device)  # 64 MiB

    def micro_batch(step: int, k: int) -> None:
        a @ a
        dist.all_reduce(grad)

    micro_batch(0, 0)  # communicator and cuBLAS set up outside the window
    pw = run_profiled_micro_batches(micro_batch, 4, cap=2, device=device, first_step=1)
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump(pw.summary(), f)
    dist.destroy_process_group()


def test_nccl_kernels_are_communication_in_a_real_trace(tmp_path):
    import torch.multiprocessing as mp

    if _gpus() < 2:
        pytest.skip("needs 2 GPUs: NCCL puts no two ranks on one GPU, and one rank launches no kernel")
    mp.spawn(_nccl_trace_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        s = json.loads((tmp_path / f"r{r}.json").read_text())
        assert s["comm_trace_device"] == "gpu" and s["micro_batches_profiled"] == 2
        ar = s["comm"]["all_reduce"]
        assert ar["count"] == 4 and ar["bytes"] == 4 * 64 * 2**20  # 4 micro-batches per step
        assert ar["time_s"] > 0 and ar["bus_bytes"] == pytest.approx(ar["bytes"])  # 2(n-1)/n = 1
        assert 0 < s["comm_time_s"] and 0 <= s["comm_exposed_fraction"] <= 1
