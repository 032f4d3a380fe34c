"""`scalestudy plan` against an exhaustive measurement of its space, on this machine (issue 34; not
part of `make test`: the first run measures every layout, ~10-20 min on 2 cores).

    python tests/bench/plan_regret.py [--cache DIR] [--refresh] [--rounds 4] [--top-k 4]

1. A profile from `calibrate --local --quick` (cached): its reference steps are another model's
   (llama2-calib), so it never ran a layout of this space.
2. The space: llama2-tiny on 2 CPU workers, global batch 8, every free axis (ZeRO 0-3, tp 1-2,
   pp 1-2, micro-batch, recomputation); --mem-cap at the plan's memory estimates' 70th percentile, so
   that more than a quarter of the space does not fit.
3. Every layout that fits, measured once by one sweep (Ray Tune x Ray Train x DeepSpeed, warm
   groups) and cached as TrialResults.
4. The plan's rounds (plan/rounds.py) with the cache as what measures: a layout the plan chooses is
   given the measurement the exhaustive sweep took of it, so plan and exhaustive grid are scored on
   the same numbers. Trial time is the cached trials' wall time.
5. Printed: the recommended layout's regret against the exhaustive best, the share of the grid's
   trial time the plan spent, Spearman's rank correlation of the last refit's predictions against the
   measurements over the layouts the plan measured, each measured layout's peak memory against the cap,
   and two baselines on the same cache: ZeRO-3 with the largest micro-batch that fits, and a
   DeepSpeed-autotuner-style grid (ZeRO stage x micro-batch, no model parallelism or recomputation).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from scalestudy.spec.trial import trial_key

REPO = Path(__file__).parents[2]
REQ = dict(model="llama2-tiny", hardware="cpu-local", devices=2, global_batch=8, seq_len=128)
STEPS = {"warmup": 2, "measure": 8, "profile": 0}
CAP_QUANTILE = 0.7


def _cpu() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _profile(cache: Path, refresh: bool):
    from scalestudy.spec import catalog

    path = cache / "profile.yaml"
    if refresh or not path.exists():
        subprocess.run([str(Path(sys.executable).parent / "scalestudy"), "calibrate", "--local",
                        "--quick", "--out", str(path)], check=True)
    return catalog.load_hardware_file(path)


def _cap(req, profile) -> float:
    from scalestudy.plan.space import rank

    fits = sorted(r.entry.memory.total_gib for r in rank(req, profile) if r.feasible)
    return fits[int(CAP_QUANTILE * (len(fits) - 1))] / 0.95 + 1e-6


def _exhaustive(req, profile, cache: Path, refresh: bool) -> dict:
    from scalestudy.metrics import TrialResult
    from scalestudy.plan.space import rank, space_spec
    from scalestudy.sweep.driver import run_sweep

    path = cache / "exhaustive.jsonl"
    if refresh or not path.exists():
        settings = {"backend": "measure", "steps": STEPS,
                    "tracking": {"mlflow_uri": f"sqlite:///{cache / 'mlflow.db'}"}}
        entries = [r.entry for r in rank(req, profile, **settings) if r.feasible]
        spec = space_spec(req, profile, **settings)
        out = run_sweep(spec, entries, "plan_regret exhaustive", results_root=cache / "results",
                        max_concurrent=1)
        path.write_text("".join(r.model_dump_json() + "\n" for r in out.results))
    results = [TrialResult.model_validate_json(ln) for ln in path.read_text().splitlines()]
    return {trial_key(r): r for r in results}


def _short(r, steps: int):
    """The cached trial as a shorter window would have measured it: its first `steps` timed steps,
    and its wall time less the steps it would not have run."""
    import statistics

    times = r.step_times_s
    if r.status.value != "completed" or len(times) <= steps:
        return r
    per_step = r.tokens_per_s * statistics.median(times)
    return r.model_copy(update={"tokens_per_s": per_step / statistics.median(times[:steps]),
                                "step_times_s": times[:steps],
                                "wall_time_s": r.wall_time_s - sum(times[steps:])})


def _replay(grid: dict):
    def measure(entries, index, steps=None):
        got = [grid[trial_key(e.config)] for e in entries if trial_key(e.config) in grid]
        return got if steps is None else [_short(r, steps) for r in got]
    return measure


def _spearman(xs: list[float], ys: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(xs, ys).statistic) if len(xs) > 2 else math.nan


def _baselines(grid: dict, names: dict, best: float, total_s: float) -> list[str]:
    done = [r for r in grid.values() if r.status.value == "completed"]
    plain = [r for r in done if r.tp == 1 and r.pp == 1 and not r.activation_checkpointing]
    z3 = max((r for r in plain if r.zero_stage == 3), key=lambda r: r.micro_batch, default=None)
    out = []
    if z3 is not None:
        out.append(f"ZeRO-3, largest micro-batch that fits ({names[trial_key(z3)]}): regret "
                   f"{1 - z3.tokens_per_s / best:.1%}, cost {z3.wall_time_s / total_s:.1%} of the grid")
    if plain:
        top = max(plain, key=lambda r: r.tokens_per_s)
        cost = sum(r.wall_time_s for r in plain) / total_s
        out.append(f"autotuner-style grid (ZeRO stage x micro-batch, {len(plain)} trials; best "
                   f"{names[trial_key(top)]}): regret {1 - top.tokens_per_s / best:.1%}, "
                   f"cost {cost:.1%}")
    return out


def _report_plan(label: str, out, req, grid: dict, best: float, total_s: float) -> dict:
    rec = out.recommended
    spent_s = sum(r.wall_time_s for r in out.runs)
    full = {k: m for k, m in out.measured.items() if m.completed and m.window == "full"}
    now = {k: out.predicted_now(k) for k in full}
    pairs = [(now[k].result.tokens_per_s * now[k].factor, m.result.tokens_per_s)
             for k, m in full.items() if now[k] is not None]
    rho = _spearman(*zip(*pairs)) if len(pairs) > 2 else math.nan
    # each layout as predicted when it was chosen: before it was measured (out of sample)
    before = [(m.chosen_as.result.tokens_per_s * m.chosen_as.factor, m.result.tokens_per_s)
              for m in full.values()]
    rho_before = _spearman(*zip(*before)) if len(before) > 2 else math.nan
    over_cap = [m.name for m in out.measured.values() if m.result.peak_memory_gib > req.mem_cap_gib]
    regret = 1 - grid[trial_key(rec.chosen_as.entry.config)].tokens_per_s / best
    print(f"plan{label}: {out.spent_trials} trials in {len(out.rounds)} rounds ({out.stop_reason}); "
          f"recommended {rec.name} {rec.result.tokens_per_s:,.0f} tokens/s: regret {regret:.1%} "
          f"(bar 3%), trial time {spent_s / total_s:.1%} of the grid's (bar 25%)")
    print(f"  Spearman against the measured, over {len(pairs)} layouts measured full: the last "
          f"refit's predictions (with family factors; in sample) {rho:.3f} (bar 0.8); each as "
          f"predicted when chosen (out of sample) {rho_before:.3f}; measured peak memory over the "
          f"cap: {over_cap or 'none'}")
    return {"plan": label.strip() or "rounds", "regret": regret, "time_share": spent_s / total_s,
            "trials": out.spent_trials, "spearman": rho, "spearman_when_chosen": rho_before}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "scalestudy-plan-regret")
    p.add_argument("--refresh", action="store_true", help="measure again (profile and grid)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--halving-steps", type=int, default=2)
    a = p.parse_args(argv)
    a.cache.mkdir(parents=True, exist_ok=True)
    from scalestudy.plan.rounds import PlanBudget, run_plan
    from scalestudy.plan.space import PlanRequest, rank

    profile = _profile(a.cache, a.refresh)
    req = PlanRequest(**{**REQ, "hardware": profile.name})
    req = req.model_copy(update={"mem_cap_gib": _cap(req, profile)})
    grid = _exhaustive(req, profile, a.cache, a.refresh)
    ranked = rank(req, profile)
    names = {trial_key(r.entry.config): r.entry.config.run_name for r in ranked}
    done = {k: r for k, r in grid.items() if r.status.value == "completed"}
    best_key = max(done, key=lambda k: done[k].tokens_per_s)
    best, total_s = done[best_key].tokens_per_s, sum(r.wall_time_s for r in grid.values())
    print(f"CPU: {_cpu()}; space: {len(ranked)} layouts, {len(grid)} fit under --mem-cap "
          f"{req.mem_cap_gib:.3f} GiB ({len(done)} completed); exhaustive best {names[best_key]} "
          f"{best:,.0f} tokens/s; the grid's trial time {total_s:.0f} s")
    figures = []
    for label, halving in (("", None), (f" with halving ({a.halving_steps} steps first)", a.halving_steps)):
        out = run_plan(req, profile, _replay(grid), top_k=a.top_k, rounds=a.rounds,
                       budget=PlanBudget(), halving_steps=halving, steps=STEPS)
        figures.append(_report_plan(label, out, req, grid, best, total_s))
    for line in _baselines(grid, names, best, total_s):
        print("baseline: " + line)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
