"""`scalestudy report` on a study nobody ran: one line, exit code 2, no store created."""

from __future__ import annotations

from typer.testing import CliRunner

from scalestudy.cli import app


def test_report_of_unknown_study_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    res = CliRunner().invoke(app, ["report", "nosuchstudy"])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1, res.output
    assert lines[0].startswith("error: study: invalid value 'nosuchstudy': no ledger at ")
    assert "scalestudy sweep" in lines[0]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "reports").exists()
