"""A sweep's MLflow URI is fixed once, absolute; inside a Ray job a SQLite file in the job's
temporary working directory is refused (Ray deletes that directory with the job)."""

from __future__ import annotations

import pytest

from scalestudy.errors import SpecError
from scalestudy.sweep.tracking import RAY_JOB_ENV, resolve_tracking_uri


def test_relative_sqlite_becomes_absolute(tmp_path):
    assert resolve_tracking_uri("sqlite:///mlflow.db", tmp_path, {}) == f"sqlite:///{tmp_path}/mlflow.db"
    assert resolve_tracking_uri(None, tmp_path, {}) == f"sqlite:///{tmp_path}/mlflow.db"
    env = {"MLFLOW_TRACKING_URI": "sqlite:///sub/x.db"}
    assert resolve_tracking_uri(None, tmp_path, env) == f"sqlite:///{tmp_path}/sub/x.db"
    assert resolve_tracking_uri("sqlite:////abs/m.db", tmp_path, {}) == "sqlite:////abs/m.db"
    assert resolve_tracking_uri("http://head:5000", tmp_path, {}) == "http://head:5000"


def test_inside_a_ray_job_the_working_directory_is_refused(tmp_path):
    job = {RAY_JOB_ENV: "{}"}
    with pytest.raises(SpecError) as err:
        resolve_tracking_uri("sqlite:///mlflow.db", tmp_path, job)
    msg = str(err.value)
    assert "\n" not in msg and "deletes with the job" in msg and "--tracking-uri" in msg
    outside = tmp_path.parent / "kept.db"
    assert resolve_tracking_uri(f"sqlite:///{outside}", tmp_path, job) == f"sqlite:///{outside}"
    assert resolve_tracking_uri("http://head:5000", tmp_path, job) == "http://head:5000"
