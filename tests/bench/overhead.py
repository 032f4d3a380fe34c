"""Platform overhead, measured side by side in one invocation (not part of `make test`).

(a) `scalestudy run` (Ray Train + DeepSpeed, world size 1, ZeRO 0) vs (b) a plain PyTorch loop on
the same model, batch, precision and steps; (c) the same trial with instrumentation (energy meter,
utilization, profiled window) disabled vs enabled. Prints the tokens/s ratios and the time from
invoking `scalestudy run` to its first measured step.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).parents[2]
SETS = ["model=llama2-small", "world_size=1", "zero_stage=0", "tp=1", "micro_batch=8",
        "seq_len=256", "precision=bf16", "steps={warmup: 3, measure: 15, profile: 3}"]


def platform_run() -> dict:
    cmd = [sys.executable, "-m", "scalestudy.cli", "run", "experiments/quickstart.yaml", "--json"]
    for s in SETS:
        cmd += ["--set", s]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def plain_loop() -> float:
    import torch

    from scalestudy.spec.load import load_spec
    from scalestudy.plan import plan_study
    from scalestudy.train.data import global_batch
    from scalestudy.train.model_factory import build_model

    cfg = plan_study(load_spec(REPO / "experiments/quickstart.yaml", SETS))[0].config
    torch.set_num_threads(1)  # as in a Ray worker with one CPU
    model = build_model(cfg.model_dims, cfg.seed).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    times = []
    for step in range(cfg.steps.warmup + cfg.steps.measure):
        ids = global_batch(step, cfg.global_batch, cfg.seq_len, cfg.model_dims.vocab_size, cfg.seed)
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= cfg.steps.warmup:
            times.append(time.perf_counter() - t)
    return cfg.tokens_per_step / statistics.median(times)


def instrumented_vs_not() -> tuple[float, float]:
    from scalestudy.spec.load import load_spec
    from scalestudy.plan import plan_study
    from scalestudy.launch.ray_train import ensure_ray, run_trial

    cfg = plan_study(load_spec(REPO / "experiments/quickstart.yaml", SETS))[0].config
    ensure_ray()
    store = REPO / "results" / "bench" / "ray"
    off = run_trial(cfg, store, instrument=False)
    on = run_trial(cfg, store, instrument=True)
    return on.tokens_per_s, off.tokens_per_s


def main() -> None:
    t0 = time.time()
    a = platform_run()
    wall = time.time() - t0
    b = plain_loop()
    on, off = instrumented_vs_not()
    print(f"step time (scalestudy run): {a['step_time_s'] * 1e3:.1f} ms")
    print(f"tokens/s  scalestudy run: {a['tokens_per_s']:.0f}   plain PyTorch: {b:.0f}   "
          f"ratio (a)/(b): {a['tokens_per_s'] / b:.3f}   (target >= 0.95)")
    print(f"invocation -> first measured step: {a['time_to_first_step_s']:.1f} s "
          f"(whole command {wall:.1f} s)")
    print(f"instrumentation on/off tokens/s: {on:.0f} / {off:.0f} = {on / off:.3f}   (target >= 0.97)")


if __name__ == "__main__":
    main()
