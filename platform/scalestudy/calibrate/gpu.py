"""Calibration of this machine's NVIDIA GPUs, with no Ray: `scalestudy calibrate` on a GPU profile and
`make gpu-check` (scalestudy/gpucheck.py) use it.

    profile = calibrate_local_gpus(base, quick=False)     # base: the catalogue entry it starts from

What is measured, and the profile figure it replaces (perfmodel/params.py, network.py):
  * GEMM TFLOP/s at Llama projection/MLP shapes in bf16 on cuda:0 (CUDA events, median):
    `gemm_tflops_bf16` ([FLOPs, TFLOP/s]); the best point over the datasheet peak as gemm_efficiency.
  * HBM bandwidth (a device-to-device copy of 1 GiB, read + write bytes): hbm_gbps, hbm_efficiency 1.
  * Fused causal attention (scaled_dot_product_attention) forward and backward at the check's model
    shapes: `attention_s_bf16` rows [batch*heads, seq, head_dim, forward s, backward s].
  * all_reduce / all_gather / reduce_scatter bus bandwidth vs size over NCCL between every local
    GPU (one process per GPU, nccl-tests' method: warm-up, fixed count, median, slowest rank):
    `busbw_gbps_<op>` and the large-message all_reduce figure as nvlink_gbps_per_gpu. Across nodes:
    not measured here (one machine, no Ray); `scalestudy calibrate --across-nodes N` measures it on a
    Ray cluster with the same collectives (calibrate/across_nodes.py).
  * The reference DeepSpeed step (calibrate/reference_step.py's GPU shape) on one GPU and on all of
    them: in_step_slowdown and shared_node_slowdown, solved as for CPU profiles; and on one GPU at
    ZeRO stage 3: zero3_module_overhead_s, what stage 3's per-module hooks add where there is nothing
    to gather (measured on an H200 they were not hidden behind the kernels: see params.py).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from scalestudy import metrics as M
from scalestudy.metrics import CALIBRATED_COLLECTIVES, busbw_factor
from scalestudy.perfmodel.params import without_precision_ratios
from scalestudy.spec.catalog import HardwareProfile, get_hardware

# (tokens, K, N): TinyLlama-1.1B / Llama-7B projections and MLPs at 4k-16k tokens, then squares.
GEMM_SHAPES = [(4096, 2048, 2048), (4096, 2048, 5632), (4096, 5632, 2048), (8192, 4096, 4096),
               (8192, 4096, 11008), (8192, 8192, 8192)]
QUICK_GEMM_SHAPES = [(4096, 2048, 2048), (8192, 8192, 8192)]
ATTENTION_SHAPES = [(4, 32, 2048, 64), (2, 32, 4096, 128)]  # (batch, heads, seq, head_dim)
COMM_SIZES_BYTES = [2**k for k in range(16, 31, 2)]  # 64 KiB .. 1 GiB
QUICK_COMM_SIZES_BYTES = [2**20, 2**26]
REFERENCE_STEPS = 10


class NoCudaDevice(RuntimeError):
    """Calibrating GPUs on a machine where torch sees none."""


def base_profile_name(device_name: str) -> str:
    """The catalogue entry closest to a CUDA device name (H100 when nothing matches)."""
    name = device_name.upper()
    for key, profile in (("H200", "h200-141gb"), ("H100", "h100-80gb"), ("A100-SXM4-40GB", "a100-40gb"),
                         ("A100", "a100-80gb"), ("V100", "v100-32gb")):
        if key in name:
            return profile
    return "h100-80gb"


def cuda_time_s(fn, iters: int = 10, warmup: int = 3) -> float:
    """Median device time of ``fn`` over a fixed count (CUDA events around each call)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gemm_curve(shapes: list[tuple[int, int, int]]) -> list[list[float]]:
    import torch

    curve = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        t = cuda_time_s(lambda: a @ b)
        curve.append([2.0 * m * k * n, 2.0 * m * k * n / t / 1e12])
    return sorted(curve)


def hbm_gbps(gib: int = 1) -> float:
    import torch

    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time_s(lambda: dst.copy_(src))
    return 2 * src.numel() / t / 1e9  # each byte read once and written once


def attention_rows(shapes: list[tuple[int, int, int, int]]) -> list[list[float]]:
    import torch
    import torch.nn.functional as F

    rows = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        fwd = cuda_time_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grad = torch.ones_like(out)
        both = cuda_time_s(lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad))
        rows.append([float(b * h), float(s), float(d), fwd, max(both - fwd, 0.0)])
    return rows


