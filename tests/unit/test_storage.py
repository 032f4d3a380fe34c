"""The results-root layer (track/storage.py): local atomic writes, URIs kept as URIs, the ledger on a
filesystem URI (fsspec's in-memory one, and S3 on a moto server), and the one-line refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from scalestudy.errors import SpecError
from scalestudy.metrics import Status, TrialResult
from scalestudy.sweep import shared_storage
from scalestudy.track import storage
from scalestudy.track.ledger import Ledger, ledger_path
from tests.conftest import trial
from tests.s3_server import s3_server


def _result(**kw) -> TrialResult:
    return TrialResult.from_config(trial(["world_size=1", "zero_stage=0", "micro_batch=1"]),
                                   Status.completed, **kw)


def test_local_write_replaces_whole_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "a" / "trials.parquet"
    storage.write_bytes(target, b"first")
    storage.write_bytes(target, b"second")
    assert target.read_bytes() == b"second"
    assert sorted(p.name for p in target.parent.iterdir()) == ["trials.parquet"]


def test_local_write_failing_at_rename_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "trials.parquet"
    storage.write_bytes(target, b"old")

    def boom(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        storage.write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["trials.parquet"]


@pytest.mark.parametrize("root, expected", [
    ("s3://bucket/pre", "s3://bucket/pre/study/trials.parquet"),
    ("s3://bucket/pre/?endpoint_override=127.0.0.1:9000&scheme=http",
     "s3://bucket/pre/study/trials.parquet?endpoint_override=127.0.0.1:9000&scheme=http"),
    ("gs://b", "gs://b/study/trials.parquet"),
    ("memory://x", "memory://x/study/trials.parquet"),
])
def test_uri_roots_stay_uris(root, expected):
    loc = ledger_path("study", root)
    assert loc == expected and isinstance(loc, str)
    # Ray gets a URI pyarrow knows as it is: every node resolves it with its own credentials.
    if not root.startswith("memory"):
        assert storage.ray_storage(loc) == {"storage_path": expected, "storage_filesystem": None}


def test_local_roots_are_paths_and_ray_gets_them_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ledger_path("s", "results") == Path("results/s/trials.parquet")
    assert ledger_path("s", "file:///data/r") == Path("/data/r/s/trials.parquet")
    assert storage.ray_storage("results/s")["storage_path"] == str(tmp_path / "results" / "s")


def test_default_root_from_environment(monkeypatch):
    monkeypatch.delenv(storage.RESULTS_ROOT_ENV, raising=False)
    assert storage.default_results_root() == "results"
    monkeypatch.setenv(storage.RESULTS_ROOT_ENV, "s3://b/p")
    assert storage.default_results_root() == "s3://b/p"


def test_fsspec_only_uri_goes_to_ray_as_a_wrapped_filesystem():
    import pyarrow.fs as pafs

    kw = storage.ray_storage("memory://bucket/study/train")
    assert isinstance(kw["storage_filesystem"], pafs.PyFileSystem)
    assert kw["storage_path"].endswith("bucket/study/train")


def test_ledger_round_trip_on_an_fsspec_uri():
    root = "memory://ledger-test"
    ledger = Ledger(ledger_path("study", root))
    assert not ledger.exists() and ledger.rows() == []
    first = _result(step_time_s=1.0)
    ledger.append(first, mlflow_run_id=None)
    ledger.update(first.trial_id, mlflow_run_id="abc")
    (row,) = Ledger(ledger_path("study", root)).rows()
    assert row["mlflow_run_id"] == "abc" and row["step_time_s"] == 1.0


def test_ledger_round_trip_on_s3():
    import boto3

    with s3_server("results") as endpoint:
        root = "s3://results/prefix"
        ledger = Ledger(ledger_path("s3study", root))
        assert ledger.rows() == []
        result = _result(step_time_s=2.5)
        ledger.append(result)
        ledger.update(result.trial_id, mlflow_run_id="r1")
        (back,) = Ledger(ledger_path("s3study", root)).rows()
        assert back["trial_id"] == result.trial_id and back["step_time_s"] == 2.5
        assert back["mlflow_run_id"] == "r1" and ledger.exists()
        # One object per part (the row, then the patch with the run id), and the export once
        # asked for: no folder markers, no temp objects left behind.
        s3 = boto3.client("s3", endpoint_url=endpoint)
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="results")["Contents"]]
        assert [k.rsplit(".", 2)[-2] for k in keys] == ["rows", "patch"]
        assert all(k.startswith("prefix/s3study/ledger/") for k in keys)
        assert ledger.export() == "s3://results/prefix/s3study/trials.parquet"
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="results")["Contents"]]
        assert len(keys) == 3 and "prefix/s3study/trials.parquet" in keys


def test_private_local_root_refused_in_one_line_with_the_fix(monkeypatch, tmp_path):
    import ray

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}])
    monkeypatch.setattr(shared_storage, "nodes_missing", lambda root: ["10.0.0.7 (abcdef01)"])
    with pytest.raises(SpecError) as err:
        shared_storage.check_checkpoint_storage(tmp_path, checkpointing=True)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--results-root: invalid value")
    assert "10.0.0.7" in msg and "shared mount" in msg and "s3://" in msg
    # No checkpoints, or an object-store root: nothing to check, no Ray call.
    monkeypatch.setattr(ray, "nodes", lambda: pytest.fail("must not ask Ray"))
    shared_storage.check_checkpoint_storage(tmp_path, checkpointing=False)
    shared_storage.check_checkpoint_storage("s3://b/p", checkpointing=True)


def test_fit_with_a_uri_root_and_no_out_is_a_spec_error():
    from scalestudy.cli import app

    res = CliRunner().invoke(app, ["fit", "quickstart", "--results-root", "s3://b/p"])
    assert res.exit_code == 2
    assert "--results-root: invalid value 's3://b/p'" in res.output and "--out" in res.output


def test_every_results_command_takes_the_results_root(monkeypatch):
    from scalestudy.cli import app

    for command in ("run", "sweep", "report", "sync-mlflow", "fit"):
        res = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
        assert "--results-root" in res.output, command
        assert storage.RESULTS_ROOT_ENV in res.output, command
