"""Benchmark: recording 500 and 5,000 simulated trials (ledger and MLflow), and a simulate sweep
against `predict` of the same points.

Run: .venv/bin/python tests/bench/ledger_scaling.py            (about a minute on 2 cores)
     .venv/bin/python tests/bench/ledger_scaling.py 500 5000   (sizes)

For each size N, in a fresh process (cold caches, the same heap), a grid of exactly N points of
llama2-7b on h100-80gb (world sizes x ZeRO stage x tp; some infeasible) is planned once, then:
  * predict: perfmodel.predict_many of the planned points (what `scalestudy predict` does);
  * sweep: run_sweep of the same planned points, backend simulate: predictions, the ledger (batch
    parts, then the export), MLflow (one parent run, the predictions as one table) and the
    progress bar. MLflow is imported and its sqlite store created before the clock starts (once
    per store; its time is printed apart); the sweep makes its own experiment and parent run;
  * recording: the sweep's time outside the predictions (Recorder.record and close: rows, ledger
    parts, the MLflow table, the export, the bar);
  * per-trial ledger: N appends and N run-id patches, one part each (the measured backend's path:
    a measured trial takes minutes, so it is written the moment it ends), then one read back from
    the parts, the export a sweep's end writes, and a read back that starts from the export.
Wall and CPU seconds of this process are printed (the machine may be shared: CPU is the steadier
figure); the ratios the issue asks for are printed last, from wall time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).parents[2]
sys.path.insert(0, str(REPO))

RECORD_RATIO_MAX = 12.0  # 10x the trials: linear is 10x; quadratic would be 100x
SWEEP_OVER_PREDICT_MAX = 10.0


class Clock:
    def __init__(self):
        self.wall = self.cpu = 0.0

    def __enter__(self):
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._w
        self.cpu += time.process_time() - self._c


def _spec(n: int):
    from scalestudy.spec.load import validate_spec

    assert n % 20 == 0, "a size divisible by 20 (4 ZeRO stages x 5 tp degrees x world sizes)"
    return validate_spec({
        "name": f"ledger-bench-{n}", "model": "llama2-7b", "hardware": "h100-80gb",
        "backend": "simulate", "seq_len": 4096, "micro_batch": 1,
        "world_size": [8 * i for i in range(1, n // 20 + 1)], "zero_stage": [0, 1, 2, 3],
        "tp": [1, 2, 4, 8, 16]})


def run_size(n: int) -> dict:
    """Every figure for one size, in this (fresh) process."""
    from scalestudy.perfmodel.predict import predict_many
    from scalestudy.plan import plan_study
    from scalestudy.sweep import driver
    from scalestudy.track.ledger import Ledger, ledger_path
    from scalestudy.track.mlflow_writer import MlflowWriter

    tmp = Path(tempfile.mkdtemp(prefix="ledger-bench-"))
    out: dict = {"n": n}
    spec = _spec(n)
    with Clock() as c:
        planned = plan_study(spec)
    out["plan"], out["points"] = c.wall, len(planned)
    assert len(planned) == n
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    with Clock() as c:
        MlflowWriter(uri, "store-warm-up")  # imports mlflow, creates the store's tables
    out["mlflow_store"] = c.wall

    with Clock() as predict:
        results = predict_many(planned)
    out["predict"], out["predict_cpu"] = predict.wall, predict.cpu
    out["completed"] = sum(r.status.value == "completed" for r in results)

    recording = Clock()
    for name in ("record", "close"):  # time inside the Recorder, predictions excluded
        original = getattr(driver.Recorder, name)

        def timed(self, *args, _original=original):
            with recording:
                return _original(self, *args)

        setattr(driver.Recorder, name, timed)
    with Clock() as sweep:
        outcome = driver.run_sweep(spec, planned, "bench", results_root=tmp / "results",
                                   show_progress=True)
    assert outcome.mlflow_error is None and len(outcome.results) == n, outcome.mlflow_error
    out["sweep"], out["sweep_cpu"] = sweep.wall, sweep.cpu
    out["recording"], out["recording_cpu"] = recording.wall, recording.cpu
    ledger = Ledger(ledger_path(spec.name, tmp / "results"))
    out["sweep_parts"] = len(ledger.part_names())

    per_trial = Ledger(ledger_path("per-trial", tmp / "results"))
    with Clock() as c:
        for r in results:
            per_trial.append(r, mlflow_run_id=None)
            per_trial.update(r.trial_id, mlflow_run_id="run")
    out["append"], out["append_cpu"] = c.wall, c.cpu
    with Clock() as c:
        rows = per_trial.rows()
    assert len(rows) == n and {r["mlflow_run_id"] for r in rows} == {"run"}
    out["read"], out["read_cpu"] = c.wall, c.cpu
    with Clock() as c:
        per_trial.export()  # as the end of a sweep does
    out["export"] = c.wall
    with Clock() as c:
        again = per_trial.rows()
    assert len(again) == n
    out["read_exported"], out["read_exported_cpu"] = c.wall, c.cpu
    return out


def main(sizes: list[int]) -> None:
    figures = []
    for n in sizes:
        proc = subprocess.run([sys.executable, __file__, "--one", str(n)], check=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        f = json.loads(proc.stdout.splitlines()[-1])
        figures.append(f)
        print(f"{n} points ({f['completed']} completed, {n - f['completed']} infeasible); plan "
              f"{f['plan']:.2f} s; new MLflow sqlite store (import + tables, once per store) "
              f"{f['mlflow_store']:.2f} s")
        print(f"  predict (predict_many)            {f['predict']:7.2f} s wall {f['predict_cpu']:7.2f} s CPU")
        print(f"  simulate sweep (run_sweep)        {f['sweep']:7.2f} s wall {f['sweep_cpu']:7.2f} s CPU"
              f"  ({f['sweep_parts']} ledger parts, 1 MLflow run)")
        print(f"    of which recording (ledger+MLflow+bar) {f['recording']:7.2f} s wall "
              f"{f['recording_cpu']:7.2f} s CPU")
        print(f"  per-trial ledger: {n} appends + {n} patches {f['append']:7.2f} s wall "
              f"{f['append_cpu']:7.2f} s CPU")
        print(f"    read back from {2 * n} parts {f['read']:.2f} s wall {f['read_cpu']:.2f} s CPU; "
              f"export {f['export']:.2f} s; read back from the export "
              f"{f['read_exported']:.2f} s wall {f['read_exported_cpu']:.2f} s CPU")
    if len(figures) == 2:
        small, big = figures
        k = big["n"] / small["n"]
        rec = big["recording"] / small["recording"]
        app = big["append"] / small["append"]
        print(f"recording {big['n']} / {small['n']} simulated trials (ledger and MLflow): "
              f"{rec:.1f}x for {k:g}x the trials (target <= {RECORD_RATIO_MAX:g}: "
              f"{'ok' if rec <= RECORD_RATIO_MAX else 'MISSED'})")
        print(f"per-trial ledger {big['n']} / {small['n']}: {app:.1f}x (target <= "
              f"{RECORD_RATIO_MAX:g}: {'ok' if app <= RECORD_RATIO_MAX else 'MISSED'})")
    for f in figures:
        ratio = f["sweep"] / f["predict"]
        print(f"sweep / predict, {f['n']} points: {f['sweep']:.2f} / {f['predict']:.2f} s = "
              f"{ratio:.1f}x (target <= {SWEEP_OVER_PREDICT_MAX:g}: "
              f"{'ok' if ratio <= SWEEP_OVER_PREDICT_MAX else 'MISSED'})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(run_size(int(sys.argv[2]))))
    else:
        main([int(a) for a in sys.argv[1:]] or [500, 5000])
