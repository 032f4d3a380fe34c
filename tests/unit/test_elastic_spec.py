"""An elastic study must be able to shrink: Ray Train shrinks an elastic trial only by restarting it
after a worker is lost, and that restart counts against FailureConfig(max_failures). A spec with
elastic sizes and max_failures 0 (given or by default) is refused at validation, one line."""

from __future__ import annotations

import pytest

from scalestudy.errors import SpecError
from scalestudy.spec.load import validate_spec

BASE = {"name": "e", "model": "llama2-tiny", "hardware": "cpu-local", "world_size": 2,
        "global_batch": 2, "elastic": {"min_workers": 1, "max_workers": 2}}


@pytest.mark.parametrize("fault_tolerance", [None, {"max_failures": 0}, {"checkpoint_every": 4}])
def test_elastic_spec_without_restarts_is_refused(fault_tolerance):
    data = {**BASE, **({"fault_tolerance": fault_tolerance} if fault_tolerance else {})}
    with pytest.raises(SpecError) as err:
        validate_spec(data)
    text = str(err.value)
    assert text.startswith("elastic: ") and "\n" not in text
    assert "fault_tolerance.max_failures (0 here)" in text and "set it to 1 or more" in text


def test_elastic_spec_with_restarts_and_a_fixed_spec_without_pass():
    spec = validate_spec({**BASE, "fault_tolerance": {"max_failures": 1}})
    assert spec.elastic.max_workers == 2 and spec.fault_tolerance.max_failures == 1
    fixed = {k: v for k, v in BASE.items() if k != "elastic"}
    assert validate_spec(fixed).elastic is None  # max_failures 0 is fine without elastic


def test_cli_validate_refuses_it_with_exit_2(tmp_path):
    from typer.testing import CliRunner

    from scalestudy.cli import app

    spec = tmp_path / "e.yaml"
    spec.write_text("name: e\nmodel: llama2-tiny\nhardware: cpu-local\nworld_size: 2\n"
                    "global_batch: 2\nelastic: {min_workers: 1, max_workers: 2}\n")
    res = CliRunner().invoke(app, ["validate", str(spec)], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "fault_tolerance.max_failures" in res.output, res.output
