"""`scalestudy calibrate`: microbenchmarks on the current Ray cluster -> a hardware profile.

What is measured, and which performance-model figure it replaces (perfmodel/params.py, network.py):
  * GEMM TFLOP/s at model-like shapes per precision, one device alone (a 1-worker TorchTrainer):
    `gemm_tflops_<precision>` curves ([FLOPs of one GEMM, TFLOP/s]) and the best point as
    peak_tflops with gemm_efficiency 1 (the curve already says what small shapes reach).
  * Streaming bandwidth (large tensor copies): hbm_gbps with hbm_efficiency 1.
  * Fused causal attention (scaled_dot_product_attention) forward and backward at the catalogue's
    CPU-sized models' head shapes: `attention_s_<precision>` rows [batch*heads, seq, head_dim, forward
    s, backward s]. On CPU its time is not a function of FLOPs alone (the kernel works per
    batch*head tile and its bf16 backward runs 5-20x its forward), hence rows, not a curve.
  * The LM loss as HF computes it (upcast logits to fp32, cross-entropy): `cross_entropy_s_<precision>`
    rows [tokens, vocab, forward s, backward s].
  * Per-op cost of eager PyTorch: forward + backward of llama2-tiny (HF eager, random weights) on 8
    tokens, where kernels do next to no work, divided by the non-view ops it dispatched (counted on the
    fly): op_overhead_s, the figure compute.py charges per counted op.
  * DeepSpeed engine costs, with the trials' own config builder on a stack of small Linear layers:
    the fixed cost of a step beyond its kernels (step_overhead_s), the optimizer step's seconds per
    parameter held (from two model widths: optimizer_s_per_param) and ZeRO-3's per-module cost of
    its fetch/release hooks (stage 3 against stage 0: zero3_module_overhead_s).
  * Collectives: all_reduce / all_gather / reduce_scatter bus bandwidth vs message size through
    deepspeed.comm (what trials call), nccl-tests method: warm-up, repeated timed iterations, median,
    busbw = algbw * 2(n-1)/n (all_reduce) or (n-1)/n: `busbw_gbps_<op>` at the largest world size
    the cluster holds (up to 2 here) and the large-message figure as nvlink_gbps_per_gpu.
  * A real DeepSpeed training step of a reference shape, alone and on every worker at once:
    in_step_slowdown and shared_node_slowdown, the factors at which the model built from everything
    above reproduces those steps (measure/reference_step.py says why the parts do not add up).
  * Power: only where a meter exists (NVML); none on this machine, so the catalogue figures stay.
Runs in about a minute on 2 CPU cores (`quick` in well under that, for tests).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from scalestudy.measure import reference_step
from scalestudy.spec.catalog import HardwareProfile

RESULT_FILE = "calibration.json"
# (M tokens, K, N): llama2-tiny/small projections and MLPs at micro-batch x seq 512..2048 tokens,
# then wider square shapes so the curve reaches the device's large-GEMM rate.
SHAPES = [(512, 64, 64), (512, 64, 176), (512, 176, 64), (512, 64, 2048), (512, 256, 256),
          (512, 256, 688), (2048, 256, 8192), (1024, 1024, 1024), (2048, 2048, 2048)]
QUICK_SHAPES = [(512, 64, 64), (512, 64, 2048), (512, 256, 688), (1024, 1024, 1024)]
# (batch, heads, seq, head_dim): llama2-tiny and llama2-small at the micro-batches and sequence
# lengths the CPU studies use, the reference step's (2, 4, 256, 16), and one larger head.
ATTENTION_SHAPES = [(1, 4, 128, 16), (4, 4, 128, 16), (8, 4, 128, 16), (1, 4, 512, 16),
                    (2, 4, 256, 16), (4, 4, 256, 16), (4, 8, 128, 32), (2, 8, 512, 32),
                    (1, 16, 1024, 64)]
QUICK_ATTENTION_SHAPES = [(4, 4, 128, 16), (2, 4, 256, 16), (4, 8, 128, 32)]
LOSS_SHAPES = [(512, 2048), (2048, 2048), (512, 8192), (4096, 8192)]  # (tokens, vocab)
QUICK_LOSS_SHAPES = [(512, 2048), (512, 8192)]
SIZES_BYTES = [2**k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB
QUICK_SIZES_BYTES = [2**12, 2**16, 2**20, 2**22]


def _median_time(fn, warmup: int = 2, min_iters: int = 5, min_time_s: float = 0.05) -> float:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start < min_time_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if len(times) >= 200:
            break
    return statistics.median(times)


def gemm_curve(dtype_name: str, shapes: list[tuple[int, int, int]]) -> list[list[float]]:
    import torch

    dtype = _dtype(dtype_name)
    out = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        t = _median_time(lambda: torch.mm(a, b))
        out.append([2.0 * m * k * n, 2.0 * m * k * n / t / 1e12])
    return sorted(out)


def _forward_backward_s(forward, grad_of) -> tuple[float, float]:
    """(forward, backward) seconds of an autograd op: forward alone, then forward + backward."""
    fwd = _median_time(forward)
    out = forward()
    grad = grad_of(out)

    def both() -> None:
        forward().backward(grad)

    return fwd, max(0.0, _median_time(both) - fwd)


def attention_rows(dtype_name: str, shapes: list[tuple[int, int, int, int]]) -> list[list[float]]:
    import torch
    import torch.nn.functional as F

    dtype = _dtype(dtype_name)
    rows = []
    for b, a, s, d in shapes:
        q, k, v = (torch.randn(b, a, s, d, dtype=dtype, requires_grad=True) for _ in range(3))
        fwd, bwd = _forward_backward_s(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), torch.ones_like)
        rows.append([float(b * a), float(s), float(d), fwd, bwd])
    return rows


def cross_entropy_rows(dtype_name: str, shapes: list[tuple[int, int]]) -> list[list[float]]:
    import torch
    import torch.nn.functional as F

    rows = []
    for tokens, vocab in shapes:
        logits = torch.randn(tokens, vocab, dtype=_dtype(dtype_name), requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,))
        fwd, bwd = _forward_backward_s(lambda: F.cross_entropy(logits.float(), labels),
                                       lambda out: None)
        rows.append([float(tokens), float(vocab), fwd, bwd])
    return rows


def _dtype(name: str):
    import torch

    return getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[name])


def op_overhead_s(precision: str, tokens: int = 8) -> float:
    """Seconds per dispatched non-view op of a tiny causal LM's forward + backward."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from scalestudy.spec import catalog
    from scalestudy.train.model_factory import build_model

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not func.is_view
            return func(*args, **(kwargs or {}))

    model = build_model(catalog.get_model("llama2-tiny"), seed=0).to(_dtype(precision))
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    step()
    with _Count() as counter:
        step()
    return _median_time(step, min_iters=10) / counter.ops


