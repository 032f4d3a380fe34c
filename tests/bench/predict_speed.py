"""Benchmark: 5,120 performance-model predictions (target: under 1 s).

Run: .venv/bin/python tests/bench/predict_speed.py

Two workloads, each timed in wall seconds and in this process's CPU seconds (on a shared machine the
CPU time is the figure that says how fast the model is; the wall time says how loaded the machine is):
  * the paper's studies (experiments/paper/: model_parallel, fsdp_scaling, compute_workload,
    hardware_generations) repeated to 5,120 trials, as a sweep of them predicts them;
  * 5,120 distinct random configurations (tests/validation/test_invariants.py's generator), nothing
    shared between predictions but the memoised collective costs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).parents[2]
sys.path.insert(0, str(REPO))

from scalestudy.perfmodel.predict import predict, predict_planned  # noqa: E402
from scalestudy.spec.load import load_spec, plan  # noqa: E402

TARGET_S = 1.0


def _timed(label: str, fn, items) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    results = [fn(x) for x in items]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    done = sum(r.status.value == "completed" for r in results)
    print(f"{len(items)} predictions, {label} ({done} completed, {len(items) - done} infeasible): "
          f"{cpu:.2f} s CPU, {wall:.2f} s wall, {len(items) / cpu:,.0f} predictions/CPU-second "
          f"(target < {TARGET_S:.0f} s: {'ok' if cpu < TARGET_S else 'MISSED'})")


def main(n: int = 5120) -> None:
    planned = []
    for name in ("model_parallel", "fsdp_scaling", "compute_workload", "hardware_generations"):
        planned += plan(load_spec(REPO / "experiments" / "paper" / f"{name}.yaml"))
    trials = (planned * (n // len(planned) + 1))[:n]
    _timed(f"paper studies ({len(planned)} distinct trials)", predict_planned, trials)

    from tests.validation.test_invariants import random_configs

    configs = list(random_configs(n, seed=2026))
    _timed("distinct random configurations", predict, configs)


if __name__ == "__main__":
    main()
