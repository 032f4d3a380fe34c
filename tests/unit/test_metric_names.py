"""Metric names are spelt once, in scalestudy/metrics.py: a string literal equal to one anywhere else
in the source (platform/scalestudy, analysis/scalestudy_analysis) fails here, named by file:line.

What counts as a metric name: every module-level str constant of metrics.py with an upper-case name
(the scalar metrics, the per-step series `train/...`, and the collective kinds ALL_REDUCE ...
SEND_RECV, BARRIER, OTHER that name the `comm/<kind>/<stat>` columns), read from metrics.py with
`ast`, so a name added there is checked without touching this test.

What is not a literal:
* docstrings and any other bare string statement (prose: it runs nothing);
* a field written as a name, not a string: `TrialResult(mfu=x)`, `result.mfu`, a pydantic or
  dataclass field `mfu: float` are identifiers the type checks, so they are never string constants
  here. `getattr(result, "mfu")`, `row["mfu"]` and `{"mfu": x}` are, and fail;
* FOREIGN: a few strings that are someone else's names and only happen to equal one of ours (torch's
  ProcessGroup method `reduce`), allowed by (file, the variable they are assigned to) with the reason.

The checker is tested on planted sources first, so a rule that could never fire cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
METRICS = REPO / "platform" / "scalestudy" / "metrics.py"
ROOTS = (REPO / "platform" / "scalestudy", REPO / "analysis" / "scalestudy_analysis")

# (file relative to the repo, the variable assigned): why its strings are not our metric names.
FOREIGN = {
    ("platform/scalestudy/measure/comm_groups.py", "_METHODS"):
        "torch.distributed.ProcessGroup method names (torch's spelling, looked up with getattr)",
}


def metric_names(source: str) -> dict[str, str]:
    """value -> constant name, for the upper-case module-level str constants of metrics.py."""
    out = {}
    for node in ast.parse(source).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        value = getattr(node, "value", None)
        if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
            continue
        for t in targets:
            if isinstance(t, ast.Name) and t.id.isupper():
                out[value.value] = t.id
    return out


def _skipped(tree: ast.Module, path: str) -> set[int]:
    """ids of the string nodes that are not literals: bare string statements and FOREIGN values."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and (path, t.id) in FOREIGN for t in targets):
                skip.update(id(n) for n in ast.walk(node.value))
    return skip


def literals(source: str, path: str, names: dict[str, str]) -> list[str]:
    """'path:line: "value" (use metrics.NAME)' for each metric-name literal in the source."""
    tree = ast.parse(source)
    skip = _skipped(tree, path)
    hits = [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names
            and id(n) not in skip]
    return [f"{path}:{line}: {value!r} (use metrics.{names[value]})" for line, value in sorted(hits)]


def scan() -> list[tuple[str, str]]:
    """(file relative to the repo, hit) over the source, metrics.py itself left out."""
    names = metric_names(METRICS.read_text())
    out = []
    for root in ROOTS:
        for path in sorted(root.rglob("*.py")):
            if path == METRICS:
                continue
            rel = path.relative_to(REPO).as_posix()
            out += [(rel, hit) for hit in literals(path.read_text(), rel, names)]
    return out


# --- the checker, on planted sources ------------------------------------------------------------

NAMES = {"mfu": "MFU", "all_reduce": "ALL_REDUCE", "train/loss": "TRAIN_LOSS"}


@pytest.mark.parametrize("planted", [
    'x = row["mfu"]',
    'getattr(result, "mfu")',
    'fields = {"mfu": 0.5}',
    'if kind == "all_reduce": pass',
    'KINDS = ("all_reduce", "barrier")',
    'mlflow.log_metric("train/loss", 1.0)',
    'def f(metric="mfu"): pass',
    'def f():\n    """doc"""\n    return "mfu"',
])
def test_checker_fires_on_a_planted_literal(planted):
    hits = literals(planted, "x.py", NAMES)
    assert len(hits) == 1 and hits[0].startswith("x.py:") and "metrics." in hits[0], hits


@pytest.mark.parametrize("clean", [
    '"""The mfu column: mfu is model FLOPs utilization."""',
    'def f():\n    """Returns "mfu"."""\n    return M.MFU',
    'result.mfu + TrialResult(mfu=0.5).hfu',
    'class R(BaseModel):\n    mfu: float = 0.0',
    'x = f"{kind}/mfu"',  # a part of a string, not a name
    'x = "MFU"',  # a label, not the column's name
])
def test_checker_leaves_prose_fields_and_attributes_alone(clean):
    assert literals(clean, "x.py", NAMES) == []


def test_foreign_names_are_allowed_only_where_listed():
    planted = '_METHODS = ("allreduce", "reduce", "broadcast")\nOTHER = ("reduce",)'
    path, _ = next(iter(FOREIGN))
    names = {"reduce": "REDUCE", "broadcast": "BROADCAST"}
    assert literals(planted, path, names) == [f"{path}:2: 'reduce' (use metrics.REDUCE)"]
    assert len(literals(planted, "elsewhere.py", names)) == 3


def test_metric_names_are_read_from_metrics_py():
    import scalestudy.metrics as M

    names = metric_names(METRICS.read_text())
    assert set(M.SCALAR_METRICS) <= set(names) and set(M.COLLECTIVE_KINDS) <= set(names)
    assert {M.TRAIN_LOSS, M.TRAIN_STEP_TIME_S, M.NODE_OVERHEAD_POWER_W_ESTIMATED} <= set(names)


# --- the source ---------------------------------------------------------------------------------


def test_no_metric_name_literal_outside_metrics_py():
    hits = [hit for _, hit in scan()]
    assert not hits, "metric names spelt outside metrics.py:\n" + "\n".join(hits)
