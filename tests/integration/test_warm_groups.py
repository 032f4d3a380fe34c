"""Warm worker groups (launch/warm.py): trials that share worker processes measure what cold ones do.

A trial after others on the same warm group trains exactly as it does cold (losses to 1e-6 in
fp32), its peak memory is its own, a failing trial or one past its time limit takes its group down
without touching the next trial, and `workers: {reuse: false}` gives every trial a cold Ray Train worker group.
Faults injected into the second of three trials on one group (a real out-of-memory in one rank, a
worker process killed mid-trial) leave the third training as a cold run does, with nothing of the
failed group left allocated or busy; so does a trial abandoned while its group is still starting.
The fault and cold-start tests are marked slow (`make test-slow`)."""

from __future__ import annotations

import os
import re
import resource
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
import ray

from scalestudy.metrics import Status
from scalestudy.spec.load import load_spec
from scalestudy.plan import plan_study
from scalestudy.sweep.driver import FAULT_ENV, run_sweep
from scalestudy.track.ledger import Ledger
from scalestudy.launch.ray_train import run_trial
from scalestudy.launch.warm import WarmRun, warm_pool
from tests.conftest import trial

BASE = ["precision=fp32", "micro_batch=2", "steps={warmup: 1, measure: 3, profile: 0}"]


def _warm(pool: str, overrides: list[str]):
    cfg = trial(BASE + overrides)
    return WarmRun(pool, cfg).run(time.time())


def test_trial_after_others_on_a_warm_group_trains_as_cold(ray_session, ray_storage):
    ws2 = ["world_size=2"]
    with warm_pool(True, uuid.uuid4().hex[:8]) as pool:
        first = _warm(pool, ws2 + ["zero_stage=3"])
        tp2 = _warm(pool, ws2 + ["zero_stage=1", "tp=2"])
        warm = _warm(pool, ws2 + ["zero_stage=0"])
    cold = run_trial(trial(BASE + ws2 + ["zero_stage=0"]), ray_storage)
    for r in (first, tp2, warm, cold):
        assert r.status is Status.completed, r.reason
    group = warm.extra["worker_group"]
    assert group["trials_before"] == 2 and group["id"] == first.extra["worker_group"]["id"]
    assert tp2.extra["worker_group"]["id"] == group["id"]
    assert "worker_group" not in cold.extra and "imported" in cold.extra["timing"]
    assert "imported" not in warm.extra["timing"]  # no imports, no process group of its own
    assert len(warm.losses) == len(cold.losses) == 4
    assert max(abs(a - b) for a, b in zip(warm.losses, cold.losses)) <= 1e-6, (warm.losses,
                                                                             cold.losses)


def test_small_trial_after_a_large_one_reports_its_own_peak(ray_session):
    """The same small trial before and after a large one on one warm group: the same peak. (A cold
    trial's process differs from a warm worker in what else it imported, so the small trial's own
    first run on the group is the reference.)"""
    small = ["world_size=1", "zero_stage=0", "micro_batch=1"]
    large = ["world_size=1", "zero_stage=0", "micro_batch=64"]
    with warm_pool(True, uuid.uuid4().hex[:8]) as pool:
        before = _warm(pool, small)
        big = _warm(pool, large)
        after = _warm(pool, small)
    assert after.extra["worker_group"]["trials_before"] == 2
    assert after.extra["worker_group"]["id"] == before.extra["worker_group"]["id"]
    assert big.peak_memory_gib > before.peak_memory_gib + 0.2, (big.peak_memory_gib,
                                                               before.peak_memory_gib)
    # its own peak: the large trial's memory went back to the OS and the counter restarted
    assert abs(after.peak_memory_gib - before.peak_memory_gib) < 0.05 * before.peak_memory_gib, (
        before.peak_memory_gib, big.peak_memory_gib, after.peak_memory_gib)


def _sweep(tmp_path, monkeypatch, name: str, extra: str, fault: str | None = None,
           model: str = "llama2-tiny"):
    spec_path = tmp_path / f"{name}.yaml"
    spec_path.write_text(f"""
name: {name}
model: {model}
hardware: cpu-local
world_size: 1
precision: fp32
steps: {{warmup: 1, measure: 3, profile: 0}}
tracking: {{mlflow_uri: "sqlite:///{tmp_path / 'mlflow.db'}"}}
{extra}
""")
    if fault:
        monkeypatch.setenv(FAULT_ENV, fault)
    spec = load_spec(spec_path)
    outcome = run_sweep(spec, plan_study(spec), spec_path.read_text(), max_concurrent=1,
                        results_root=tmp_path / "results", show_progress=False)
    monkeypatch.delenv(FAULT_ENV, raising=False)
    return outcome


