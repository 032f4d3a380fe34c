"""The report of a real quick-start sweep: written, self-contained, logged to MLflow, and loading
in headless Chromium without console errors and with something on screen.

Chromium is Debian's `chromium` package (a test prerequisite, installed by .ci/run); where it is
absent the browser tests skip and say so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).parents[2]
SPEC = REPO / "experiments" / "quickstart.yaml"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--enable-logging=stderr", "--v=0"]
# Chromium logs every console message (console.error, uncaught exceptions) as INFO:CONSOLE.
CONSOLE_LINE = re.compile(r":CONSOLE[:(]\d*\)?\]? ?(.*)")
EMBEDDED_PNG = 'src="data:image/png;base64,'


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


needs_chromium = pytest.mark.skipif(
    chromium_binary() is None,
    reason="headless Chromium not installed (Debian: apt-get install -y chromium); "
           "the report's browser checks did not run")


def run_chromium(page: Path, tmp: Path, *args: str) -> tuple[str, list[str]]:
    """(stdout, console messages) of one headless load of a local page."""
    proc = subprocess.run(
        [chromium_binary(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'profile'}", *args,
         page.as_uri()],
        capture_output=True, text=True, timeout=90)
    console = [m.group(1) for line in proc.stderr.splitlines()
               if (m := CONSOLE_LINE.search(line))]
    return proc.stdout, console


@pytest.fixture(scope="module")
def quickstart(request):
    """(ledger path, results) of the session's real quick-start sweep (tests/conftest.py)."""
    try:
        ledger = Path(request.getfixturevalue("quickstart_ledger"))
        results = request.getfixturevalue("quickstart_results")
    except pytest.FixtureLookupError:
        pytest.skip("tests/conftest.py provides no quickstart_ledger / quickstart_results fixture")
    return ledger, results


@pytest.fixture(scope="module")
def tracked(quickstart, tmp_path_factory):
    """A private MLflow store holding the sweep as the sweep writes it (parent + child runs)."""
    from scalestudy.track.mlflow_writer import MlflowWriter

    _, results = quickstart
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    writer = MlflowWriter(uri, "quickstart")
    parent = writer.create_parent("test-sweep", "sweep-test")
    writer.client.log_text(parent, SPEC.read_text(), "spec.yaml")  # as start_sweep does
    for r in results:
        writer.log_trial(r, parent, r.trial_id, r.trial_id)
    return uri, parent


@pytest.fixture(scope="module")
def report(quickstart, tracked, tmp_path_factory):
    from scalestudy_analysis.report import report_study

    ledger, _ = quickstart
    uri, _ = tracked
    out = tmp_path_factory.mktemp("report")
    return report_study(ledger.parent.name, out, results_root=ledger.parent.parent,
                        tracking_uri=uri, spec_path=SPEC)


def test_report_is_self_contained_with_figures(report, quickstart):
    _, results = quickstart
    text = report.path.read_text()
    assert report.path.name == "report.html"
    n_figures = text.count(EMBEDDED_PNG)
    assert n_figures >= 6 and n_figures == report.figures_drawn == len(report.pngs)
    assert all(p.stat().st_size > 1000 for p in report.pngs)
    assert not re.search(r'(src|href)="(https?:)?//', text)  # nothing fetched from elsewhere
    table = text[text.index('<table id="results">'):]
    table = table[:table.index("</table>")]
    assert table.count("<tr>") - 1 >= len(results)  # header row + one row per trial (or more:
    # the predicted twins of the measured trials)
    assert f"<h1>Study {results[0].study}</h1>" in text
    assert "name: quickstart" in text  # the spec
    assert "matplotlib" in text and "pandas" in text  # software versions


def test_report_sentences_come_from_the_data(report, quickstart):
    _, results = quickstart
    by_name = {p.name: p for p in report.panels}
    overview = by_name["trial_overview"]
    assert overview.sentences[0].startswith(f"{len(results)} measured trials")
    assert all(len(p.sentences) == 2 for p in report.panels if p.drawn)


def test_a_cpu_study_has_no_gpu_panel_and_names_its_host(report):
    """Issue 31: the quick-start runs on CPU cores; no drawn panel is titled or labelled with GPU,
    the power panels are left out with their one-line reason, and the host's CPU is named."""
    from scalestudy_analysis.host import cpu_model

    for panel in (p for p in report.panels if p.drawn):
        fig = panel.figure
        texts = [panel.title, fig._suptitle.get_text() if fig._suptitle else ""]
        for ax in fig.axes:
            texts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
            legend = ax.get_legend()
            texts += [t.get_text() for t in (legend.get_texts() if legend else [])]
        assert not [t for t in texts if "GPU" in t], (panel.name, texts)
    left = {p.name: p.note for p in report.panels if not p.drawn}
    assert "is a CPU profile" in left["power_scaling"], left
    text = report.path.read_text()
    assert f"<td>cpu</td><td>{cpu_model()}</td>" in text
    assert "MFU and HFU, in every figure and the table, are relative to one peak" in text


def test_report_logged_to_the_parent_run(report, tracked):
    from mlflow.tracking import MlflowClient

    uri, parent = tracked
    assert report.mlflow_run_id == parent
    names = {Path(a.path).name for a in MlflowClient(uri).list_artifacts(parent, "report")}
    assert "report.html" in names and len(names) == 1 + len(report.pngs)


