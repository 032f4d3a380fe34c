"""Fault injection on a real trial: a Ray Train worker process killed mid-window restarts the worker
group from the last DeepSpeed checkpoint (FailureConfig), and the sweep records one row."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from scalestudy.metrics import Status
from scalestudy.spec.load import load_spec
from scalestudy.plan import plan_study
from scalestudy.sweep.driver import FAULT_ENV, run_sweep
from scalestudy.track.ledger import Ledger

pytestmark = pytest.mark.slow


def _train_worker_pids() -> list[int]:
    """Ray Train worker processes on this machine (Ray titles them `ray::RayTrainWorker...`)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if cmd.startswith(b"ray::RayTrainWorker"):
                pids.append(int(entry.name))
    return sorted(pids)


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def _sweep_in_thread(spec_path: Path, root: Path) -> tuple[threading.Thread, dict]:
    spec = load_spec(spec_path)
    box: dict = {}

    def _run() -> None:
        box["outcome"] = run_sweep(spec, plan_study(spec), spec_path.read_text(), max_concurrent=1,
                                   results_root=root, show_progress=False)

    thread = threading.Thread(target=_run, daemon=True)
    thread.start()
    return thread, box


def test_kill_worker_mid_window_restarts_from_checkpoint(ray_session, tmp_path, monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec_path = tmp_path / "study.yaml"
    spec_path.write_text(f"""
name: killworker
model: llama2-tiny
hardware: cpu-local
world_size: 2
steps: {{warmup: 2, measure: 40, profile: 0}}
fault_tolerance: {{max_failures: 2, checkpoint_every: 4}}
tracking: {{mlflow_uri: "{uri}"}}
""")
    root = tmp_path / "results"
    before = set(_train_worker_pids())  # idle workers of earlier tests are not this trial's
    thread, box = _sweep_in_thread(spec_path, root)
    # Checkpoints come before steps 4, 8, ... of the timed window (steps 2..41), a report each. A rank
    # writes the second only after its report of the first returned, so once two are on storage
    # the first is registered with Ray Train and a restart can resume from it.
    _wait_for(lambda: len(list(root.rglob("loop_state.json"))) >= 2, 300, "two checkpoints")
    time.sleep(1)
    victims = _wait_for(lambda: sorted(set(_train_worker_pids()) - before), 30,
                        "the trial's worker processes")
    killed_at = time.time()
    os.kill(victims[-1], signal.SIGKILL)
    thread.join(timeout=400)
    assert not thread.is_alive(), "sweep did not finish after the worker was killed"
    recovered_s = time.time() - killed_at

    (result,) = box["outcome"].results
    assert result.status is Status.completed, result.reason
    assert result.restarts == 1 and result.resizes == []
    assert len(result.step_times_s) == 40  # the resumed attempt finished the window, no more
    assert 0 < result.time_lost_s < recovered_s + 60
    rows = Ledger(root / "killworker" / "trials.parquet").rows()
    assert len(rows) == 1 and rows[0]["restarts"] == 1
    print(f"\nkilled worker pid {victims[-1]}: time lost {result.time_lost_s:.1f} s "
          f"(last checkpoint -> resumed loop), kill -> trial done {recovered_s:.1f} s")