@pytest.mark.slow
def test_failing_trial_takes_its_group_down_and_the_next_starts_fresh(ray_session, tmp_path,
                                                                      monkeypatch):
    outcome = _sweep(tmp_path, monkeypatch, "warmfail", "micro_batch: [1, 2, 4]",
                     fault="ws1-tp1-z0-mb2@1")
    by_mb = {r.micro_batch: r for r in outcome.results}
    assert by_mb[2].status is Status.failed and "injected fault" in by_mb[2].reason
    before, after = by_mb[1], by_mb[4]
    assert before.status is Status.completed and after.status is Status.completed
    # the group the failed trial borrowed (the first trial's) is gone: a fresh one, first trial
    assert after.extra["worker_group"]["trials_before"] == 0
    assert after.extra["worker_group"]["id"] != before.extra["worker_group"]["id"]
    rows = Ledger(outcome.ledger).rows()
    assert sorted(r["micro_batch"] for r in rows) == [1, 2, 4] and all(r["mlflow_run_id"]
                                                                       for r in rows)
    for _ in range(50):  # the sweep's pool (and with it every group) is gone once it ends
        if not [a for a in ray.util.list_named_actors() if a.startswith("scalestudy-warm-")]:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"warm pool outlived its sweep: {ray.util.list_named_actors()}")


@pytest.mark.slow
def test_reuse_false_starts_every_trial_cold(ray_session, tmp_path, monkeypatch):
    outcome = _sweep(tmp_path, monkeypatch, "cold", "zero_stage: [0, 1]\nworkers: {reuse: false}")
    assert [r.status for r in outcome.results] == [Status.completed] * 2
    for r in outcome.results:
        assert "worker_group" not in r.extra
        assert {"imported", "process_group"} <= set(r.extra["timing"])  # a process of its own


@pytest.mark.slow
def test_trial_past_its_limit_ends_its_group_and_the_next_trial_runs(ray_session, tmp_path,
                                                                     monkeypatch):
    """Every trial warm, so Tune reuses one trainable actor for all of them: the first trial (a
    wider model at 16k tokens a step: 55 s alone on the 2-core development machine) runs past
    placement_timeout_s + trial_timeout_s (25 s); its group is killed, and the next trial, in the same trainable actor, starts
    a fresh group and completes."""
    outcome = _sweep(tmp_path, monkeypatch, "warmlimit",
                     "seq_len: 512\nmicro_batch: 32\ntrial_timeout_s: 18\nplacement_timeout_s: 7",
                     model="[llama2-small, llama2-tiny]")
    by_model = {r.model: r for r in outcome.results}
    slow, quick = by_model["llama2-small"], by_model["llama2-tiny"]
    assert slow.status is Status.timeout, (slow.status, slow.reason)
    assert "exceeded placement_timeout_s + trial_timeout_s" in slow.reason, slow.reason
    assert quick.status is Status.completed, (quick.status, quick.reason)
    assert quick.extra["worker_group"]["trials_before"] == 0  # a fresh group, not the killed one
    print(f"\nquick trial {quick.wall_time_s:.1f} s of its 25; the slow one stopped at "
          f"{slow.wall_time_s:.1f} s")
    assert sorted(r["model"] for r in Ledger(outcome.ledger).rows()) == ["llama2-small",
                                                                         "llama2-tiny"]


WS2 = ["world_size=2", "zero_stage=0"]
# Rank 1's address space is capped at what it maps after a first trial plus this: the second trial,
# at micro-batch 256, needs a 268 MB logits tensor in its first forward (256 x 128 tokens x 2,048
# vocabulary x 4 bytes), so torch's allocator fails there, in that rank only, mid-trial (rank 0,
# uncapped, allocates it and waits in the gradient all-reduce for a rank that is gone).
OOM_HEADROOM_BYTES = 128 << 20
OOM_MICRO_BATCH = 256


def _groups(pool: str) -> list[dict]:
    return ray.get(ray.get_actor(pool).describe.remote())