def test_mlflow_loader_matches_the_ledger(quickstart, tracked):
    from scalestudy_analysis.load import load_ledger, load_mlflow

    ledger, _ = quickstart
    uri, _ = tracked
    a = load_ledger(ledger).sort_values("trial_id").reset_index(drop=True)
    b = load_mlflow("quickstart", uri, artifacts=True).sort_values("trial_id").reset_index(drop=True)
    assert b["trial_id"].tolist() == a["trial_id"].tolist()
    for col in ("status", "world_size", "zero_stage", "backend"):
        assert b[col].tolist() == a[col].tolist(), col
    np.testing.assert_allclose(b["tokens_per_s"], a["tokens_per_s"], rtol=1e-9)
    assert [len(v) for v in b["step_times_s"]] == [len(v) for v in a["step_times_s"]]


@needs_chromium
def test_console_capture_sees_errors(tmp_path):
    """The check below is only as good as its capture: a broken page must be caught."""
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>console.error('boom'); missingFn();</script></body></html>")
    _, console = run_chromium(page, tmp_path, "--dump-dom")
    assert any("boom" in m for m in console) and any("missingFn" in m for m in console), console


@needs_chromium
def test_report_loads_in_chromium_without_console_errors(report, tmp_path):
    dom, console = run_chromium(report.path, tmp_path, "--dump-dom")
    assert console == []
    assert 'data-table-ready="1"' in dom  # the table script ran to its end


@needs_chromium
def test_table_sorts_on_click(report, tmp_path):
    """Click the tokens/s-per-device header twice in a copy of the page: descending order."""
    probe = """<script>
    var t=document.getElementById('results'), h=t.tHead.rows[0].cells, col=-1;
    for(var i=0;i<h.length;i++){ if(h[i].textContent==='tokens_per_s_per_device'){col=i;} }
    h[col].click(); h[col].click();
    var v=Array.prototype.map.call(t.tBodies[0].rows, function(r){
      return r.cells[col].getAttribute('data-v');});
    document.body.setAttribute('data-sorted', v.join(','));
    </script></body>"""
    page = tmp_path / "probe.html"
    page.write_text(report.path.read_text().replace("</body>", probe))
    dom, console = run_chromium(page, tmp_path, "--dump-dom")
    assert console == []
    found = re.search(r'data-sorted="([^"]*)"', dom)
    assert found, "probe did not run"
    values = [float(v) for v in found.group(1).split(",") if v]
    assert len(values) >= 2 and values == sorted(values, reverse=True)


@needs_chromium
def test_report_screenshot_is_not_blank(report, tmp_path):
    import matplotlib.image as mpimg

    shot = tmp_path / "shot.png"
    run_chromium(report.path, tmp_path, f"--screenshot={shot}", "--window-size=1280,1600",
                 "--hide-scrollbars")
    assert shot.exists(), "chromium wrote no screenshot"
    pixels = mpimg.imread(shot)[..., :3].reshape(-1, 3)
    background = np.all(pixels == pixels[0], axis=1)
    assert background.mean() < 0.98, "screenshot is (almost) one colour"
    assert len(np.unique((pixels * 255).astype(np.uint8), axis=0)) > 50  # text and plots


def test_cli_report_prints_the_path(quickstart, tracked, tmp_path, monkeypatch):
    """From a directory without experiments/: the spec comes from the sweep's parent run."""
    from typer.testing import CliRunner

    from scalestudy.cli import app

    ledger, _ = quickstart
    study = ledger.parent.name
    work = tmp_path / "work"
    (work / "results" / study).mkdir(parents=True)
    shutil.copy(ledger, work / "results" / study / ledger.name)
    monkeypatch.chdir(work)
    uri, parent = tracked
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    res = CliRunner().invoke(app, ["report", study, "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[-1] == str(tmp_path / "out" / "report.html")
    text = (tmp_path / "out" / "report.html").read_text()
    assert f"spec.yaml of MLflow run {parent}" in text and "name: quickstart" in text


def test_report_finds_the_experiment_the_ledger_recorded(quickstart, tmp_path, monkeypatch):
    """A study whose MLflow experiment is not its name (experiments/paper/*.yaml log to
    paper-<study>), reported from a directory without its spec: the ledger's `experiment` column
    leads to the sweep's parent run, which gets the report and gives the spec."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from mlflow.tracking import MlflowClient

    from scalestudy.track.mlflow_writer import MlflowWriter
    from scalestudy_analysis.report import report_study

    ledger, _ = quickstart
    study, experiment = ledger.parent.name, "renamed-experiment"
    table = pq.read_table(ledger)
    i = table.schema.get_field_index("experiment")
    table = table.set_column(i, table.schema.field(i), pa.array([experiment] * table.num_rows,
                                                               table.schema.field(i).type))
    root = tmp_path / "results"
    (root / study).mkdir(parents=True)
    pq.write_table(table, root / study / ledger.name)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    writer = MlflowWriter(uri, experiment)
    parent = writer.create_parent("renamed-sweep", "sweep-renamed")
    writer.client.log_text(parent, SPEC.read_text(), "spec.yaml")
    monkeypatch.chdir(tmp_path)  # no experiments/ here: find_spec finds nothing
    rep = report_study(study, tmp_path / "out", results_root=root, tracking_uri=uri)
    assert rep.mlflow_run_id == parent, rep.notes
    assert not any("no parent MLflow run" in n for n in rep.notes)
    names = {Path(a.path).name for a in MlflowClient(uri).list_artifacts(parent, "report")}
    assert "report.html" in names
    assert f"spec.yaml of MLflow run {parent}" in rep.path.read_text()
