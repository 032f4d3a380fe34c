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
  * Per-op cost of eager PyTorch: forward + backward of the reference model (HF eager, random weights) on 8
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
    above reproduces those steps (calibrate/reference_step.py says why the parts do not add up);
    and the same step AutoTP-sharded over every worker (tp = world): tp_collective_overhead_s, what
    each TP all-reduce costs inside a step beyond its lock-step benchmark.
  * Pipelines, in the shared run: the send/recv curve between two ranks (busbw_gbps_send_recv) and
    the pipeline reference step at pp = world (reference_step_s_<precision>_ws<n>_pp<n>).
  * Power: only where a meter exists (NVML); none on this machine, so the catalogue figures stay.
  * The network between nodes, with `--across-nodes N`: calibrate/across_nodes.py, after the above.
Without Ray: calibrate/local.py runs the same benchmarks() in plain processes (`scalestudy calibrate
--local`). Only the precisions asked for are benchmarked (default: the one `auto` resolves to here):
an emulated-bf16 CPU runs bf16 GEMMs tens of times slower than fp32, and a calibration of every
precision there took 10 minutes. One progress line per benchmark goes to stderr.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scalestudy import metrics as M
from scalestudy.calibrate import reference_step
from scalestudy.calibrate.collectives import comm_curves
from scalestudy.calibrate.kernels import (attention_rows, cross_entropy_rows, engine_costs,
                                          gemm_curve, op_overhead_s, stream_gbps)
from scalestudy.perfmodel.params import without_precision_ratios
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.track.storage import default_results_root, join, ray_storage

RESULT_FILE = "calibration.json"
# Shapes off every scored study's (reference_step.py; tests/unit/test_calibrate_local.py checks):
# token counts 96/384/768 (the studies run 128 and 512 per micro-batch), the reference model's
# widths, then squares up to where the curve flattens. The studies' GEMMs span ~1 MFLOP (tp-split
# projections) to ~0.4 GFLOP (LM head): the curve covers that and a little beyond; larger squares
# would only cost time (an emulated-bf16 CPU runs a 2048^3 GEMM for seconds).
# (M tokens, K, N)
SHAPES = [(96, 64, 64), (384, 64, 64), (384, 128, 128), (384, 128, 352), (384, 352, 128),
          (768, 128, 3072), (768, 768, 768), (1024, 1024, 1024)]
QUICK_SHAPES = [(96, 64, 64), (384, 128, 352), (768, 128, 3072), (768, 768, 768)]
# (batch, heads, seq, head_dim): sequence lengths 48-384 around the studies' 64-256 but none of
# them, the reference step's (2, 8, 192, 16), head_dim 16 and 32 on either side of 24.
ATTENTION_SHAPES = [(1, 4, 96, 16), (4, 4, 96, 16), (2, 8, 192, 16), (2, 4, 384, 16),
                    (4, 4, 48, 32), (2, 4, 192, 32), (2, 4, 384, 32)]