def comm_curves_cuda(world: int, sizes: list[int]) -> dict[str, list[list[float]]]:
    import torch
    import torch.distributed as dist

    out: dict[str, list[list[float]]] = {}
    for op in CALIBRATED_COLLECTIVES:
        curve = []
        for size in sizes:
            n = max(world, size // 2) // world * world  # bf16 elements, divisible by the world
            full = torch.ones(n, device="cuda", dtype=torch.bfloat16)
            shard = torch.empty(n // world, device="cuda", dtype=torch.bfloat16)
            fn = {M.ALL_REDUCE: lambda: dist.all_reduce(full),
                  M.ALL_GATHER: lambda: dist.all_gather_into_tensor(full, shard),
                  M.REDUCE_SCATTER: lambda: dist.reduce_scatter_tensor(shard, full)}[op]
            dist.barrier()
            t = torch.tensor([cuda_time_s(fn, iters=10)], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank closes the collective
            curve.append([float(n * 2), busbw_factor(op, world) * n * 2 / t.item() / 1e9])
        out[op] = curve
    return out


def reference_step_s(hardware: str, world: int, steps: int = REFERENCE_STEPS, zero_stage: int = 0) -> float:
    """Median (over steps) of the slowest rank's step of the reference trial, run by the trial body's
    own build and step on this rank's GPU."""
    import torch
    import torch.distributed as dist

    from scalestudy.calibrate.reference_step import WARMUP_STEPS, reference_config
    from scalestudy.train.body import build

    cfg = reference_config("bf16", world, hardware=hardware, zero_stage=zero_stage)
    trial = build(cfg, torch.device("cuda", torch.cuda.current_device()))
    times = []
    for step in range(WARMUP_STEPS + steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        trial.step(step)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    slowest = torch.tensor(times[WARMUP_STEPS:], dtype=torch.float64, device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    trial.engine.destroy()
    return statistics.median(slowest.cpu().tolist())


def _worker(rank: int, world: int, port: int, hardware: str, quick: bool, out: str) -> None:
    """One process per GPU: the one-GPU figures (world 1, alone on the machine), or NCCL collectives
    (world > 1); then the reference step on every rank at once."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    import torch

    torch.cuda.set_device(rank)
    res: dict[str, Any] = {}
    if world == 1:
        res["gemm"] = gemm_curve(QUICK_GEMM_SHAPES if quick else GEMM_SHAPES)
        res["hbm_gbps"] = hbm_gbps()
        res["attention"] = attention_rows(ATTENTION_SHAPES)
    deepspeed.init_distributed(dist_backend="nccl")
    if world > 1:
        res["comm"] = comm_curves_cuda(world, QUICK_COMM_SIZES_BYTES if quick else COMM_SIZES_BYTES)
    steps = 5 if quick else REFERENCE_STEPS
    res["reference_step_s"] = reference_step_s(hardware, world, steps)
    if world == 1:  # stage 3 with nothing to communicate: its hooks' cost alone
        res["reference_step_zero3_s"] = reference_step_s(hardware, world, steps, zero_stage=3)
    if rank == 0:
        Path(out, f"world{world}.json").write_text(json.dumps(res))
    torch.distributed.destroy_process_group()


def _run(world: int, hardware: str, quick: bool, out: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, port, hardware, quick, out), nprocs=world,
                       start_method="spawn")
    return json.loads(Path(out, f"world{world}.json").read_text())


def profile_from(base: HardwareProfile, alone: dict[str, Any], shared: dict[str, Any] | None,
                 world: int) -> HardwareProfile:
    """The base profile with the measured figures (see the module docstring)."""
    from scalestudy.calibrate import reference_step

    data = base.model_dump(mode="json")
    cal: dict[str, Any] = without_precision_ratios(data.get("calibration") or {})
    cal["gemm_tflops_bf16"] = alone["gemm"]
    # MFU stays a share of the datasheet peak (the paper's definition; the H200 check first reported
    # 0.35 against the measured best GEMM where the datasheet peak gives 0.27): the best GEMM
    # measured is an efficiency of that peak. The model prices GEMMs from the curve either way.
    best = max(c[1] for c in alone["gemm"])
    data["peak_tflops"]["bf16"] = max(data["peak_tflops"]["bf16"], best)
    cal["gemm_efficiency"] = best / data["peak_tflops"]["bf16"]
    data["hbm_gbps"] = alone["hbm_gbps"]
    cal["hbm_efficiency"] = 1.0
    cal["attention_s_bf16"] = alone["attention"]
    if shared:
        for op, curve in shared["comm"].items():
            cal[f"busbw_gbps_{op}"] = curve
        data["nvlink_gbps_per_gpu"] = max(c[1] for c in shared["comm"][M.ALL_REDUCE])
        cal["calibration_world_size"] = float(world)
    # The profile describes this platform's trials, whose TP is DeepSpeed AutoTP's (params.py).
    cal["tp_all_reduce_per_linear"] = 1.0
    data["calibration"] = cal
    data["name"] = f"{base.name}-calibrated"
    data["description"] = (f"{base.description} (calibrated on this machine "
                           f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())})")
    cal.update(reference_step.factors(
        HardwareProfile(**data), base.name, {"bf16": alone["reference_step_s"]},
        {"bf16": shared["reference_step_s"]} if shared else None, world,
        {"bf16": alone["reference_step_zero3_s"]} if "reference_step_zero3_s" in alone else None))
    return HardwareProfile(**data)


def calibrate_local_gpus(base: HardwareProfile | None = None, quick: bool = False,
                         max_world: int | None = None) -> HardwareProfile:
    """Every measurement of the module docstring on this machine's GPUs (raises without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        raise NoCudaDevice("no CUDA device is visible to torch on this machine")
    base = base or get_hardware(base_profile_name(torch.cuda.get_device_name(0)))
    world = min(torch.cuda.device_count(), max_world or torch.cuda.device_count())
    with tempfile.TemporaryDirectory(prefix="scalestudy-gpu-calibrate-") as out:
        alone = _run(1, base.name, quick, out)
        shared = _run(world, base.name, quick, out) if world > 1 else None
    return profile_from(base, alone, shared, world)
