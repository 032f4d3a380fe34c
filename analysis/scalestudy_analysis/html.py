"""The self-contained HTML report: figures embedded as base64 PNG, a sortable results table (a few
lines of inline JS, no external assets, so the file can be mailed or attached to an MLflow run),
the spec and the software versions."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Iterable
from datetime import datetime, timezone

import pandas as pd

from scalestudy import metrics as M
from scalestudy_analysis.base import cpu_hardware, trial_label
from scalestudy_analysis.figures import Panel

TABLE_COLUMNS = (
    "trial", "source", "status", "model", "hardware", "world_size", "nodes", "dp", "tp", "pp",
    "zero_stage", "micro_batch", "grad_accum", "global_batch", "seq_len", "precision",
    M.STEP_TIME_S, M.TOKENS_PER_S, M.TOKENS_PER_S_PER_DEVICE, M.MFU, M.HFU, M.COMM_EXPOSED_S,
    M.COMM_EXPOSED_FRACTION, M.PEAK_MEMORY_GIB, M.POWER_W, M.POWER_W_ESTIMATED, M.TOKENS_PER_J,
    M.TOKENS_PER_J_ESTIMATED, M.LOSS_FIRST, M.LOSS_LAST, M.WALL_TIME_S, "reason",
)

# Said wherever modelled energy is shown (issue 15): no measurement has validated the power model yet.
MODELLED_ENERGY_NOTE = (
    "energy marked modelled (power_w_estimated, tokens_per_j_estimated and the 'modelled' series) "
    "is the performance model's estimate of the GPUs' own power, modelled, not validated: no "
    "measured trial has been compared with it yet; the rest of each node (CPUs, NICs, fans) is the "
    "separate estimate node_overhead_power_w_estimated")
# The same columns on CPU hardware hold the catalogue's per-core TDP figure, which no figure draws.
CPU_MODELLED_ENERGY_NOTE = (
    "power_w_estimated and tokens_per_j_estimated of {hw} (a CPU profile) in the table are the GPU "
    "power model applied to the profile's typed per-core TDP and idle figures, not a model of this "
    "machine's CPUs and never checked against a meter: no figure draws them")


def modelled_energy_notes(df: pd.DataFrame) -> list[str]:
    """What the modelled energy columns mean, for GPU and for CPU hardware apart."""
    if M.POWER_W_ESTIMATED not in df:
        return []
    rows = df[df[M.POWER_W_ESTIMATED].notna()]
    cpus = cpu_hardware(rows)
    out = [MODELLED_ENERGY_NOTE] if (~rows["hardware"].isin(cpus)).any() else []
    if cpus:
        out.append(CPU_MODELLED_ENERGY_NOTE.format(hw=", ".join(cpus)))
    return out


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;
 max-width:1200px;padding:0 1em;color:#222;background:#fff}
h1{margin-bottom:.2em} .meta{color:#555} figure{margin:1.5em 0;border-top:1px solid #ddd}
figure img{max-width:100%;height:auto} figcaption p{margin:.3em 0}
.skip{color:#777;font-style:italic} pre{background:#f6f6f6;padding:1em;overflow:auto}
table{border-collapse:collapse;font-size:12px} th,td{border:1px solid #ddd;padding:2px 6px}
th{background:#eee;cursor:pointer;position:sticky;top:0} th.asc:after{content:" \\25B2"}
th.desc:after{content:" \\25BC"} td.num{text-align:right;font-variant-numeric:tabular-nums}
.tablewrap{overflow:auto;max-height:80vh}
"""

# Click a header to sort by it (again to reverse). Numbers sort by the raw value kept in data-v,
# so "1.2k"-style display never breaks the order; empty cells sort last either way.
JS = """
(function(){
  var table=document.getElementById('results');
  if(!table){return;}
  var heads=table.tHead.rows[0].cells;
  function key(cell){
    var v=cell.getAttribute('data-v');
    if(v===null||v===''){return null;}
    var n=Number(v);
    return isNaN(n)?v.toLowerCase():n;
  }
  function sortBy(col,asc){
    var body=table.tBodies[0];
    var rows=Array.prototype.slice.call(body.rows);
    rows.sort(function(a,b){
      var x=key(a.cells[col]),y=key(b.cells[col]);
      if(x===null&&y===null){return 0;} if(x===null){return 1;} if(y===null){return -1;}
      if(x<y){return asc?-1:1;} if(x>y){return asc?1:-1;} return 0;
    });
    rows.forEach(function(r){body.appendChild(r);});
    for(var i=0;i<heads.length;i++){heads[i].className='';}
    heads[col].className=asc?'asc':'desc';
  }
  Array.prototype.forEach.call(heads,function(th,i){
    th.addEventListener('click',function(){sortBy(i,th.className!=='asc');});
  });
  document.body.setAttribute('data-table-ready','1');
})();
"""


