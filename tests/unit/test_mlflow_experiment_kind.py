"""Experiments scalestudy creates are marked as model training, so MLflow's UI treats them so.

A real MLflow store (sqlite in a temp dir) through the writer the sweep uses; no server.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from scalestudy.track.mlflow_writer import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    MlflowWriter,
    experiment_ui_url,
)


@pytest.fixture
def uri(tmp_path):
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _kind(uri: str, name: str) -> str | None:
    return MlflowClient(uri).get_experiment_by_name(name).tags.get(EXPERIMENT_KIND_TAG)


def test_new_experiment_is_marked_model_training(uri):
    writer = MlflowWriter(uri, "fresh")
    assert writer.enabled, writer.error
    assert _kind(uri, "fresh") == EXPERIMENT_KIND == "custom_model_development"


def test_existing_experiment_without_the_tag_gets_it(uri):
    MlflowClient(uri).create_experiment("older")  # as a store written before the tag existed
    assert _kind(uri, "older") is None
    MlflowWriter(uri, "older")
    assert _kind(uri, "older") == EXPERIMENT_KIND


def test_a_kind_someone_chose_is_left_alone(uri):
    client = MlflowClient(uri)
    eid = client.create_experiment("chosen")
    client.set_experiment_tag(eid, EXPERIMENT_KIND_TAG, "genai_development")
    writer = MlflowWriter(uri, "chosen")
    assert writer.experiment_id == eid
    assert _kind(uri, "chosen") == "genai_development"


def test_installed_mlflow_ui_knows_the_tag_and_the_link_parameter():
    # The tag and the link's query parameter are MLflow UI internals, not API: if an MLflow upgrade
    # renames them, this fails instead of the UI silently opening on an empty GenAI overview again.
    bundle = "\n".join(p.read_text(errors="ignore") for p in
                       (Path(mlflow.__file__).parent / "server/js/build/static/js").glob("*.js"))
    assert f'"{EXPERIMENT_KIND_TAG}"' in bundle
    assert f'"{EXPERIMENT_KIND}"' in bundle
    assert '"workflowType"' in bundle and '"machine_learning"' in bundle


def test_ui_url_opens_the_runs_of_the_experiment():
    assert (experiment_ui_url("http://127.0.0.1:5000/", "7")
            == "http://127.0.0.1:5000/#/experiments/7?workflowType=machine_learning")
