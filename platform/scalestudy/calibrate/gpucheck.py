"""`make gpu-check`: one command that checks a freshly booted GPU machine, with no Ray and no MLflow.

    python -m scalestudy.calibrate.gpucheck [--quick] [--out results/gpu-check]

1. Calibrates the local GPUs (calibrate/gpu.py): GEMM and fused-attention rates, HBM bandwidth,
   all_reduce / all_gather / reduce_scatter bus bandwidth between the local GPUs, the reference
   DeepSpeed step; written as a profile (``profile.yaml``) the performance model reads.
2. Measures a short study through the trial body's torchrun adapter (train/local.py):
   experiments/gpu-check.yaml (TinyLlama-1.1B, bf16, seq 2,048) at every world size in
   1, 2, 4, ... up to the number of local GPUs (and that number), ZeRO 0 and 3; with two GPUs or
   more, one pipeline trial too (pp 2, 1F1B, ZeRO-1), else a line saying why it is skipped.
3. Predicts the same trials from the fresh profile (perfmodel.predict).
4. Prints one table and writes it, with the profile's figures, as JSON under --out.

On a machine without a CUDA device it exits 2 with one line; likewise when deepspeed or transformers
is missing (they are not small pure-Python packages: the machine must bring them with CUDA torch), and
when the NVIDIA driver is older than torch's CUDA (train/cuda_driver.py, with the fix). A trial that
runs past TRIAL_TIMEOUT_S is killed with every process under torchrun (kill_tree).
Module-level imports are the standard library only: this file runs where Ray cannot be installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scalestudy import metrics as M

EXIT_UNFIT = 2
NO_GPU = "gpu-check: no CUDA device is visible to torch on this machine; nothing to check"
REPO = Path(__file__).resolve().parents[3]
SPEC = REPO / "experiments" / "gpu-check.yaml"
TRIAL_TIMEOUT_S = 300
KILL_WAIT_S = 30  # after the kill: for the pipes to close and torchrun to be reaped
COLUMNS = ("world", "pp", "zero", "status", M.TOKENS_PER_S, M.MFU, M.ENERGY_PER_TOKEN_J,
           "comm_exposed_frac", "peak_reserved_gib", "predicted_tokens_per_s", "error_pct")


def cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def missing_modules() -> list[str]:
    import importlib.util

    return [m for m in ("deepspeed", "transformers") if importlib.util.find_spec(m) is None]


def world_sizes(gpus: int) -> list[int]:
    """1, 2, 4, ... up to ``gpus``, and ``gpus`` itself."""
    return sorted({gpus} | {2**k for k in range(gpus.bit_length()) if 2**k <= gpus})


def trial_overrides(world: int, zero: int, profile: Path) -> list[str]:
    return [f"world_size={world}", f"zero_stage={zero}", f"hardware={profile}"]


# With two GPUs or more, one pipeline trial (issue 33): TinyLlama's 22 blocks in two stages of 11,
# 1F1B over 4 micro-batches of 4 sequences, ZeRO-1 (pp > 1 runs ZeRO-0/1 only).
PIPELINE_OVERRIDES = ["world_size=2", "pp=2", "zero_stage=1", "global_batch=16", "schedule=1f1b"]
PP_SKIPPED = "gpu-check: pp=2 trial skipped: it needs 2 GPUs, this machine has {gpus}"


def pipeline_overrides(profile: Path) -> list[str]:
    return [*PIPELINE_OVERRIDES, f"hardware={profile}"]


def run_trial(overrides: list[str], world: int) -> dict[str, Any]:
    """One trial through torchrun and the local adapter: its TrialResult as a dict (status failed,
    with the last line of the processes' stderr, when there is none)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           "-m", "scalestudy.train.local", str(SPEC), *(f"--set={o}" for o in overrides), "--json"]
    code, stdout, stderr = run_command(cmd, TRIAL_TIMEOUT_S)
    if code is None:
        return {"status": "failed", "reason": f"no result within {TRIAL_TIMEOUT_S} s"}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    tail = [ln for ln in stderr.splitlines() if ln.strip()]
    return {"status": "failed", "reason": tail[-1] if tail else f"exit {code}"}


def start_session(cmd: list[str]) -> subprocess.Popen:
    """`cmd` as the leader of a session (and process group) of its own, output captured."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)


def run_command(cmd: list[str], timeout_s: float) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of `cmd`; exit code None when it ran past `timeout_s`, after
    which it and every process it started are killed (kill_tree)."""
    proc = start_session(cmd)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        try:
            stdout, stderr = proc.communicate(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # a pipe still held open: give up on the output
            stdout = stderr = ""
        return None, stdout, stderr


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (children, their children, ...), from /proc's parent ids."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:  # ended while we looked
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)", which may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill `proc` (started by start_session) and everything below it. Its own process group is not
    enough: torchrun starts each rank with start_new_session, so a rank is the leader of a group of
    its own, with its children in it (a compiler, a loader). So: stop torchrun's group (it can start
    no rank and relay no signal meanwhile), find every descendant, then SIGKILL each descendant's
    process group and each descendant, and torchrun's group."""
    own = os.getpgrp()

    def signal_group(pgid: int, sig: int) -> None:
        if pgid != own:  # never the caller's own group (a descendant that stayed in it)
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    signal_group(proc.pid, signal.SIGSTOP)
    tree = descendants(proc.pid) if os.path.isdir("/proc") else []
    groups = {proc.pid}
    for pid in tree:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for pgid in groups:
        signal_group(pgid, signal.SIGKILL)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()