def _cell(value) -> tuple[str, str, bool]:
    """(display text, raw sort value, is numeric)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "", "", False
    if isinstance(value, bool):
        return str(value), str(value), False
    if isinstance(value, (int, float)):
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text, repr(float(value)), True
    return str(value), str(value), False


def results_table(df: pd.DataFrame) -> str:
    rows = df.copy()
    rows["trial"] = [trial_label(r) for r in rows.to_dict("records")]
    # Columns with no value in any trial only widen the table.
    cols = [c for c in TABLE_COLUMNS if c in rows and rows[c].notna().any()
            and not (rows[c].astype(str) == "").all()]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for rec in rows[cols].to_dict("records"):
        cells = []
        for c in cols:
            text, raw, num = _cell(rec[c])
            cls = ' class="num"' if num else ""
            cells.append(f'<td{cls} data-v="{html.escape(raw)}">{html.escape(text)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="tablewrap"><table id="results"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


def figure_html(panel: Panel) -> str:
    anchor = html.escape(panel.name)
    if not panel.drawn:
        return (f'<figure id="{anchor}"><h3>{html.escape(panel.title)}</h3>'
                f'<p class="skip">Skipped: {html.escape(panel.note or "")}.</p></figure>')
    b64 = base64.b64encode(panel.png()).decode("ascii")
    text = "".join(f"<p>{html.escape(s)}</p>" for s in panel.sentences)
    return (f'<figure id="{anchor}"><h3>{html.escape(panel.title)}</h3>'
            f'<img alt="{html.escape(panel.title)}" src="data:image/png;base64,{b64}">'
            f"<figcaption>{text}</figcaption></figure>")


def key_value_table(pairs: dict[str, str]) -> str:
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
                   for k, v in pairs.items())
    return f"<table><tbody>{rows}</tbody></table>"


def render(study: str, df: pd.DataFrame, panels: Iterable[Panel], *, spec_text: str | None,
           spec_source: str | None, versions: dict[str, str], data_source: str,
           notes: Iterable[str] = (), hardware: dict[str, str] | None = None,
           peaks: Iterable[str] = ()) -> str:
    panels = list(panels)
    counts = ", ".join(f"{n} {s}" for s, n in df["status"].value_counts().items())
    sources = ", ".join(f"{n} {s}" for s, n in df["source"].value_counts().items())
    drawn = [p for p in panels if p.drawn]
    toc = " | ".join(f'<a href="#{html.escape(p.name)}">{html.escape(p.title)}</a>' for p in drawn)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    spec = (f"<p class='meta'>{html.escape(spec_source or '')}</p><pre>{html.escape(spec_text)}</pre>"
            if spec_text else "<p class='skip'>The study's spec was not found (no YAML under "
            "experiments/ with this name, none given).</p>")
    figures = "\n".join(figure_html(p) for p in drawn)
    notes_html = "".join(f"<p class='meta'>Note: {html.escape(n)}.</p>" for n in notes)
    notes_html += "".join(f"<p class='meta'>Note: {html.escape(n)}.</p>"
                          for n in modelled_energy_notes(df))
    peaks = list(peaks)
    peaks_html = ("<p class='meta'>MFU and HFU, in every figure and the table, are relative to "
                  "one peak per hardware: " + html.escape("; ".join(peaks)) + ".</p>"
                  if peaks else "")
    host = (key_value_table(hardware) if hardware else
            "<p class='skip'>The host's hardware was not recorded.</p>")
    skipped = "".join(f"<li>{html.escape(p.title)}: {html.escape(p.note or '')}</li>"
                      for p in panels if not p.drawn)
    skipped_html = (f"<h3>Figures left out (no data for this study or hardware)</h3>"
                    f"<ul class='skip'>{skipped}</ul>" if skipped else "")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>scalestudy report: {html.escape(study)}</title><style>{CSS}</style></head>
<body>
<h1>Study {html.escape(study)}</h1>
<p class="meta">{len(df)} trials ({html.escape(counts)}; {html.escape(sources)}) from
{html.escape(data_source)}. Generated {now}.</p>
{peaks_html}
{notes_html}
<p>{toc}</p>
<h2>Figures</h2>
{figures}
{skipped_html}
<h2>Results</h2>
<p class="meta">Click a column header to sort.</p>
{results_table(df)}
<h2>Spec</h2>
{spec}
<h2>Hardware</h2>
<p class="meta">The machine that wrote this report (make demo measures on it too; the trials of a
cluster ran on the nodes their hardware profile names).</p>
{host}
<h2>Software</h2>
{key_value_table(versions)}
<script>{JS}</script>
</body></html>
"""
