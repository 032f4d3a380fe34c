"""Benchmark: performance-model predictions per second (target: >= 5,000 in under 5 s).

Run: .venv/bin/python tests/bench/predict_speed.py
"""

from __future__ import annotations

import time
from pathlib import Path

from scalestudy.perfmodel.predict import predict_planned
from scalestudy.spec.load import load_spec, plan

REPO = Path(__file__).parents[2]


def main(n: int = 5000) -> None:
    planned = []
    for name in ("model_parallel", "fsdp_scaling", "compute_workload", "hardware_generations"):
        planned += plan(load_spec(REPO / "experiments" / "paper" / f"{name}.yaml"))
    trials = (planned * (n // len(planned) + 1))[:n]
    t0 = time.perf_counter()
    results = [predict_planned(p) for p in trials]
    dt = time.perf_counter() - t0
    done = sum(r.status.value == "completed" for r in results)
    print(f"{n} predictions ({done} completed, {n - done} infeasible) in {dt:.2f} s: "
          f"{n / dt:,.0f} predictions/s (target >= 5,000 in < 5 s: {'ok' if dt < 5 else 'MISSED'})")


if __name__ == "__main__":
    main()