def predicted_tokens_per_s(overrides: list[str]) -> float:
    from scalestudy.perfmodel.predict import predict
    from scalestudy.spec.load import load_spec
    from scalestudy.plan import plan_study

    result = predict(plan_study(load_spec(SPEC, overrides))[0].config)
    return float(result.tokens_per_s)


def row(world: int, zero: int, measured: dict[str, Any], predicted: float, pp: int = 1
        ) -> dict[str, Any]:
    tps = float(measured.get(M.TOKENS_PER_S, math.nan) or math.nan)
    err = (predicted - tps) / tps * 100 if math.isfinite(tps) and tps > 0 else math.nan
    return {"world": world, "pp": pp, "zero": zero, "status": measured.get("status"),
            "reason": measured.get("reason"), M.TOKENS_PER_S: tps, M.MFU: measured.get(M.MFU),
            M.ENERGY_PER_TOKEN_J: measured.get(M.ENERGY_PER_TOKEN_J),
            "comm_exposed_frac": measured.get(M.COMM_EXPOSED_FRACTION),
            "peak_reserved_gib": measured.get(M.PEAK_MEMORY_RESERVED_GIB),
            "predicted_tokens_per_s": predicted, "error_pct": err}


def table(rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "nan" if not math.isfinite(v) else f"{v:.4g}"
        return "" if v is None else str(v)

    cells = [[cell(r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in cells]
    lines += [f"  world {r['world']} zero {r['zero']}: {r['reason']}" for r in rows if r.get("reason")]
    return "\n".join(lines)


# The memory estimate against each trial's measurement (issue 30): the allocator's peak
# (torch.cuda.max_memory_allocated, the trial's peak_memory_gib) against the estimate less what the
# allocator does not count (fragmentation, NCCL, CUDA context), and NVML's used memory of the device
# (read after the timed window: the reserved pool, the context, NCCL's buffers) against the whole.
MEMORY_BOUND = 0.15


def memory_row(world: int, zero: int, overrides: list[str], measured: dict[str, Any]) -> dict[str, Any]:
    """The plan's memory estimate of one trial beside what the trial measured (NaN where it did not)."""
    from scalestudy.plan import plan_study
    from scalestudy.spec.load import load_spec

    est = plan_study(load_spec(SPEC, overrides))[0].memory
    terms = est.terms_gib
    allocated_est = est.total_gib - terms["fragmentation"] - terms["nccl"] - terms["runtime"]

    def err(estimate: float, key: str) -> tuple[float, float]:
        value = float(measured.get(key) or math.nan)
        ok = math.isfinite(value) and value > 0
        return value, ((estimate / value - 1) * 100 if ok else math.nan)

    allocated, allocated_err = err(allocated_est, M.PEAK_MEMORY_GIB)
    used, used_err = err(est.total_gib, M.DEVICE_MEMORY_USED_GIB)
    return {"world": world, "zero": zero, "status": measured.get("status"), "terms_gib": terms,
            "estimate_allocated_gib": allocated_est, "allocated_gib": allocated,
            "allocated_error_pct": allocated_err, "estimate_gib": est.total_gib,
            "device_used_gib": used, "used_error_pct": used_err}


def memory_failures(rows: list[dict[str, Any]]) -> list[str]:
    """One line per completed trial whose estimate is beyond MEMORY_BOUND of a measured figure."""
    bad = []
    for r in rows:
        for key in ("allocated_error_pct", "used_error_pct"):
            if r["status"] == "completed" and abs(r[key]) > MEMORY_BOUND * 100:  # NaN compares False
                bad.append(f"world {r['world']} zero {r['zero']}: memory estimate {key} {r[key]:+.1f}% "
                           f"(bound {MEMORY_BOUND:.0%})")
    return bad


def memory_table(rows: list[dict[str, Any]]) -> str:
    head = "world zero  est_alloc  allocated   err%   estimate  dev_used   err%"
    lines = [head] + [f"{r['world']:>5} {r['zero']:>4} {r['estimate_allocated_gib']:>10.2f} "
                      f"{r['allocated_gib']:>10.2f} {r['allocated_error_pct']:>+6.1f} "
                      f"{r['estimate_gib']:>10.2f} {r['device_used_gib']:>9.2f} {r['used_error_pct']:>+6.1f}"
                      for r in rows]
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scalestudy.calibrate.gpucheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "results" / "gpu-check")
    p.add_argument("--quick", action="store_true", help="fewer calibration shapes and sizes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    gpus = cuda_device_count()
    if gpus == 0:
        print(NO_GPU, file=sys.stderr)
        return EXIT_UNFIT
    if missing := missing_modules():
        print(f"gpu-check: {', '.join(missing)} not installed; install it beside CUDA torch",
              file=sys.stderr)
        return EXIT_UNFIT
    from scalestudy.calibrate.gpu import calibrate_local_gpus
    from scalestudy.spec.catalog import write_profile
    from scalestudy.train.cuda_driver import CudaDriverMismatch, check_cuda_driver

    try:  # each trial's ranks check it too (train/process.py); here once, before minutes of work
        check_cuda_driver()
    except CudaDriverMismatch as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return EXIT_UNFIT
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    profile = calibrate_local_gpus(quick=args.quick)
    profile_path = args.out / "profile.yaml"
    write_profile(profile, profile_path)
    print(f"calibrated {gpus} GPU(s) in {time.time() - t0:.0f} s -> {profile_path}", flush=True)
    rows, memory_rows = [], []
    for world in world_sizes(gpus):
        for zero in (0, 3):
            overrides = trial_overrides(world, zero, profile_path)
            measured = run_trial(overrides, world)
            rows.append(row(world, zero, measured, predicted_tokens_per_s(overrides)))
            memory_rows.append(memory_row(world, zero, overrides, measured))
            print(table(rows[-1:]).splitlines()[1], flush=True)
    if gpus >= 2:
        overrides = pipeline_overrides(profile_path)
        measured = run_trial(overrides, 2)
        rows.append(row(2, 1, measured, predicted_tokens_per_s(overrides), pp=2))
        memory_rows.append(memory_row(2, 1, overrides, measured))
        print(table(rows[-1:]).splitlines()[1], flush=True)
    else:
        print(PP_SKIPPED.format(gpus=gpus), flush=True)
    print(table(rows))
    print(memory_table(memory_rows))
    misses = memory_failures(memory_rows)
    for line in misses:
        print(f"gpu-check: MEMORY ESTIMATE OFF: {line}", file=sys.stderr)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    report = {"profile": profile.model_dump(mode="json"), "rows": rows, "memory": memory_rows,
              "wall_s": time.time() - t0}
    out = args.out / f"gpu-check-{stamp}.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out} ({time.time() - t0:.0f} s)")
    return 0 if all(r["status"] == "completed" for r in rows) and not misses else 1


if __name__ == "__main__":
    sys.exit(main())
