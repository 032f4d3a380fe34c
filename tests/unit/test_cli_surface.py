"""One CLI: every sub-command takes the shared options where they apply, tables never split a
number, `validate --json` prints the plan, `--version` answers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from scalestudy import __version__, tables
from scalestudy.cli import app

REPO = Path(__file__).parents[2]
SPECS = sorted(p for p in (REPO / "experiments").rglob("*.yaml") if p.name != "TEMPLATE.yaml")

# Which shared options each command must take: --json where it prints results, --results-root
# where results (ledgers, profiles, checkpoints) are read or written, --tracking-uri where MLflow is.
COMMANDS = {
    "validate": {"--json", "--set", "--sort", "--top", "--columns"},
    "predict": {"--json", "--set", "--sort", "--top", "--columns"},
    "run": {"--json", "--set", "--results-root"},
    "sweep": {"--json", "--set", "--results-root", "--tracking-uri", "--sort", "--top", "--columns"},
    "report": {"--json", "--results-root", "--tracking-uri"},
    "sync-mlflow": {"--json", "--results-root", "--tracking-uri"},
    "calibrate": {"--json", "--results-root"},
    "fit": {"--json", "--results-root"},
    "plan": {"--json", "--hardware", "--devices", "--objective", "--space", "--top-k", "--dry-run",
             "--mem-cap", "--global-batch", "--seq-len", "--precision"},
}


def _help(*args: str) -> str:
    res = CliRunner().invoke(app, [*args, "--help"], terminal_width=200)
    assert res.exit_code == 0, res.output
    return res.output


def test_every_command_is_checked_and_takes_its_shared_options():
    top = _help()
    listed = set(re.findall(r"│ ([a-z][a-z-]+) ", top))
    assert set(COMMANDS) <= listed, listed
    assert listed <= set(COMMANDS), f"a new command needs its row here: {listed}"
    for command, options in COMMANDS.items():
        text = _help(command)
        missing = [o for o in options if o not in text]
        assert not missing, f"{command} lacks {missing}"


def test_version_and_completion():
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"scalestudy {__version__}"
    assert "--install-completion" in _help()


def _split_numbers(text: str, width: int) -> list[str]:
    """Lines that break the table contract: longer than the width (a table line), or a data block
    whose row count differs from what was rendered (a wrapped cell adds a line)."""
    return [ln for ln in text.splitlines() if len(ln) > width and " " in ln.strip()]


@pytest.mark.parametrize("columns", [80, 200])
@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.stem)
def test_predict_tables_never_split_a_number(spec, columns):
    runner = CliRunner()
    res = runner.invoke(app, ["predict", str(spec)], env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    rows = runner.invoke(app, ["predict", str(spec), "--json"]).stdout.strip().splitlines()
    lines = res.stdout.splitlines()  # the table; notes go to stderr (folded: checked below)
    sep = next(i for i, ln in enumerate(lines) if ln and set(ln) <= {"-", " "})
    body = lines[sep + 1:]
    hidden = [i for i, ln in enumerate(body) if ln.startswith("not shown at width")]
    body = body[:hidden[0]] if hidden else body
    assert len(body) == len(rows), "a row took more than one line"
    assert all(len(ln) <= columns for ln in lines[sep - 1:sep + 1 + len(rows)])
    assert not _split_numbers(res.output, columns)


def test_a_number_is_written_whole():
    assert tables.fmt(10350.2) == "10,350" and tables.fmt(0.18771) == "0.1877"
    assert tables.fmt(3.8e12) == "3,800,000,000,000" and tables.fmt(2.5e-7) == "2.500e-07"
    out = tables.render([{"a": 1.0, "b": "x" * 300}, {"a": 10350.2, "b": "y"}], ["a", "b"],
                        width=40)
    assert all(len(ln) <= 40 for ln in out.lines)
    assert "10,350" in out.text


def test_validate_prints_memory_and_verdict_and_json_is_the_plan(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: v\nmodel: llama2-70b\nhardware: a100-40gb\nbackend: simulate\n"
                    "world_size: [8, 64]\nzero_stage: [0, 3]\nmicro_batch: 1\nseq_len: 4096\n"
                    "activation_checkpointing: true\n")
    res = CliRunner().invoke(app, ["validate", str(spec)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "mem_GiB" in res.output and "memory: needs" in res.output
    rows = [json.loads(ln) for ln in
            CliRunner().invoke(app, ["validate", str(spec), "--json"]).output.splitlines()]
    assert len(rows) == 4
    for r in rows:
        assert r["memory"]["total_gib"] > 0 and set(r["memory"]["terms_gib"]) >= {
            "params", "optimizer", "activations"}
        assert r["resources_per_worker"] == {"GPU": 1.0, "CPU": pytest.approx(r[
            "resources_per_worker"]["CPU"])}
        verdict = r["verdict"]
        assert verdict["runnable"] == (r["memory"]["total_gib"] <= r["memory"]["usable_gib"])
        assert verdict["runnable"] or verdict["reason_class"] == "memory"


def test_sort_top_and_columns(tmp_path):
    spec = REPO / "experiments" / "paper" / "fsdp_scaling.yaml"
    res = CliRunner().invoke(app, ["predict", str(spec), "--sort", "tokens_per_s_per_device:desc",
                                   "--top", "2", "--columns", "trial,tokens_per_s_per_device"],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert "first 2 of 9" in lines[0] and lines[-2].startswith("ws8-") and len(lines) == 5
    bad = CliRunner().invoke(app, ["predict", str(spec), "--sort", "nosuch"])
    assert bad.exit_code == 2 and "--sort" in bad.output
