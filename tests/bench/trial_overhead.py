"""Per-trial fixed overhead of a measured sweep against the same trials run as torchrun + DeepSpeed
processes, side by side in one invocation (not part of `make test`; minutes on a 2-core machine).

    python tests/bench/trial_overhead.py [--spec experiments/quickstart.yaml] [--set KEY=VALUE ...]

(a) `scalestudy sweep SPEC --json --max-concurrent 1` in a fresh process: Ray start-up, Tune, the
    trials and Ray's shut-down, as a user runs it (with --compare-cold, once more with a cold
    Ray Train worker group per trial, `workers: {reuse: false}`); (b) every trial of the same study, one after
    another, as `torchrun --standalone --nproc_per_node N -m scalestudy.train.local SPEC --set ...`
    (how DeepSpeed's autotuner runs its experiments). Fixed overhead per trial = (wall time of all
    of it - the trials' summed timed-window step times) / trials, for each. Then where (a)'s time
    goes, from the wall-clock marks each trial's rank 0 and adapter record (train/timing.py, in a
    result's extra["timing"]), per trial on average.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).parents[2]

# Marks in the order a trial passes them, each naming what happened since the previous present
# mark (a warm trial has no imports or process group of its own: those were paid once per group).
GROUP_START = ("warm group start: placement, worker processes, imports, process group (once per "
               "group)")
SEGMENTS = (
    ("worker_entry", "start-up before the body: Ray Train controller, placement group and worker "
                     "processes (cold), or a warm group's lease"),
    ("imported", "imports in the worker (torch, DeepSpeed)"),
    ("process_group", "process-group init (deepspeed.init_distributed)"),
    ("model_built", "model build"),
    ("engine_ready", "DeepSpeed init (deepspeed.initialize)"),
    ("warmed_up", "warm-up steps"),
    ("timed_window_done", "timed window beyond its step times (step timer syncs)"),
    ("windows_done", "meters and profiled window"),
    ("trial_end", "reductions, summary, hand-back to the trainable, teardown"),
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", type=Path, default=REPO / "experiments" / "quickstart.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--compare-cold", action="store_true",
                   help="also sweep with workers: {reuse: false} (a cold worker group per trial)")
    return p.parse_args(argv)


def _results(stdout: str) -> list[dict]:
    return [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]


def run_sweep(spec: Path, overrides: list[str], tmp: Path) -> tuple[float, float, list[dict]]:
    """(start, end, results) of the whole sweep command."""
    cmd = [str(Path(sys.executable).parent / "scalestudy"), "sweep", str(spec), "--json",
           "--max-concurrent", "1", "--results-root", str(tmp / "results"),
           "--set", f"tracking.mlflow_uri=sqlite:///{tmp / 'mlflow.db'}"]
    cmd += [f"--set={s}" for s in overrides]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    end = time.time()
    if proc.returncode != 0:
        sys.exit(f"sweep failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return start, end, _results(proc.stdout)


def trial_sets(result: dict) -> list[str]:
    """The --set overrides that pick this trial out of the study."""
    from scalestudy.spec.trial import AXES

    return [f"{a}={json.dumps(result[a])}" for a in AXES if a not in ("model", "hardware")]


def run_torchrun(spec: Path, overrides: list[str], results: list[dict]) -> tuple[float, list[dict]]:
    """The same trials as torchrun processes, one after another: (total wall, their results)."""
    out, start = [], time.time()
    for r in results:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(r["world_size"]), "-m", "scalestudy.train.local", str(spec), "--json"]
        cmd += [f"--set={s}" for s in [*overrides, *trial_sets(r)]]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        got = _results(proc.stdout)
        if proc.returncode != 0 or not got:
            sys.exit(f"torchrun trial failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        out += got
    return time.time() - start, out


def step_time_sum(results: list[dict]) -> float:
    return sum(sum(r["step_times_s"]) for r in results)


def breakdown(start: float, end: float, results: list[dict]) -> dict[str, float]:
    """Seconds per trial (mean) in each part of the sweep that is not a timed step."""
    parts = dict.fromkeys(["sweep start-up (CLI, Ray, Tune)", GROUP_START,
                           *(label for _, label in SEGMENTS),
                           "between trials (Tune)", "sweep end (Tune, Ray shut-down)"], 0.0)
    trials = sorted((r for r in results if r["extra"].get("timing")),
                    key=lambda r: r["extra"]["timing"]["trial_start"])
    previous_end = None
    for r in trials:
        marks = dict(r["extra"]["timing"])
        marks["trial_end"] = marks["trial_start"] + r["wall_time_s"]
        at = marks["trial_start"]
        if previous_end is None:
            parts["sweep start-up (CLI, Ray, Tune)"] += at - start
        else:
            parts["between trials (Tune)"] += at - previous_end
        group_start = r["extra"].get("worker_group", {}).get("start_s", 0.0)
        parts[GROUP_START] += group_start
        at += group_start  # the rest of the way to worker_entry is the lease and the actor call
        for name, label in SEGMENTS:
            if name in marks:
                parts[label] += marks[name] - at
                at = marks[name]
        parts[SEGMENTS[6][1]] -= sum(r["step_times_s"])
        previous_end = marks["trial_end"]
    if previous_end is not None:
        parts["sweep end (Tune, Ray shut-down)"] += end - previous_end
    return {k: v / max(len(trials), 1) for k, v in parts.items()}


def report_sweep(title: str, start: float, end: float, results: list[dict], n: int,
                 theirs_fixed: float) -> None:
    fixed = (end - start - step_time_sum(results)) / n
    print(f"{title}: {end - start:7.1f} s wall, {step_time_sum(results):6.2f} s timed steps, "
          f"{fixed:6.2f} s fixed overhead per trial, {fixed / theirs_fixed:.2f}x torchrun's")
    print("  where its fixed overhead goes, seconds per trial:")
    parts = breakdown(start, end, results)
    for label, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"    {seconds:6.2f}  {label}")
    print(f"    {sum(parts.values()):6.2f}  sum of the parts")
    groups = {r["extra"]["worker_group"]["id"] for r in results if "worker_group" in r["extra"]}
    if groups:
        print(f"  {len(groups)} warm groups for {n} trials")


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    runs = [("sweep, warm worker groups (workers: {reuse: true})", [])]
    if args.compare_cold:
        runs.append(("sweep, a cold Ray Train worker group per trial (workers: {reuse: false})",
                     ["workers.reuse=false"]))
    swept = []
    for title, extra in runs:
        with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
            swept.append((title, *run_sweep(args.spec, [*args.overrides, *extra], Path(tmp))))
    done = [r for r in swept[0][3] if r["status"] == "completed"]
    if not done or any(len([r for r in s[3] if r["status"] == "completed"]) != len(done)
                       for s in swept):
        sys.exit("not every trial completed: " + "; ".join(
            f"{r['run_name'] if 'run_name' in r else r['trial_id']}: {r['reason']}"
            for s in swept for r in s[3] if r["status"] != "completed"))
    theirs_wall, theirs = run_torchrun(args.spec, args.overrides, done)
    n = len(done)
    theirs_fixed = (theirs_wall - step_time_sum(theirs)) / n
    print(f"{n} trials of {args.spec.name} ({' '.join(args.overrides) or 'as written'}), "
          f"one at a time; fixed overhead = (wall - summed timed-window step times) / trials")
    print(f"torchrun + DeepSpeed, one process per rank per trial: {theirs_wall:7.1f} s wall, "
          f"{step_time_sum(theirs):6.2f} s timed steps, {theirs_fixed:6.2f} s fixed overhead per "
          f"trial")
    for title, start, end, results in swept:
        report_sweep(title, start, end, results, n, theirs_fixed)
    ratio = ((swept[0][2] - swept[0][1] - step_time_sum(swept[0][3])) / n) / theirs_fixed
    print(f"ratio (warm sweep / torchrun): {ratio:.2f}x   (target <= 0.5x, bar 1.0x)")

if __name__ == "__main__":
    main()