def stream_gbps(mib: int = 64) -> float:
    import torch

    src = torch.ones(mib * 2**18)  # fp32: mib MiB
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), min_iters=5)
    return 2 * src.numel() * 4 / t / 1e9  # read + write


ENGINE_LAYERS = 10  # 20 parameter tensors, about as many as the small catalogue models have
ENGINE_WIDTHS = (8, 256)  # 720 and 658k parameters: the optimizer's per-parameter slope


def _engine_step_s(precision: str, zero_stage: int, width: int) -> tuple[float, float]:
    """(whole step, optimizer step) median seconds of a DeepSpeed engine on ENGINE_LAYERS Linears."""
    import deepspeed
    import torch

    from scalestudy.parallel.deepspeed_config import deepspeed_config
    from scalestudy.spec.load import validate_spec
    from scalestudy.spec.study import expand

    spec = validate_spec({"name": "calibrate", "model": "llama2-tiny", "hardware": "cpu-local",
                          "precision": precision, "micro_batch": 1, "world_size": 1,
                          "zero_stage": zero_stage})
    ds = deepspeed_config(expand(spec)[0].config)
    ds["train_batch_size"] = ds["train_micro_batch_size_per_gpu"] * torch.distributed.get_world_size()
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(ENGINE_LAYERS)])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    x = torch.ones(1, width, dtype=next(engine.module.parameters()).dtype)
    optimizer_times: list[float] = []

    def step() -> None:
        engine.backward(engine(x).float().sum())
        t = time.perf_counter()
        engine.step()
        optimizer_times.append(time.perf_counter() - t)

    total = _median_time(step, warmup=3, min_iters=10)
    engine.destroy()
    return total, statistics.median(optimizer_times[3:])