QUICK_ATTENTION_SHAPES = [(4, 4, 96, 16), (2, 8, 192, 16), (2, 4, 384, 32)]
LOSS_SHAPES = [(384, 3072), (1536, 3072), (384, 8192), (1536, 8192)]  # (tokens, vocab)
QUICK_LOSS_SHAPES = [(384, 3072), (1536, 8192)]
SIZES_BYTES = [2**k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB
QUICK_SIZES_BYTES = [2**12, 2**16, 2**20, 2**22]


def benchmarks(config: dict[str, Any]) -> dict[str, Any]:
    """Every benchmark for the process group this process is in (Ray Train's or calibrate/local.py's,
    gloo, one core per rank): the device benchmarks (world 1) or the collectives (more ranks), then
    the reference step on every rank at once, and with more ranks the pipeline benchmarks. Rank 0
    prints one line per benchmark as it ends."""
    import torch.distributed as dist

    world, quick, precisions = dist.get_world_size(), config["quick"], config["precisions"]
    say = Progress(dist.get_rank() == 0, f"ws{world}", config.get("progress"))
    res: dict[str, Any] = {"world_size": world}
    dist.barrier()
    if world == 1:
        res["op_overhead_s"] = statistics.median(
            say(f"op overhead {p}", lambda p=p: op_overhead_s(p)) for p in precisions)
        res["gemm"] = {p: say(f"gemm {p} ({len(QUICK_SHAPES if quick else SHAPES)} shapes)",
                              lambda p=p: gemm_curve(p, QUICK_SHAPES if quick else SHAPES))
                       for p in precisions}
        res["stream_gbps"] = say("stream bandwidth", lambda: stream_gbps(16 if quick else 64))
        att = QUICK_ATTENTION_SHAPES if quick else ATTENTION_SHAPES
        res["attention"] = {p: say(f"attention {p} ({len(att)} shapes)",
                                   lambda p=p: attention_rows(p, att)) for p in precisions}
        loss = QUICK_LOSS_SHAPES if quick else LOSS_SHAPES
        res["cross_entropy"] = {p: say(f"cross-entropy {p} ({len(loss)} shapes)",
                                       lambda p=p: cross_entropy_rows(p, loss)) for p in precisions}
        res["engine"] = {p: say(f"DeepSpeed engine costs {p}",
                                lambda p=p: engine_costs(p, res["op_overhead_s"]))
                         for p in precisions}
    else:
        sizes = QUICK_SIZES_BYTES if quick else SIZES_BYTES
        res["comm"] = say(f"collectives ({len(sizes)} sizes x 3 ops)",
                          lambda: comm_curves(world, sizes, iters=16 if quick else 30))
    res["reference_step_s"] = {
        p: say(f"reference step {p} on {world} rank(s)",
               lambda p=p: reference_step.measure_step_s(p, steps=10 if quick else 20))
        for p in precisions}
    if world > 1:  # the same step with its model AutoTP-sharded over these ranks
        res["reference_step_tp_s"] = {
            p: say(f"reference step {p} at tp {world}",
                   lambda p=p: reference_step.measure_step_s(p, steps=10 if quick else 20, tp=world))
            for p in precisions}
        res.update(pipeline_benchmarks(config, say))
    return res


def pipeline_benchmarks(config: dict[str, Any], say: "Progress") -> dict[str, Any]:
    """What pipelines add to the shared run (both paths: Ray Train's workers and calibrate --local's
    ranks): the send/recv curve between two ranks (merged into the collectives' curves:
    busbw_gbps_send_recv) and the pipeline reference step at pp = world, which the profile records
    beside the other reference steps (its in-sample check)."""
    import torch.distributed as dist

    quick = config["quick"]
    sizes = reference_step.QUICK_P2P_SIZES_BYTES if quick else reference_step.P2P_SIZES_BYTES
    curve = say(f"send/recv ({len(sizes)} sizes)",
                lambda: reference_step.p2p_curve(sizes, iters=8 if quick else 20))
    step_s = {p: say(f"pipeline reference step {p} at pp {dist.get_world_size()}",
                     lambda p=p: reference_step.measure_pipeline_step_s(p, 10 if quick else 20))
              for p in config["precisions"]}
    return {"send_recv_curve": curve, "reference_step_pp_s": step_s}


class Progress:
    """One line per benchmark, with its seconds and the run's so far (rank 0 only): a full
    calibration takes minutes and used to print nothing until its final table. On stderr, or in a
    Ray Train worker (whose output Ray does not forward) to the driver's relay (_Lines)."""

    def __init__(self, enabled: bool, tag: str, relay=None):
        self.enabled, self.tag, self.start, self.relay = enabled, tag, time.perf_counter(), relay

    def __call__(self, what: str, fn):
        t = time.perf_counter()
        value = fn()
        if self.enabled:
            now = time.perf_counter()
            line = f"calibrate [{self.tag}] {what}: {now - t:.1f} s (total {now - self.start:.1f} s)"
            if self.relay is not None:
                self.relay.put.remote(line)
            else:
                print(line, file=sys.stderr, flush=True)
        return value


class _Lines:
    """The workers' progress lines until the driver takes them (a Ray actor on the driver's node)."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def put(self, line: str) -> None:
        self._lines.append(line)

    def take(self) -> list[str]:
        lines, self._lines = self._lines, []
        return lines


def _fit_relaying(trainer, relay) -> Any:
    """trainer.fit() in a thread while this one prints the relay's lines to stderr as they come."""
    import ray

    def relay_lines() -> None:
        for line in ray.get(relay.take.remote()):
            print(line, file=sys.stderr, flush=True)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fitting = pool.submit(trainer.fit)
        while not concurrent.futures.wait([fitting], timeout=0.5).done:
            relay_lines()
        relay_lines()
        return fitting.result()


def calibration_loop(config: dict[str, Any]) -> None:
    """Ray Train worker: benchmarks() in the worker group Ray Train started."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    from scalestudy.train.host_memory import retain_freed_memory

    retain_freed_memory()  # the allocator behaviour trial workers have

    torch.set_num_threads(1)  # one core per worker, as in trials
    deepspeed.init_distributed(dist_backend="gloo")
    report_result(benchmarks(config), RESULT_FILE)


def report_result(res: dict[str, Any], filename: str) -> None:
    """Rank 0's results as a JSON file in the checkpoint (Ray Train 2.x returns only the metrics
    that come with one); every rank reports."""
    import ray.train
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if dist.get_rank() == 0:
            Path(tmp, filename).write_text(json.dumps(res))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"done": 1}, checkpoint=checkpoint)


def calibration_storage(results_root: str | Path | None = None) -> dict[str, Any]:
    """Ray Train's storage (RunConfig's storage_path, storage_filesystem) for calibration runs:
    <results root>/calibrate/ray, the root every node of a cluster writes (an object store or a
    shared mount), never a temporary folder of the driver's machine, where a worker on another node
    would write its result to a folder of the same name on its own disk. Default root: the one every
    scalestudy command takes ($SCALESTUDY_RESULTS_ROOT, else ./results)."""
    return ray_storage(join(results_root or default_results_root(), "calibrate", "ray"))


def run_group(loop, config: dict[str, Any], scaling: dict[str, Any], storage: dict[str, Any],
              name: str, filename: str, backend: str = "gloo") -> dict[str, Any]:
    """One Ray Train run of `loop` with these ScalingConfig arguments, in `storage` (RunConfig's
    storage keywords: calibration_storage); rank 0's reported JSON."""
    import uuid

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from scalestudy.launch.placement import on_this_node

    relay = ray.remote(num_cpus=0)(_Lines).options(**on_this_node()).remote()
    trainer = TorchTrainer(
        loop,
        train_loop_config={**config, "progress": relay},
        scaling_config=ScalingConfig(**scaling),
        torch_config=TorchConfig(backend=backend),
        run_config=RunConfig(name=f"{name}-{uuid.uuid4().hex[:6]}", **storage,
                             failure_config=FailureConfig(max_failures=0)),
    )
    try:
        result = _fit_relaying(trainer, relay)
    finally:
        ray.kill(relay)
    with result.checkpoint.as_directory() as d:
        return json.loads((Path(d) / filename).read_text())


