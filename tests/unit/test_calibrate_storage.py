"""Every storage path `scalestudy calibrate` gives Ray Train comes from the results root (the
across-nodes step's and the Ray calibration's), never a temporary folder of the driver's machine:
on a cluster whose nodes do not share the head's disk, a worker's report written there is lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from scalestudy.calibrate import across_nodes, run
from scalestudy.spec import catalog
from scalestudy.track.storage import RESULTS_ROOT_ENV


@pytest.fixture
def captured(monkeypatch):
    """Ray Train's storage keywords of each run_group call, in order (nothing runs)."""
    seen: list[dict] = []

    def fake_run_group(loop, config, scaling, storage, name, filename, backend="gloo"):
        seen.append(storage)
        return {"world_size": scaling["num_workers"], "node_ids": ["a", "b"], "comm": {}}

    monkeypatch.setattr(run, "run_group", fake_run_group)
    monkeypatch.setattr(across_nodes, "check_cluster", lambda hw, nodes: None)
    return seen


def test_across_nodes_storage_is_the_object_store_root(captured, monkeypatch):
    monkeypatch.setenv(RESULTS_ROOT_ENV, "s3://bucket/scalestudy")
    across_nodes.measure(catalog.get_hardware("a100-80gb"), 2)
    assert captured == [{"storage_path": "s3://bucket/scalestudy/calibrate/ray",
                         "storage_filesystem": None}]


def test_across_nodes_storage_is_an_explicit_shared_root(captured, tmp_path):
    shared = tmp_path / "mnt-shared" / "results"
    across_nodes.measure(catalog.get_hardware("cpu-local"), 2, results_root=shared)
    (storage,) = captured
    assert Path(storage["storage_path"]) == (shared / "calibrate" / "ray").resolve()


def test_ray_calibration_storage_is_under_the_results_root(captured, monkeypatch, tmp_path):
    """The device calibration on a Ray cluster (`scalestudy calibrate` without --local)."""
    import ray

    from scalestudy.launch import ray_train

    monkeypatch.setattr(ray_train, "ensure_ray", lambda *a, **k: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(run, "build_profile", lambda base, alone, shared: base)
    monkeypatch.setenv(RESULTS_ROOT_ENV, str(tmp_path / "root"))
    run.calibrate(catalog.get_hardware("cpu-local"), quick=True)
    expected = str((tmp_path / "root" / "calibrate" / "ray").resolve())
    assert [s["storage_path"] for s in captured] == [expected, expected]  # alone, then shared


def test_default_root_is_the_one_every_command_takes(monkeypatch):
    monkeypatch.delenv(RESULTS_ROOT_ENV, raising=False)
    assert run.calibration_storage()["storage_path"] == str(Path("results/calibrate/ray").resolve())
    monkeypatch.setenv(RESULTS_ROOT_ENV, "gs://b/x")
    assert run.calibration_storage()["storage_path"] == "gs://b/x/calibrate/ray"
