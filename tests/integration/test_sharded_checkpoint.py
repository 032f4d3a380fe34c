"""Sharded checkpoints in an object store (an S3-compatible server on 127.0.0.1): each rank reads
back only its own shard, and a ZeRO-3 trial that changes world size is re-partitioned exactly.

Real DeepSpeed ZeRO-3 ranks under torchrun (the trial body's local adapter, no Ray), saving to and
restoring from `s3://` through pyarrow, as Ray Train's storage does on a cluster. Each run that
resumes records, per rank, the bytes it read of the checkpoint and the bytes of the files it wrote
at the save (train/resume.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from scalestudy.metrics import Status, TrialResult
from scalestudy.train.checkpoint_store import METADATA_BYTES
from tests.conftest import QUICKSTART, REPO
from tests.s3_server import s3_server

pytestmark = pytest.mark.slow

BUCKET = "ckpt"
SETS = ["zero_stage=3", "precision=fp32", "micro_batch=2", "global_batch=4",
        "steps={warmup: 1, measure: 4, profile: 0}"]
FAULT = "fault_tolerance={max_failures: 1, checkpoint_every: 2}"
ELASTIC = ["fault_tolerance={max_failures: 1, checkpoint_every: 1}",
           "elastic={min_workers: 1, max_workers: 2, resize_check_s: 3600}"]


def _run(nproc: int, uri: str, sets: list[str], tmp_path) -> TrialResult:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), "-m", "scalestudy.train.local", str(QUICKSTART),
           *(f"--set={s}" for s in [f"world_size={nproc}", *SETS, *sets]),
           "--checkpoint-dir", uri, "--json", "--no-instrument"]
    env = {**os.environ, "SCALESTUDY_STAGING_DIR": str(tmp_path / "staging")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    result = TrialResult.model_validate_json(proc.stdout.strip().splitlines()[-1])
    assert result.status is Status.completed, result.reason
    return result


def _sizes(endpoint: str, prefix: str) -> dict[str, int]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"]: o["Size"] for p in pages for o in p.get("Contents", [])}


def test_restore_reads_only_its_own_shard(tmp_path):
    with s3_server(BUCKET) as endpoint:
        uri = f"s3://{BUCKET}/same"
        first = _run(2, uri, [FAULT], tmp_path)
        again = _run(2, uri, [FAULT], tmp_path)  # resumes from the last checkpoint (step 4)
        sizes = _sizes(endpoint, "same/step-00000004/")
    (restore,) = again.extra["checkpoint_restores"]
    assert restore["from_world_size"] == restore["world_size"] == 2
    metadata = sum(v for v in sizes.values() if v <= METADATA_BYTES)
    shards = sorted(v for v in sizes.values() if v > METADATA_BYTES)
    assert len(shards) == 2  # one optimizer partition per rank; everything else is metadata
    for read, own in zip(restore["read_bytes"], restore["shard_bytes"]):
        assert abs(read - own) <= metadata, (restore, sizes)
        assert read <= max(shards) + metadata < sum(shards)  # never the other rank's partition
    # The resumed run trains on from the saved state: its last step's loss is the first run's.
    assert again.restarts == 1 and abs(again.losses[-1] - first.losses[-1]) <= 1e-6
    print(f"\nrestore per rank: read {restore['read_bytes']} B, own shard {restore['shard_bytes']} B, "
          f"checkpoint {sum(sizes.values())} B ({metadata} B metadata)")


def test_zero3_resize_repartitions_without_the_full_state(tmp_path):
    """1 -> 2 -> 1 ranks: each resumed run's first step has the loss of the run it resumed from,
    which only an exact re-partition of weights and Adam moments gives (the global batch is kept:
    micro-batch 2 x grad-accum 2 at one rank, x dp 2 at two)."""
    with s3_server(BUCKET) as endpoint:
        uri = f"s3://{BUCKET}/elastic"
        one = _run(1, uri, ELASTIC, tmp_path)
        two = _run(2, uri, ELASTIC, tmp_path)
        back = _run(1, uri, ELASTIC, tmp_path)
        files = _sizes(endpoint, "elastic/")
    grow, shrink = two.extra["checkpoint_restores"][-1], back.extra["checkpoint_restores"][-1]
    assert (grow["from_world_size"], grow["world_size"]) == (1, 2)
    assert (shrink["from_world_size"], shrink["world_size"]) == (2, 1)
    resumed_at = len(one.losses) - 1  # one saved after every step but its last
    assert abs(two.losses[resumed_at] - one.losses[resumed_at]) <= 1e-6, (one.losses, two.losses)
    at = len(two.losses) - 1
    assert abs(back.losses[at] - two.losses[at]) <= 1e-6, (two.losses, back.losses)
    # Growing, each new rank reads the one old partition file (memory-mapped: it copies out only
    # its half); shrinking, the one rank reads both old partitions (its new one is all of them).
    # `back` saved step 6 at one rank; `two` step 5 at two ranks (the one `back` resumed from).
    def optim(step: int) -> list[int]:
        return [v for k, v in files.items()
                if k.startswith(f"elastic/step-{step:08d}/") and k.endswith("optim_states.pt")]

    slack = sum(v for k, v in files.items()
                if k.startswith("elastic/step-00000005/") and v <= METADATA_BYTES)
    (whole,), halves = optim(6), optim(5)
    assert len(halves) == 2
    assert all(abs(r - whole) <= slack for r in grow["read_bytes"]), (grow, whole)
    assert abs(shrink["read_bytes"][0] - sum(halves)) <= slack, (shrink, halves)
    print("\n" + json.dumps({"grow": grow, "shrink": shrink}))