def _fit(world: int, config: dict[str, Any], storage: dict[str, Any]) -> dict[str, Any]:
    return run_group(calibration_loop, config,
                     {"num_workers": world, "resources_per_worker": {"CPU": 1}}, storage,
                     f"calibrate-ws{world}", RESULT_FILE)


def build_profile(base: HardwareProfile, alone: dict, shared: dict | None,
                  name: str | None = None) -> HardwareProfile:
    """Base figures overridden by the measured ones; extras in `calibration`."""
    data = base.model_dump(mode="json")
    cal: dict[str, Any] = without_precision_ratios(data.get("calibration") or {})
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
        data["nvlink_gbps_per_gpu"] = max(c[1] for c in shared["comm"][M.ALL_REDUCE])
        cal["calibration_world_size"] = float(shared["world_size"])
    # The measured reference steps themselves: what the two factors below reproduce (the in-sample
    # rows of tests/validation/test_measured_cpu.py).
    for prec, step_s in alone["reference_step_s"].items():
        cal[f"reference_step_s_{prec}_ws1"] = step_s
    for prec, step_s in (shared["reference_step_s"] if shared else {}).items():
        cal[f"reference_step_s_{prec}_ws{shared['world_size']}"] = step_s
    for prec, step_s in (shared.get("reference_step_tp_s", {}) if shared else {}).items():
        cal[f"reference_step_s_{prec}_ws{shared['world_size']}_tp{shared['world_size']}"] = step_s
    if shared and "send_recv_curve" in shared:  # pipelines: absent from profiles written before
        cal["busbw_gbps_send_recv"] = shared["send_recv_curve"]
        for prec, step_s in shared["reference_step_pp_s"].items():
            cal[f"reference_step_s_{prec}_ws{shared['world_size']}_pp{shared['world_size']}"] = step_s
    # The profile describes this platform's trials, whose TP is DeepSpeed AutoTP's (params.py).
    cal["tp_all_reduce_per_linear"] = 1.0
    data["calibration"] = cal
    data["name"] = name or base.name
    data["description"] = (f"{base.description} (calibrated "
                           f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())})")
    # The step-level factors last: they are solved against the profile of everything above.
    cal.update(reference_step.factors(
        HardwareProfile(**data), base.name, alone["reference_step_s"],
        shared["reference_step_s"] if shared else None, shared["world_size"] if shared else 1,
        tp_s=shared.get("reference_step_tp_s") if shared else None,
        pp_s=shared.get("reference_step_pp_s") if shared else None))
    return HardwareProfile(**data)


