"""Benchmark: 5,120 performance-model predictions (target: under 1 s).

Run: .venv/bin/python tests/bench/predict_speed.py

Two workloads, each timed in wall seconds and in this process's CPU seconds (on a shared machine the
CPU time is the figure that says how fast the model is; the wall time says how loaded the machine is):
  * the paper's studies (experiments/paper/: model_parallel, fsdp_scaling, compute_workload,
    hardware_generations) repeated to 5,120 trials, as a sweep of them predicts them;
  * 5,120 distinct random configurations (tests/validation/test_invariants.py's generator), nothing
    shared between predictions but the memoised collective costs.
Each workload is timed through predict_many (the batch path `scalestudy predict` and the findings
use; the target applies to it) and through one call per trial (predict_planned / predict, as the
sweep driver's simulate backend records them). Each path runs in its own fresh process, so both
start with cold memo caches and the same heap; the two alternate twice and the ratio is printed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).parents[2]
sys.path.insert(0, str(REPO))

from scalestudy.perfmodel.predict import predict, predict_many, predict_planned  # noqa: E402
from scalestudy.spec.load import load_spec  # noqa: E402
from scalestudy.plan import plan_study  # noqa: E402

TARGET_S = 1.0


def _timed(label: str, path: str, items: list, predict_one) -> float:
    """CPU seconds for predicting `items` through `path`: predict_many, or predict_one per item."""
    wall, cpu = time.perf_counter(), time.process_time()
    results = predict_many(items) if path == BATCH else [predict_one(x) for x in items]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    done = sum(r.status.value == "completed" for r in results)
    print(f"{len(items)} predictions, {label} ({done} completed, {len(items) - done} infeasible): "
          f"{cpu:.2f} s CPU, {wall:.2f} s wall, {len(items) / cpu:,.0f} predictions/CPU-second "
          f"(target < {TARGET_S:.0f} s: {'ok' if cpu < TARGET_S else 'MISSED'})")
    return cpu


BATCH = "predict_many"
PATHS = (BATCH, "one call each")


def run_path(path: str, n: int) -> None:
    """Both workloads through one path, in this (fresh) process; prints a CPU line for main()."""
    planned = []
    for name in ("model_parallel", "fsdp_scaling", "compute_workload", "hardware_generations"):
        planned += plan_study(load_spec(REPO / "experiments" / "paper" / f"{name}.yaml"))
    trials = (planned * (n // len(planned) + 1))[:n]
    paper = _timed(f"paper studies ({len(planned)} distinct trials), {path}", path, trials,
                   predict_planned)

    from tests.validation.test_invariants import random_configs

    configs = list(random_configs(n, seed=2026))
    random = _timed(f"distinct random configurations, {path}", path, configs, predict)
    print(f"CPU_S {paper} {random}")


def main(n: int = 5120, rounds: int = 2) -> None:
    cpu: dict[str, list[list[float]]] = {p: [] for p in PATHS}
    for _ in range(rounds):
        for path in PATHS:
            # stdout only: a failing child's traceback reaches the terminal
            out = subprocess.run([sys.executable, __file__, path, str(n)], check=True,
                                 stdout=subprocess.PIPE, text=True).stdout.splitlines()
            print("\n".join(line for line in out if not line.startswith("CPU_S")))
            cpu[path].append([float(x) for x in out[-1].split()[1:]])
    for i, workload in enumerate(("paper studies", "random configurations")):
        many, single = (min(r[i] for r in cpu[p]) for p in PATHS)
        print(f"{workload}: one call each / predict_many = {single:.2f} / {many:.2f} s CPU = "
              f"{single / many:.2f}x (best of {rounds} each)")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run_path(sys.argv[1], int(sys.argv[2]))
    else:
        main()
