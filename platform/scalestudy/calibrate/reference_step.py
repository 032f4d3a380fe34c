"""`scalestudy calibrate`'s reference step: real DeepSpeed training steps of one fixed shape, and the
two factors at which the performance model reproduces them.

Why: the microbenchmarks time each kind of op alone, looping hot on the same tensors. Inside a
training step on CPU every op meets caches that the ops before it evicted, and Python, autograd and
the engine run between kernels; the step costs more than the sum of its parts (1.2-1.5x on this
machine's cores). And when every core of the node trains, the cores share caches and memory
bandwidth, the OS, Ray's processes and the driver take their CPU time from the trainers, and each
synchronous collective waits for whichever core was interrupted. Neither is an op the model could
price one by one, so calibrate measures both where they happen:

  * alone (the one-worker run): in_step_slowdown, the factor on the kernel and op sums of forward
    and backward (compute.py) at which the model's step time equals the measured median step;
  * every worker of the node at once, data parallel (the multi-worker run): shared_node_slowdown
    likewise, with in_step_slowdown fixed and the gradient all-reduce priced from the collectives'
    benchmarks of the same run;
  * the same workers with the model AutoTP-sharded over them (tp = world): tp_collective_overhead_s,
    per TP all-reduce, with both factors above fixed. Each of a step's many TP all-reduces waits for
    the slower rank to arrive, which a lock-step benchmark never does.

The reference is llama2-calib (a catalogue model kept for calibration alone) at ZeRO stage 0,
micro-batch 2 x 192 tokens (384 per micro-batch). No scored CPU study shares its model, sequence
length or tokens per micro-batch (the quick start: llama2-tiny, 4 x 128; the held-out study
experiments/cpu_heldout.yaml: gpt2-tiny, 2 x 64 and 2 x 256), and tests/unit/test_calibrate_local.py
holds every shape calibrate runs off theirs: checking a calibrated profile against those studies
tests prediction, not replay.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass

from scalestudy.errors import SpecError
from scalestudy.perfmodel.params import PER_PRECISION, params_for
from scalestudy.perfmodel.predict import simulate
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.load import validate_spec
from scalestudy.spec.resolve import resolve_hardware
from scalestudy.spec.study import TrialConfig, expand

REFERENCE = {"model": "llama2-calib", "micro_batch": 2, "seq_len": 192, "zero_stage": 0}
# On a GPU the CPU reference (384 tokens a step) is all kernel launches: measured on an H200
# (2026-12-04) it drove in_step_slowdown to the top of its range and the calibrated profile then
# predicted TinyLlama 5.9x too slow. The GPU reference runs 2 x 3,072 tokens of a 2,560-wide model.
REFERENCE_GPU = {"model": "llama2-calib-gpu", "micro_batch": 2, "seq_len": 3072, "zero_stage": 0}
WARMUP_STEPS = 3
FACTOR_RANGE = (1.0, 8.0)  # a slowdown is at least 1; 8 only bounds the search
# The step against its parts benchmarked alone: below 1 where the parts ran slow (params.py)
IN_STEP_RANGE = (0.5, 8.0)
PIPELINE_FACTOR_RANGE = (0.25, 4.0)  # faster or slower than the engine step: bounds only
OVERHEAD_RANGE_S = (0.0, 0.01)  # per ZeRO-3 module run; 10 ms only bounds the search


def reference_config(precision: str, world_size: int, hardware: str = "cpu-local",
                     zero_stage: int = 0, tp: int = 1, pp: int = 1) -> TrialConfig:
    """The reference trial on ``hardware`` (a catalogue name or profile path): the GPU shape on GPU
    profiles, the CPU one otherwise. With pp > 1, the pipeline reference: PIPELINE_MICRO_BATCHES
    micro-batches per step under 1F1B."""
    shape = REFERENCE_GPU if resolve_hardware(hardware).is_gpu else REFERENCE
    pipeline = ({"pp": pp, "global_batch": shape["micro_batch"] * PIPELINE_MICRO_BATCHES,
                 "schedule": "1f1b"} if pp > 1 else {})
    spec = validate_spec({"name": "calibrate-reference", "hardware": hardware, "precision": precision,
                          "world_size": world_size, **shape, "zero_stage": zero_stage, "tp": tp,
                          **pipeline})
    return expand(spec)[0].config


# The pipeline reference (pp = world, 1F1B): 4 micro-batches of the reference shape per step. Only
# its p2p and schedule cost is new to the model; the blocks are llama2-calib's, whose compute the
# factors above already reproduce. No scored pipeline trial (tests/validation/test_pipeline_model.py)
# shares its model or its tokens per micro-batch.
PIPELINE_MICRO_BATCHES = 4
P2P_SIZES_BYTES = [2**k for k in range(12, 23, 2)]  # 4 KiB .. 4 MiB: the studies' activations
QUICK_P2P_SIZES_BYTES = [2**12, 2**16, 2**19, 2**22]


def measure_pipeline_step_s(precision: str, steps: int) -> float:
    """Seconds of a step of the pipeline reference on every rank of the current process group
    (pp = world; train/schedules.py), timed as trials time theirs: the slowest rank's time of each
    step, the median over steps."""
    import torch
    import torch.distributed as dist

    from scalestudy.train.schedules import measure_steps

    world = dist.get_world_size()
    cfg = reference_config(precision, world, pp=world)
    times, _ = measure_steps(cfg, torch.device("cpu"), WARMUP_STEPS, steps)
    return statistics.median(times)


def p2p_curve(sizes: list[int], iters: int) -> list[list[float]]:
    """[bytes, GB/s] of one send/recv between pipeline neighbours (ranks 0 and 1 of the current
    group; the others wait), timed as a ping-pong: a message there and back, half the round trip
    per transfer, the median of ``iters``. The busbw_gbps_send_recv curve of a profile: what
    perfmodel/network.py prices a pipeline's p2p with (busbw = algbw for send/recv)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    curve = []
    for size in sizes:
        buf = torch.zeros(size // 4, dtype=torch.float32)
        times = []
        for _ in range(iters + 2):  # two warm-up round trips
            dist.barrier()
            t = time.perf_counter()
            if rank == 0:
                dist.send(buf, dst=1)
                dist.recv(buf, src=1)
            elif rank == 1:
                dist.recv(buf, src=0)
                dist.send(buf, dst=0)
            times.append((time.perf_counter() - t) / 2)
        half = torch.tensor([statistics.median(times[2:])], dtype=torch.float64)
        dist.broadcast(half, src=0)
        curve.append([float(size), size / half.item() / 1e9])
    return curve


def measure_step_s(precision: str, steps: int, tp: int = 1) -> float:
    """Seconds of a real training step of the reference on every rank of the current process group
    at once, taken as trials take theirs: the trial's data, the slowest rank's time of each step,
    the median over steps. A FIXED number of steps: every rank must issue the same collectives.
    With tp > 1 the model is AutoTP-sharded as a trial's is (train/construct.py)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from scalestudy.parallel.deepspeed_config import deepspeed_config
    from scalestudy.train.construct import build_trial_model, check_materialised
    from scalestudy.train.data import global_batch
    from scalestudy.train.model_factory import build_model

    cfg = reference_config(precision, dist.get_world_size(), tp=tp)
    layout, ds_config = cfg.layout, deepspeed_config(cfg)
    rows = layout.batch_rows(0, layout.coords(dist.get_rank())[0])
    model = (build_trial_model(cfg, ds_config, torch.device("cpu")) if tp > 1
             else build_model(cfg.model_dims, cfg.seed))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config)
    check_materialised(engine.module)
    times = []
    for step in range(WARMUP_STEPS + steps):
        t = time.perf_counter()
        batch = global_batch(step, cfg.global_batch, cfg.seq_len, cfg.model_dims.vocab_size, cfg.seed)
        ids = batch[rows]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        times.append(time.perf_counter() - t)
    engine.destroy()
    slowest = torch.tensor(times[WARMUP_STEPS:], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def solve_factor(cfg: TrialConfig, name: str, measured_s: float, span: tuple[float, float] = FACTOR_RANGE,
                 **fixed: float) -> float:
    """The value of the parameter `name` in ``span`` at which the model's step time of `cfg` equals
    measured_s (bisection: the step time grows with each of the slowdowns and overheads solved for).
    Clamped at the span's ends: a measured step faster than the model's unslowed one gives the low
    end."""
    def step_s(k: float) -> float:
        return simulate(cfg, params_for(cfg.hardware_profile, **fixed, **{name: k}))[0].step_s

    low, high = span
    if step_s(low) >= measured_s:
        return low
    if step_s(high) <= measured_s:
        return high
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if step_s(mid) < measured_s else (low, mid)
    return (low + high) / 2


def factors(profile: HardwareProfile, base: str, alone_s: dict[str, float],
            shared_s: dict[str, float] | None = None, world: int = 1,
            zero3_alone_s: dict[str, float] | None = None,
            tp_s: dict[str, float] | None = None,
            pp_s: dict[str, float] | None = None) -> dict[str, float]:
    """in_step_slowdown, and shared_node_slowdown when a `world`-worker run measured the reference
    too, from the measured steps ({precision: seconds}) against `profile` (the microbenchmarks'
    profile, built on the catalogue profile `base`). With the reference also measured at ZeRO
    stage 3 on one device (GPU calibration), zero3_module_overhead_s: what stage 3 adds per module
    run at a world size of one, where it has nothing to communicate. With the reference measured
    at tp = world on the same ranks (CPU calibration), tp_collective_overhead_s: what each TP
    all-reduce costs inside the step beyond its benchmarked time, the other factors fixed. With the
    pipeline reference measured at pp = world, pipeline_compute_factor, last (params.py)."""
    def on(precision: str, world_size: int, zero_stage: int = 0, tp: int = 1,
           pp: int = 1) -> TrialConfig:
        cfg = reference_config(precision, world_size, hardware=base, zero_stage=zero_stage, tp=tp,
                               pp=pp)
        return cfg.model_copy(update={"hardware_profile": profile, "hardware": profile.name})

    solved: dict[str, dict[str, float]] = {}  # field -> {precision: value}

    def solve(name: str, measured: dict[str, float] | None, cfg_of, span=FACTOR_RANGE) -> None:
        """`name` per precision, each with the factors solved before it at that precision."""
        if measured:
            solved[name] = {p: solve_factor(cfg_of(p), name, s, span,
                                            **{n: v[p] for n, v in solved.items() if p in v})
                            for p, s in measured.items()}

    solve("in_step_slowdown", alone_s, lambda p: on(p, 1), IN_STEP_RANGE)
    solve("zero3_module_overhead_s", zero3_alone_s, lambda p: on(p, 1, 3), OVERHEAD_RANGE_S)
    if world > 1:
        solve("shared_node_slowdown", shared_s, lambda p: on(p, world))
        solve("tp_collective_overhead_s", tp_s, lambda p: on(p, world, tp=world), OVERHEAD_RANGE_S)
        solve("pipeline_compute_factor", pp_s, lambda p: on(p, world, pp=world),
              PIPELINE_FACTOR_RANGE)
    return _with_ratios(solved)


def _with_ratios(solved: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each factor's median over the precisions, and for those the model reads per precision
    (params.PER_PRECISION) each precision's ratio to that median."""
    out: dict[str, float] = {}
    for name, by_precision in solved.items():
        out[name] = statistics.median(by_precision.values())
        if name in PER_PRECISION and len(by_precision) > 1 and out[name] > 0:
            out.update({f"{name}_ratio_{p}": v / out[name] for p, v in by_precision.items()})
    return out


# A profile's measured reference steps: reference_step_s_<precision>_ws<world>[_tp<n>|_pp<n>].
_REFERENCE_KEY = re.compile(r"reference_step_s_(\w+?)_ws(\d+)(?:_(tp|pp)(\d+))?$")
# An in-sample reference step the solved factors reproduce worse than this: one of them stopped at
# the end of its range (a measured step faster than the model's parts allow, or slower than its
# range), usually because a benchmark ran while the machine was busy; or a factor the profile keeps
# as one value for every precision (not in params.PER_PRECISION) was solved apart.
REPRODUCED = 0.10


@dataclass(frozen=True)
class InSample:
    """A reference step the profile's factors were solved from, as the profile predicts it."""

    name: str
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0

    @property
    def reproduced(self) -> bool:
        return abs(self.error) <= REPRODUCED


def in_sample(profile: HardwareProfile) -> list[InSample]:
    """Every measured reference step of a calibrated profile, predicted by that profile: what
    calibrate solved its factors to reproduce (in sample, near 0 when no factor was clamped)."""
    out = []
    for key, measured in sorted(profile.calibration.items()):
        m = _REFERENCE_KEY.match(key)
        if m is None or not isinstance(measured, (int, float)) or measured <= 0:
            continue
        precision, world, kind, degree = m.group(1), int(m.group(2)), m.group(3), int(m.group(4) or 1)
        try:
            cfg = reference_config(precision, world, hardware=profile.name,
                                   tp=degree if kind == "tp" else 1,
                                   pp=degree if kind == "pp" else 1)
        except SpecError:  # a profile named off the catalogue: its shape is not known here
            continue
        cfg = cfg.model_copy(update={"hardware_profile": profile, "hardware": profile.name})
        step_s = simulate(cfg, params_for(profile))[0].step_s
        out.append(InSample(f"{cfg.run_name}-{precision}", float(measured), step_s))
    return out
