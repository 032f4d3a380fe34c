"""Elastic shrink: an elastic (1, 2) trial over two one-device nodes loses a node mid-window and
finishes on the remaining one at the same global batch; its throughput is the final segment's.

The head holds no CPUs; each worker node is `ray start` in its own process group with one
device-like custom resource (fake_nodes.py), and the node is removed by killing that group."""

from __future__ import annotations

import subprocess
import time

import pytest

from scalestudy.metrics import Status, TrialResult
from tests.integration.fake_nodes import PROFILE, worker_nodes
from tests.integration.local_cluster import BIN, alive_nodes, leftover_processes, local_head

pytestmark = pytest.mark.slow

NODE = {"CPU": 1, "fake_single": 1, "accelerator_type:fake-A": 1}
# Long enough that the node's loss lands inside the timed window: with 60 steps of ~0.03 s and a
# checkpoint every 5, the clean-clone run of 2026-12-04 finished all 60 steps at world 2 before the
# loss was noticed (restarts 0). 400 steps leave ~10 s after the second checkpoint (step 40).
MEASURE = 400
STUDY = f"""
name: shrink
model: llama2-tiny
hardware: shrink-hw.yaml
world_size: 2
micro_batch: 1
global_batch: 2
elastic: {{min_workers: 1, max_workers: 2, resize_check_s: 3600}}
fault_tolerance: {{max_failures: 2, checkpoint_every: 20}}
steps: {{warmup: 2, measure: {MEASURE}, profile: 0}}
tracking: {{mlflow_uri: null}}
"""


def test_elastic_shrink_node_lost_mid_trial(tmp_path):
    (tmp_path / "shrink-hw.yaml").write_text(PROFILE.format(
        devices_per_node=1, accelerator_type="fake-A", device_resource="fake_single"))
    spec = tmp_path / "shrink.yaml"
    spec.write_text(STUDY)
    with local_head(num_cpus=0) as head, worker_nodes(head, [NODE, NODE], tmp_path) as nodes:
        # A restart that still counts the lost node waits this long for it, then retries smaller.
        env = {**head.env, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20"}
        run = subprocess.Popen([str(BIN / "scalestudy"), "run", str(spec), "--json"], cwd=tmp_path,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.time() + 400
            # Two checkpoints on storage: the first is registered with Ray Train (see test_faults).
            while len(list((tmp_path / "results").rglob("loop_state.json"))) < 2:
                assert run.poll() is None and time.time() < deadline, "trial never checkpointed"
                time.sleep(0.5)
            removed_at = time.time()
            nodes[1].remove()
            out, _ = run.communicate(timeout=600)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        recovered_s = time.time() - removed_at
        left = alive_nodes(head)
    assert leftover_processes(head) == []
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, out[-4000:]
    r = TrialResult.model_validate_json(lines[-1])
    assert r.status is Status.completed, r.reason
    assert left == 2  # the head and the node that stayed
    assert r.extra["final_world_size"] == 1 and r.extra["final_grad_accum"] == 2
    assert r.global_batch == 2 and r.restarts >= 1
    assert [s["world_size"] for s in r.resizes] == [2, 1], r.resizes
    assert [s["grad_accum"] for s in r.resizes] == [1, 2]
    assert sum(s["steps"] for s in r.resizes) == len(r.step_times_s) == MEASURE
    assert r.resizes[1]["warmup_steps"] == 2 and r.resizes[1]["steps"] >= 1
    assert r.tokens_per_s == r.resizes[-1]["tokens_per_s"] == 2 * 128 / r.step_time_s
    assert r.tokens_per_s_per_device == r.tokens_per_s  # one device left
    print(f"\nsegments {[(s['world_size'], s['steps'], s['step_time_median_s']) for s in r.resizes]}"
          f"; recovered {recovered_s:.1f} s after the node was removed, time lost "
          f"{r.time_lost_s:.1f} s")
