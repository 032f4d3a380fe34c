"""`make gpu-check`: one command that checks a freshly booted GPU machine, with no Ray and no MLflow.

    python -m scalestudy.calibrate.gpucheck [--quick] [--out results/gpu-check]

1. Calibrates the local GPUs (calibrate/gpu.py): GEMM and fused-attention rates, HBM bandwidth,
   all_reduce / all_gather / reduce_scatter bus bandwidth between the local GPUs, the reference
   DeepSpeed step; written as a profile (``profile.yaml``) the performance model reads.
2. Measures a short study through the trial body's torchrun adapter (train/local.py):
   experiments/gpu-check.yaml (TinyLlama-1.1B, bf16, seq 2,048) at every world size in
   1, 2, 4, ... up to the number of local GPUs (and that number), ZeRO 0 and 3.
3. Predicts the same trials from the fresh profile (perfmodel.predict).
4. Prints one table and writes it, with the profile's figures, as JSON under --out.

On a machine without a CUDA device it exits 2 with one line; likewise when deepspeed or transformers
is missing (they are not small pure-Python packages: the machine must bring them with CUDA torch).
Module-level imports are the standard library only: this file runs where Ray cannot be installed.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

EXIT_UNFIT = 2
NO_GPU = "gpu-check: no CUDA device is visible to torch on this machine; nothing to check"
REPO = Path(__file__).resolve().parents[3]
SPEC = REPO / "experiments" / "gpu-check.yaml"
TRIAL_TIMEOUT_S = 300
COLUMNS = ("world", "zero", "status", "tokens_per_s", "mfu", "energy_per_token_j", "comm_exposed_frac",
           "peak_reserved_gib", "predicted_tokens_per_s", "error_pct")


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


def run_trial(overrides: list[str], world: int) -> dict[str, Any]:
    """One trial through torchrun and the local adapter: its TrialResult as a dict (status failed,
    with the last line of the processes' stderr, when there is none)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           "-m", "scalestudy.train.local", str(SPEC), *(f"--set={o}" for o in overrides), "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"no result within {TRIAL_TIMEOUT_S} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    return {"status": "failed", "reason": tail[-1] if tail else f"exit {proc.returncode}"}


def predicted_tokens_per_s(overrides: list[str]) -> float:
    from scalestudy.perfmodel.predict import predict
    from scalestudy.spec.load import load_spec, plan

    result = predict(plan(load_spec(SPEC, overrides))[0].config)
    return float(result.tokens_per_s)


def row(world: int, zero: int, measured: dict[str, Any], predicted: float) -> dict[str, Any]:
    tps = float(measured.get("tokens_per_s", math.nan) or math.nan)
    err = (predicted - tps) / tps * 100 if math.isfinite(tps) and tps > 0 else math.nan
    return {"world": world, "zero": zero, "status": measured.get("status"),
            "reason": measured.get("reason"), "tokens_per_s": tps, "mfu": measured.get("mfu"),
            "energy_per_token_j": measured.get("energy_per_token_j"),
            "comm_exposed_frac": measured.get("comm_exposed_fraction"),
            "peak_reserved_gib": measured.get("peak_memory_reserved_gib"),
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

    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    profile = calibrate_local_gpus(quick=args.quick)
    profile_path = args.out / "profile.yaml"
    write_profile(profile, profile_path)
    print(f"calibrated {gpus} GPU(s) in {time.time() - t0:.0f} s -> {profile_path}", flush=True)
    rows = []
    for world in world_sizes(gpus):
        for zero in (0, 3):
            overrides = trial_overrides(world, zero, profile_path)
            rows.append(row(world, zero, run_trial(overrides, world), predicted_tokens_per_s(overrides)))
            print(table(rows[-1:]).splitlines()[1], flush=True)
    print(table(rows))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    report = {"profile": profile.model_dump(mode="json"), "rows": rows, "wall_s": time.time() - t0}
    out = args.out / f"gpu-check-{stamp}.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out} ({time.time() - t0:.0f} s)")
    return 0 if all(r["status"] == "completed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