def engine_costs(precision: str, op_s: float) -> dict[str, float]:
    """The DeepSpeed engine's own costs, separated from its kernels' (see the module doc)."""
    small_total, small_opt = _engine_step_s(precision, 0, ENGINE_WIDTHS[0])
    _, big_opt = _engine_step_s(precision, 0, ENGINE_WIDTHS[1])
    zero3_total, _ = _engine_step_s(precision, 3, ENGINE_WIDTHS[0])
    params = [ENGINE_LAYERS * (w * w + w) for w in ENGINE_WIDTHS]
    per_param = max(0.0, (big_opt - small_opt) / (params[1] - params[0]))
    kernels = 3 * (ENGINE_LAYERS + 2) * op_s  # forward, input and weight gradients per layer
    return {
        "step_overhead_s": max(0.0, small_total - kernels - per_param * params[0]),
        "optimizer_s_per_param": per_param,
        # Hooks run in forward and in backward for every module run: the Linears and the Sequential.
        "zero3_module_overhead_s": max(0.0, (zero3_total - small_total) / (2 * (ENGINE_LAYERS + 1))),
    }


def _collective(op: str, size: int, world: int):
    import deepspeed.comm as dc
    import torch

    n = max(1, size // 4)
    if op == "all_reduce":
        t = torch.ones(n)
        return lambda: dc.all_reduce(t)
    if op == "all_gather":
        shard = torch.ones(max(1, n // world))
        full = torch.empty(shard.numel() * world)
        return lambda: dc.all_gather_into_tensor(full, shard)
    full = torch.ones(max(1, n // world) * world)
    shard = torch.empty(full.numel() // world)
    return lambda: dc.reduce_scatter_tensor(shard, full)


def _fixed_median(fn, iters: int, warmup: int = 3) -> float:
    """Median over a FIXED number of calls: every rank must issue the same collectives (a
    time-based loop would let ranks disagree on the count and deadlock)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def comm_curves(world: int, sizes: list[int], iters: int = 20) -> dict[str, list[list[float]]]:
    import torch.distributed as dist

    out: dict[str, list[list[float]]] = {}
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        factor = (2.0 if op == "all_reduce" else 1.0) * (world - 1) / world
        curve = []
        for size in sizes:
            fn = _collective(op, size, world)
            dist.barrier()
            t_max = _all_max(_fixed_median(fn, iters))  # the slowest rank closes the collective
            curve.append([float(size), factor * size / t_max / 1e9])
        out[op] = curve
    return out


def _all_max(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def calibration_loop(config: dict[str, Any]) -> None:
    """Ray Train worker: the device benchmarks (world 1) or the collectives (more workers), then the
    reference step on every worker at once."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import ray.train
    import torch
    import torch.distributed as dist

    from scalestudy.train.host_memory import retain_freed_memory

    retain_freed_memory()  # the allocator behaviour trial workers have

    torch.set_num_threads(1)  # one core per worker, as in trials
    deepspeed.init_distributed(dist_backend="gloo")
    world, quick = dist.get_world_size(), config["quick"]
    shapes = QUICK_SHAPES if quick else SHAPES
    res: dict[str, Any] = {"world_size": world}
    dist.barrier()
    if world == 1:
        res["op_overhead_s"] = statistics.median(op_overhead_s(p) for p in config["precisions"])
        res["gemm"] = {p: gemm_curve(p, shapes) for p in config["precisions"]}
        res["stream_gbps"] = stream_gbps(16 if quick else 64)
        res["attention"] = {p: attention_rows(p, QUICK_ATTENTION_SHAPES if quick else ATTENTION_SHAPES)
                            for p in config["precisions"]}
        res["cross_entropy"] = {p: cross_entropy_rows(p, QUICK_LOSS_SHAPES if quick else LOSS_SHAPES)
                                for p in config["precisions"]}
        res["engine"] = {p: engine_costs(p, res["op_overhead_s"]) for p in config["precisions"]}
    else:
        res["comm"] = comm_curves(world, QUICK_SIZES_BYTES if quick else SIZES_BYTES,
                                  iters=8 if quick else 20)
    res["reference_step_s"] = {p: reference_step.measure_step_s(p, steps=10 if quick else 20)
                               for p in config["precisions"]}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if dist.get_rank() == 0:
            Path(tmp, RESULT_FILE).write_text(json.dumps(res))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"done": 1}, checkpoint=checkpoint)


def _fit(world: int, config: dict[str, Any], storage: Path) -> dict[str, Any]:
    import uuid

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        calibration_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=world, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=f"calibrate-ws{world}-{uuid.uuid4().hex[:6]}",
                             storage_path=str(storage.resolve()),
                             failure_config=FailureConfig(max_failures=0)),
    )
    result = trainer.fit()
    with result.checkpoint.as_directory() as d:
        return json.loads((Path(d) / RESULT_FILE).read_text())


def build_profile(base: HardwareProfile, alone: dict, shared: dict | None,
                  name: str | None = None) -> HardwareProfile:
    """Base figures overridden by the measured ones; extras in `calibration`."""
    data = base.model_dump(mode="json")
    cal: dict[str, Any] = dict(data.get("calibration") or {})
    for prec, curve in alone["gemm"].items():
        cal[f"gemm_tflops_{prec}"] = curve
        data["peak_tflops"][prec] = max(c[1] for c in curve)
    cal["gemm_efficiency"] = 1.0  # the curve is the achieved rate
    data["hbm_gbps"] = alone["stream_gbps"]
    cal["hbm_efficiency"] = 1.0
    cal["op_overhead_s"] = alone["op_overhead_s"]
    for prec in alone["attention"]:
        cal[f"attention_s_{prec}"] = alone["attention"][prec]
        cal[f"cross_entropy_s_{prec}"] = alone["cross_entropy"][prec]
    for key in ("step_overhead_s", "optimizer_s_per_param", "zero3_module_overhead_s"):
        cal[key] = statistics.median(costs[key] for costs in alone["engine"].values())
    if shared:
        for op, curve in shared["comm"].items():
            cal[f"busbw_gbps_{op}"] = curve
        data["nvlink_gbps_per_gpu"] = max(c[1] for c in shared["comm"]["all_reduce"])
        cal["calibration_world_size"] = float(shared["world_size"])
    data["calibration"] = cal
    data["name"] = name or base.name
    data["description"] = (f"{base.description} (calibrated "
                           f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())})")
    # The step-level factors last: they are solved against the profile of everything above.
    cal.update(reference_step.factors(
        HardwareProfile(**data), base.name, alone["reference_step_s"],
        shared["reference_step_s"] if shared else None, shared["world_size"] if shared else 1))
    return HardwareProfile(**data)


def calibrate(base: HardwareProfile, quick: bool = False, precisions: list[str] | None = None,
              max_world: int = 2) -> HardwareProfile:
    """Run the microbenchmarks on the current Ray cluster (started locally when none is joined)."""
    import ray

    from scalestudy.train.launch import ensure_ray

    if base.kind != "cpu":
        raise NotImplementedError("calibrate measures CPU devices here; GPU runs need NCCL workers")
    ensure_ray()
    precisions = precisions or [p.value for p in base.peak_tflops if p.value != "fp16"]
    config = {"quick": quick, "precisions": precisions}
    storage = Path(tempfile.mkdtemp(prefix="scalestudy-calibrate-"))
    alone = _fit(1, config, storage)
    world = min(max_world, int(ray.cluster_resources().get("CPU", 1)))
    shared = _fit(world, config, storage) if world >= 2 else None
    return build_profile(base, alone, shared)


def write_profile(profile: HardwareProfile, path: Path) -> None:
    data = profile.model_dump(mode="json")
    path.write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