def _alive(pid: int) -> bool:
    """Running (not a zombie a killed process leaves until it is reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _held_placement_groups() -> int:
    return sum(pg["state"] in ("CREATED", "PENDING", "RESCHEDULING")
               for pg in ray.util.placement_group_table().values())


def _wait_for(predicate, what: str, limit_s: float = 60) -> None:
    deadline = time.time() + limit_s  # a guard against a hang, not a timing assertion
    while not predicate():
        assert time.time() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def _cap_address_space(pid: int, headroom_bytes: int) -> None:
    mapped = int(re.search(r"VmSize:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) << 10
    _, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    resource.prlimit(pid, resource.RLIMIT_AS, (mapped + headroom_bytes, hard))


def _same_as_cold(warm, cold) -> None:
    assert warm.status is Status.completed, warm.reason
    assert len(warm.losses) == len(cold.losses) == 4
    assert max(abs(a - b) for a, b in zip(warm.losses, cold.losses)) <= 1e-6, (warm.losses, cold.losses)


@pytest.mark.slow
def test_oom_and_a_killed_worker_in_the_second_of_three_trials(ray_session, ray_storage):
    """Two triples on one warm group each: a trial, a faulty one, a trial. The faulty one fails with
    its cause, its group goes (no process of it left, its placement group removed) and the third
    trains as a cold run does on a fresh group."""
    pgs_before = _held_placement_groups()
    cold = run_trial(trial(BASE + WS2), ray_storage)
    assert cold.status is Status.completed, cold.reason
    with warm_pool(True, uuid.uuid4().hex[:8]) as pool:
        first = _warm(pool, WS2)
        (group,) = _groups(pool)
        assert first.status is Status.completed and group["id"] == first.extra["worker_group"]["id"]
        _cap_address_space(group["pids"][1], OOM_HEADROOM_BYTES)  # an OOM in rank 1 only
        oom = _warm(pool, WS2 + [f"micro_batch={OOM_MICRO_BATCH}"])
        assert oom.status is Status.failed and "can't allocate memory" in oom.reason, oom.reason
        third = _warm(pool, WS2)
        _same_as_cold(third, cold)
        assert third.extra["worker_group"]["trials_before"] == 0  # a fresh group, not the OOM's
        _wait_for(lambda: not any(map(_alive, group["pids"])), "the OOM group's processes to end")

        (group,) = _groups(pool)  # the third trial's, idle: the first of the next triple
        assert group["id"] == third.extra["worker_group"]["id"] and not group["busy"]
        victim = WarmRun(pool, trial(BASE + WS2 + ["steps={warmup: 1, measure: 50, profile: 0}"]))
        box = {}
        runner = threading.Thread(target=lambda: box.update(r=victim.run(time.time())))
        runner.start()
        _wait_for(lambda: any(g["busy"] and g["trials"] == 2 for g in _groups(pool)),
                  "the second trial to take the group")
        os.kill(group["pids"][1], signal.SIGKILL)  # rank 1's process, mid-trial
        runner.join(120)
        killed = box["r"]
        assert killed.status is Status.failed and "died" in killed.reason.lower(), killed.reason
        last = _warm(pool, WS2)
        _same_as_cold(last, cold)
        assert last.extra["worker_group"]["trials_before"] == 0
        _wait_for(lambda: not any(map(_alive, group["pids"])), "the killed group's processes to end")
        (idle,) = _groups(pool)  # nothing else allocated, nothing busy: the last trial's, idle
        assert idle["id"] == last.extra["worker_group"]["id"] and not idle["busy"]
        _wait_for(lambda: _held_placement_groups() == pgs_before + 1, "one placement group held")
        kept = idle["pids"]
    _wait_for(lambda: _held_placement_groups() == pgs_before, "every placement group removed")
    _wait_for(lambda: not any(map(_alive, kept)), "the pool's last group to end with the pool")


@pytest.mark.slow
def test_timeout_while_its_group_starts_leaves_nothing_busy_or_allocated(ray_session):
    """A trial abandoned at its limit (what the trainable does on timeout) while its new group's
    workers are still starting: the group goes then and there, the trial's acquire fails, nothing
    stays busy or allocated, and the next trial of the same shape starts a fresh group."""
    pgs_before, cpus = _held_placement_groups(), ray.cluster_resources()["CPU"]
    with warm_pool(True, uuid.uuid4().hex[:8]) as pool:
        run = WarmRun(pool, trial(BASE + WS2))
        box = {}
        runner = threading.Thread(target=lambda: box.update(r=run.run(time.time())))
        runner.start()
        _wait_for(lambda: any(g["state"] == "starting" for g in _groups(pool)),
                  "the group's workers to be starting")
        run.abandon()
        runner.join(120)
        assert box["r"].status is Status.failed and box["r"].reason.startswith("abandoned"), box["r"].reason
        assert _groups(pool) == []
        _wait_for(lambda: _held_placement_groups() == pgs_before, "its placement group removed")
        _wait_for(lambda: ray.available_resources().get("CPU", 0) == cpus, "its workers' CPUs back")
        after = _warm(pool, WS2)
        assert after.status is Status.completed, after.reason
        assert after.extra["worker_group"]["trials_before"] == 0
