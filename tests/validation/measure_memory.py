"""Measure the peak memory of CPU trials for the memory estimate's check (issue 30, item 2).

    .venv/bin/python tests/validation/measure_memory.py [--only ID ...] [--out PATH]

Runs every trial of tests/validation/data/memory_measured.yaml one after another, each in a process
group of its own (torchrun + the trial body's local adapter, train/local.py, no Ray), and writes back
what each one recorded as `peak_memory_gib` (on a CPU: the largest rank's peak RSS, what DeepSpeed's
CPU accelerator reports as memory allocated), with the command, the date and `lscpu`'s model name.
Prints the estimate (perfmodel/memory.py) beside each measurement. Three groups of trials:
  process:     llama2-tiny, whose states and activations are a few MiB: the worker process itself
               (memory.CPU_PROCESS_BYTES);
  calibration: another model (mem-calib-33m), from which the CPU heap's retention comes
               (memory.CPU_HEAP_RETENTION_PLAIN and _SHARDED);
  scored:      mem-llama-52m (memory_spec.yaml), never used to choose a constant: the test
               (test_memory_measured.py) holds the estimate to 15% of each of them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "validation" / "data" / "memory_measured.yaml"
SPEC = REPO / "tests" / "validation" / "data" / "memory_spec.yaml"
TRIAL_TIMEOUT_S = 900


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                 if ln.startswith("Model name")), "unknown")


def software() -> str:
    import deepspeed
    import torch

    return f"torch {torch.__version__}, deepspeed {deepspeed.__version__}"


def world_of(sets: list[str]) -> int:
    return next((int(s.split("=", 1)[1]) for s in sets if s.startswith("world_size=")), 1)


def run_trial(sets: list[str], spec: Path = SPEC, timeout_s: float = TRIAL_TIMEOUT_S) -> dict[str, Any]:
    """One trial through torchrun and the local adapter, in its own processes: its TrialResult."""
    world = world_of(sets)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(world), "-m", "scalestudy.train.local", str(spec), *(f"--set={s}" for s in sets),
           "--json", "--no-instrument"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-3:]
        raise RuntimeError(f"trial {sets} gave no result (exit {proc.returncode}): {tail}")
    result = json.loads(lines[-1])
    if result.get("status") != "completed":
        raise RuntimeError(f"trial {sets}: {result.get('status')}: {result.get('reason')}")
    result["wall_s"] = time.time() - t0
    return result


def estimate(sets: list[str], spec: Path = SPEC):
    """The plan's memory estimate of the trial (the fused-attention flag the plan uses)."""
    from scalestudy.plan import plan_study
    from scalestudy.spec.load import load_spec

    (entry,) = plan_study(load_spec(spec, sets))
    assert entry.memory is not None, entry.reason
    return entry.memory


def spec_of(group: dict[str, Any]) -> Path:
    return REPO / group.get("spec", str(SPEC.relative_to(REPO)))


def measure_all(data: dict[str, Any], only: set[str]) -> None:
    for group in data["groups"].values():
        spec = spec_of(group)
        for trial in group["trials"]:
            if only and trial["id"] not in only:
                continue
            result = run_trial(trial["set"], spec)
            trial["peak_memory_gib"] = round(float(result["peak_memory_gib"]), 4)
            trial["memory_source"] = result["memory_source"]
            trial["wall_s"] = round(result["wall_s"], 1)
            est = estimate(trial["set"], spec).total_gib
            print(f"{trial['id']:<28} measured {trial['peak_memory_gib']:.3f} GiB  estimate "
                  f"{est:.3f}  ({(est / trial['peak_memory_gib'] - 1) * 100:+.1f}%)  "
                  f"{trial['wall_s']:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", default=[], help="trial ids to (re)measure; default all")
    p.add_argument("--out", type=Path, default=DATA)
    args = p.parse_args(argv)
    data = yaml.safe_load(DATA.read_text())
    measure_all(data, set(args.only))
    data["measured"] = {"command": " ".join(["tests/validation/measure_memory.py", *sys.argv[1:]]),
                        "date": dt.date.today().isoformat(), "cpu_model": cpu_model(),
                        "software": software()}
    header = "".join(ln + "\n" for ln in DATA.read_text().splitlines() if ln.startswith("#"))
    args.out.write_text(header + yaml.safe_dump(data, sort_keys=False, width=110))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
