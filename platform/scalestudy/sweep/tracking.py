"""The MLflow tracking URI a sweep records to, fixed before the first trial.

A relative SQLite URI (`sqlite:///mlflow.db`, MLflow's own default and the quick start's) names a
file in the current directory. Under `ray job submit` that directory is the job's temporary copy of
its working directory, deleted with the job, so the study's runs would vanish with it; anywhere else
it is the directory the user ran the command in. So: the URI is made absolute here, once, and the
spec the sweep runs (and logs to its parent run) carries that absolute URI; inside a Ray job a
SQLite file under the job's working directory is refused with the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

from scalestudy.errors import SpecError

DEFAULT_URI = "sqlite:///mlflow.db"
# Set by Ray's job supervisor in the environment of a submitted job's entrypoint (Ray 2.60:
# dashboard/modules/job/job_supervisor.py, _get_driver_env_vars).
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
SQLITE = "sqlite:///"


def resolve_tracking_uri(uri: str | None, cwd: Path | None = None,
                         env: dict[str, str] | None = None) -> str:
    """`uri` (else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db) with a SQLite path made absolute;
    SpecError when it would live and die with a Ray job's temporary working directory."""
    env = os.environ if env is None else env
    cwd = (cwd or Path.cwd()).resolve()
    uri = uri or env.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    if not uri.startswith(SQLITE):
        return uri  # a server (http://, databricks), or another store: its own business
    path = Path(uri[len(SQLITE):])
    absolute = path if path.is_absolute() else cwd / path
    if RAY_JOB_ENV in env and absolute.resolve().is_relative_to(cwd):
        raise SpecError(
            "tracking.mlflow_uri", uri,
            f"inside this Ray job it names {absolute}, in the job's temporary working directory, "
            "which Ray deletes with the job; give a tracking server (--tracking-uri "
            "http://<head>:5000) or an absolute SQLite path on storage that outlives the job "
            "(sqlite:////mnt/shared/mlflow.db)")
    return SQLITE + str(absolute)
