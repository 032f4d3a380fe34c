"""`scalestudy calibrate`'s device microbenchmarks, on one worker: GEMM curves, streaming bandwidth,
fused attention and the LM loss at model-like shapes, the per-op cost of eager PyTorch and the
DeepSpeed engine's own costs (calibrate/run.py says which model figure each one replaces)."""

from __future__ import annotations

import statistics
import time

from scalestudy.calibrate.reference_step import REFERENCE

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


GEMM_ROUNDS_EMULATED = 4  # where bf16 is emulated (below); one window per shape elsewhere


def gemm_curve(dtype_name: str, shapes: list[tuple[int, int, int]],
               rounds: int | None = None) -> list[list[float]]:
    """[FLOPs of one GEMM, TFLOP/s] per (tokens m, in k, out n): the mean rate of the three GEMMs an
    nn.Linear runs in training, in their own layouts: forward x @ W.T, input gradient g @ W, weight
    gradient g.T @ x. Where bf16 is emulated the layouts differ up to tenfold (2026-12-04, EPYC with
    oneDNN held to AVX2, 512 x 128 x 352: 10.5, 3.4 and 35.6 GFLOP/s; a plain (m,k) @ (k,n) 3.5),
    and timing one layout alone predicted the held-out bf16 trials 5-7x too slow.

    Emulated bf16 is also timed in `rounds` short windows per shape, the shapes taking turns, and
    its time is the mean of its windows: a trial's step averages its GEMMs over seconds, and on a
    shared 2-core VM the emulated-bf16 rate flips between two levels 1.5-2x apart every few seconds
    (2026-12-07, AMD EPYC without native bf16: 96 x 64 x 64 at 2.6 / 1.8 / 10 or 4.0 / 3.0 / 20
    GFLOP/s per layout, the same tensors, seconds apart), so one window per shape caught one level
    or the other. Six quick bf16 curves each way, alternating in one process, read at seven
    gpt2-tiny GEMM shapes that calibration never runs: one window per shape 14.3% CV between curves
    (11.6 s a curve), four rounds 6.4% (14.8 s). fp32 gained nothing from rounds (5.7% and 6.5%,
    0.7 and 1.0 s) and keeps its one window per shape, as native bf16 does."""
    import torch

    from scalestudy.spec.precision import cpu_has_native_bf16

    dtype = _dtype(dtype_name)
    if rounds is None:
        emulated = dtype == torch.bfloat16 and not cpu_has_native_bf16()
        rounds = GEMM_ROUNDS_EMULATED if emulated else 1
    times = {s: 0.0 for s in shapes}
    layouts = {}
    for m, k, n in shapes:
        x, w, g = (torch.randn(*shape, dtype=dtype) for shape in ((m, k), (n, k), (m, n)))
        layouts[(m, k, n)] = (lambda x=x, w=w: torch.mm(x, w.t()), lambda g=g, w=w: torch.mm(g, w),
                              lambda g=g, x=x: torch.mm(g.t(), x))
    for r in range(rounds):  # one round: _median_time's own window, as before the rounds
        window = {} if rounds == 1 else {"warmup": int(r == 0), "min_iters": 2, "min_time_s": 0.02}
        for shape, fns in layouts.items():
            times[shape] += sum(_median_time(fn, **window) for fn in fns) / rounds
    return sorted([2.0 * m * k * n, 3 * 2.0 * m * k * n / times[(m, k, n)] / 1e12]
                  for m, k, n in shapes)


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

    model = build_model(catalog.get_model(REFERENCE["model"]), seed=0).to(_dtype(precision))
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

    # The trials' own config builder, at the layout of the process group it runs in.
    spec = validate_spec({"name": "calibrate", "model": REFERENCE["model"], "hardware": "cpu-local",
                          "precision": precision, "micro_batch": 1, "zero_stage": zero_stage,
                          "world_size": torch.distributed.get_world_size()})
    ds = deepspeed_config(expand(spec)[0].config)
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