def calibrate(base: HardwareProfile, quick: bool = False, precisions: list[str] | None = None,
              max_world: int = 2, results_root: str | Path | None = None) -> HardwareProfile:
    """Run the microbenchmarks on the current Ray cluster (started locally when none is joined); a
    GPU profile is calibrated on this machine's GPUs instead, one process per GPU and no Ray
    (calibrate/gpu.py; one node: the catalogue's network figure stays). Ray Train's runs are kept
    under `results_root` (calibration_storage)."""
    if base.is_gpu:
        from scalestudy.calibrate.gpu import calibrate_local_gpus

        return calibrate_local_gpus(base, quick=quick)
    import ray

    from scalestudy.launch.ray_train import ensure_ray

    ensure_ray()
    precisions = precisions or default_precisions(base)
    config = {"quick": quick, "precisions": precisions}
    storage = calibration_storage(results_root)
    alone = _fit(1, config, storage)
    world = min(max_world, int(ray.cluster_resources().get("CPU", 1)))
    shared = _fit(world, config, storage) if world >= 2 else None
    return build_profile(base, alone, shared)


def default_precisions(base: HardwareProfile) -> list[str]:
    """What the studies at hand run at: the precision their `auto` resolves to on this machine and,
    where that is bf16 (GPUs, CPUs with native bf16), fp32 too, which studies name as often (the
    paper's fp32 baselines, the measured-CPU studies). Without native bf16 only fp32: bf16 is
    emulated there (about 10x slower) and no `auto` asks for it; `--precision bf16` calibrates it.
    A prediction at a precision the profile lacks says so (perfmodel/coverage.py)."""
    from scalestudy.spec.precision import resolve_precision

    auto = resolve_precision("auto", base).value
    return [auto] if auto == "fp32" else [auto, "fp32"]
