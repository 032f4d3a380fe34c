"""Hardware is told apart in one place: HardwareProfile (spec/catalog.py) answers is_gpu, the
process-group backend and the Ray resources per worker. A string test of a device kind anywhere
else in the source (platform/scalestudy, analysis/scalestudy_analysis) fails here, by file:line.

A kind test is a comparison (==, !=, in, not in, or a match statement) of something named like a
kind (`hw.kind`, a variable or parameter `kind`, a call `hardware_kind(...)`) with "gpu" or "cpu"
(alone or in a tuple, list or set). A string kind handed on (`TrialMeters("gpu", ...)`) ends in such
a test, so it is caught where it is tested. Not kind tests: a torch device's `.type == "cpu"`, a
profiler trace's device, a collective's kind against a collective name (no "gpu"/"cpu" in it).

The checker is tested on planted sources first, so a rule that could never fire cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
ROOTS = (REPO / "platform" / "scalestudy", REPO / "analysis" / "scalestudy_analysis")
CATALOG = "platform/scalestudy/spec/catalog.py"  # where HardwareProfile.is_gpu itself tests kind
DEVICE_KINDS = frozenset({"gpu", "cpu"})
def _named_kind(node: ast.AST) -> bool:
    """`x.kind`, `kind`, `hardware_kind(...)`, `self.kind`: an expression named like a kind."""
    if isinstance(node, ast.Call):
        node = node.func
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return "kind" in name.lower()


def _device_kind(node: ast.AST) -> bool:
    """"gpu" / "cpu", or a tuple, list or set holding one."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_device_kind(e) for e in node.elts)
    return isinstance(node, ast.Constant) and node.value in DEVICE_KINDS


def kind_tests(source: str, path: str) -> list[str]:
    """'path:line: <the test>' for each device-kind string test in the source."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(_named_kind, operands)) and any(map(_device_kind, operands)):
                hits.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Match) and _named_kind(node.subject):
            for case in node.cases:
                values = [p.value for p in ast.walk(case.pattern) if isinstance(p, ast.MatchValue)]
                if any(map(_device_kind, values)):
                    hits.append((case.pattern.lineno, f"match {ast.unparse(node.subject)}: "
                                                      f"case {ast.unparse(case.pattern)}"))
    return [f"{path}:{line}: {text} (ask HardwareProfile: is_gpu, process_group_backend, "
            "ray_resources_per_worker)" for line, text in sorted(hits)]


def scan() -> list[tuple[str, str]]:
    out = []
    for root in ROOTS:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel != CATALOG:
                out += [(rel, hit) for hit in kind_tests(path.read_text(), rel)]
    return out


# --- the checker, on planted sources ------------------------------------------------------------


@pytest.mark.parametrize("planted", [
    'gpu = cfg.hardware_profile.kind == "gpu"',
    'if hw.kind != "gpu": pass',
    'x = "cpu" == profile.kind',
    'if kind in ("gpu", "auto"): pass',
    'metric = A if self.kind == "gpu" else B',
    'cpus = [h for h in hws if hardware_kind(h, df) == "cpu"]',
    'match hw.kind:\n    case "gpu":\n        pass\n    case _:\n        pass',
])
def test_checker_fires_on_a_planted_kind_test(planted):
    hits = kind_tests(planted, "x.py")
    assert len(hits) == 1 and hits[0].startswith("x.py:"), hits


@pytest.mark.parametrize("clean", [
    'with ctx() if device.type == "cpu" else nullcontext(): pass',
    'out = TraceIntervals(device="gpu" if gpu else "cpu")',
    'if out.device == "gpu": pass',
    'if c.kind == M.ALL_REDUCE: pass',
    'if kind in (M.ALL_GATHER, M.REDUCE_SCATTER): pass',
    'backend = hw.process_group_backend if hw.is_gpu else None',
    '"""hw.kind == "gpu" is what is_gpu answers."""',
])
def test_checker_leaves_other_comparisons_alone(clean):
    assert kind_tests(clean, "x.py") == []


# --- the source ---------------------------------------------------------------------------------


def test_no_kind_test_outside_the_hardware_profile():
    hits = [hit for _, hit in scan()]
    assert not hits, "device-kind string tests outside spec/catalog.py:\n" + "\n".join(hits)
