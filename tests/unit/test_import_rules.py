"""Which package may import which (docs/ARCHITECTURE.md), checked on the source with `ast`.

Every import statement counts, at module level or inside a function (a lazy import is still a
dependency), except those under `if TYPE_CHECKING:` (annotations only, nothing runs). The checker is
tested on planted violations first, so a rule that could never fire cannot pass unnoticed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
ROOTS = {"scalestudy": REPO / "platform" / "scalestudy",
         "scalestudy_analysis": REPO / "analysis" / "scalestudy_analysis"}

# Layers, top to bottom: a package may import the packages listed for it, nothing else of ours.
FOUNDATION = {"errors", "parallel", "spec", "metrics"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "parallel": {"errors"},
    "spec": {"parallel", "errors"},
    "metrics": {"spec", "parallel", "errors"},
    "perfmodel": FOUNDATION,
    "track": FOUNDATION,
    # the one planner: expansion, the memory rule, verdicts (reads the model; no torch, no ray)
    "plan": FOUNDATION | {"perfmodel", "tables"},
    "measure": FOUNDATION | {"perfmodel", "plan"},
    "train": FOUNDATION | {"measure", "perfmodel", "plan"},
    # the Ray line: what runs the (Ray-free) trial body under Ray Train and Tune
    "launch": FOUNDATION | {"train", "measure", "perfmodel", "plan", "track"},
    "calibrate": FOUNDATION | {"launch", "train", "measure", "perfmodel", "plan", "track"},
    "sweep": FOUNDATION | {"launch", "train", "calibrate", "measure", "perfmodel", "plan", "track"},
    "cli": FOUNDATION | {"sweep", "launch", "train", "calibrate", "measure", "perfmodel", "plan",
                         "track", "analysis", "cli_common", "cli_tools", "cli_plan", "tables"},
    "analysis": FOUNDATION | {"perfmodel", "plan", "track"},
    # the terminal's tables and the options every sub-command shares (cli.py, cli_tools.py)
    "tables": FOUNDATION,
    "cli_common": FOUNDATION | {"tables", "track"},
    "cli_tools": FOUNDATION | {"cli_common", "calibrate", "launch", "perfmodel", "track", "train"},
    "cli_plan": FOUNDATION | {"cli_common", "cli_plan_rounds", "plan", "perfmodel", "tables"},
    # plan's measuring rounds: Ray Tune sweeps of the chosen layouts
    "cli_plan_rounds": FOUNDATION | {"cli_common", "plan", "perfmodel", "sweep", "track"},
    "__init__": set(),
}
HEAVY = ("torch", "ray", "deepspeed")
# Packages that never import ray, not even lazily: train/ is the trial body and what it needs (the
# Ray line is launch/), plan/ and perfmodel/ are pure Python.
RAY_FREE_PACKAGES = ("train", "plan", "perfmodel", "measure", "track", "spec", "parallel")
# The trial body and everything it imports must run without Ray (train/local.py, under torchrun), and
# so must `make gpu-check` (calibrate/gpucheck.py, calibrate/gpu.py).
RAY_FREE_ENTRY_POINTS = ("scalestudy.train.body", "scalestudy.train.local", "scalestudy.calibrate.gpucheck",
                         "scalestudy.calibrate.gpu")


def module_name(root_pkg: str, root: Path, path: Path) -> str:
    parts = [root_pkg, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str | None:
    """Layer key of one of our modules: scalestudy.<pkg>[...] -> pkg, the analysis -> analysis."""
    if module == "scalestudy_analysis" or module.startswith("scalestudy_analysis."):
        return "analysis"
    if module == "scalestudy":
        return "__init__"
    if module.startswith("scalestudy."):
        return module.split(".")[1]
    return None


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import that runs."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), top)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.append((child.module, top))
                found.extend((f"{child.module}.{a.name}", top) for a in child.names)
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(ast.parse(source), True)
    return found


def sources() -> dict[str, str]:
    out = {}
    for pkg, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            out[module_name(pkg, root, path)] = path.read_text()
    return out


def _ours(name: str, modules: Iterable[str]) -> str | None:
    """The module of ours an import names (`from a.b import c` may name a.b.c or attribute c)."""
    return name if name in modules else None


def violations(srcs: dict[str, str]) -> list[str]:
    out: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in srcs}
    for module, source in srcs.items():
        pkg = package_of(module)
        for name, top in imports_of(source):
            root = name.split(".")[0]
            if root in HEAVY:
                if pkg in ("perfmodel", "plan"):
                    out.append(f"{module} imports {name}: {pkg}/ is pure Python")
                elif root == "ray" and pkg in RAY_FREE_PACKAGES:
                    out.append(f"{module} imports {name}: {pkg}/ is below the Ray line (launch/)")
                elif pkg in FOUNDATION and top:
                    out.append(f"{module} imports {name} at module level: {pkg}/ stays importable "
                               "without it (import it where it is needed)")
                graph[module].add(name)
                continue
            target = _ours(name, srcs)
            if target is None or target in (module, "scalestudy"):  # the root is a namespace
                continue
            graph[module].add(target)
            dep = package_of(target)
            if dep != pkg and dep not in ALLOWED[pkg]:
                out.append(f"{module} imports {target}: {pkg} may import only "
                           f"{', '.join(sorted(ALLOWED[pkg])) or 'nothing of ours'}")
    out += _ray_reachable(graph)
    out += _package_cycles(graph)
    return out


def _ray_reachable(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for entry in RAY_FREE_ENTRY_POINTS:
        if entry not in graph:
            continue
        seen, todo, parent = {entry}, [entry], {entry: None}
        while todo:
            m = todo.pop()
            for dep in graph.get(m, ()):
                if dep.split(".")[0] == "ray":
                    chain = [m]
                    while parent[chain[-1]]:
                        chain.append(parent[chain[-1]])
                    out.append(f"{entry} reaches ray: {' <- '.join([dep, *chain])}")
                elif dep in graph and dep not in seen:
                    seen.add(dep)
                    parent[dep] = m
                    todo.append(dep)
    return out


def _package_cycles(graph: dict[str, set[str]]) -> list[str]:
    pkgs: dict[str, set[str]] = {}
    for m, deps in graph.items():
        p = package_of(m)
        pkgs.setdefault(p, set()).update(
            q for q in (package_of(d) for d in deps if d in graph) if q and q != p)
    out = []
    for p in sorted(pkgs):
        stack, seen = [(p, [p])], set()
        while stack:
            node, path = stack.pop()
            for q in pkgs.get(node, ()):
                if q == p:
                    out.append(f"package cycle: {' -> '.join([*path, p])}")
                    stack.clear()
                    break
                if q not in seen:
                    seen.add(q)
                    stack.append((q, [*path, q]))
    return out


def test_the_checker_fires_on_planted_violations():
    srcs = sources()
    planted = {
        # measure/ never imports train/ (the cycle issue 14 removed)
        "scalestudy.measure._planted": "def f():\n    from scalestudy.train import body\n",
        # the performance model imports no torch, not even lazily
        "scalestudy.perfmodel._planted": "def f():\n    import torch\n",
        # a ray import two modules below the trial body
        "scalestudy.train.data": srcs["scalestudy.train.data"] + "\nimport ray.train\n",
        # analysis reads results, never trains
        "scalestudy_analysis._planted": "from scalestudy.sweep.driver import run_sweep\n",
    }
    found = violations({**srcs, **planted})
    assert any("scalestudy.measure._planted imports scalestudy.train.body" in v for v in found)
    assert any("package cycle" in v and "measure" in v and "train" in v for v in found)
    assert any("scalestudy.perfmodel._planted imports torch" in v for v in found)
    assert any(v.startswith("scalestudy.train.body reaches ray") and "scalestudy.train.data" in v
               for v in found)
    assert any("scalestudy_analysis._planted imports scalestudy.sweep.driver" in v for v in found)
    # annotations under TYPE_CHECKING are no dependency
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
    assert violations({**srcs, "scalestudy.perfmodel._typed": typed}) == violations(srcs)


def test_every_package_is_in_a_layer():
    assert {package_of(m) for m in sources()} <= set(ALLOWED)


@pytest.mark.parametrize("rule", ["layers", "ray-free body", "no package cycle"])
def test_import_rules_hold(rule):
    found = violations(sources())
    if rule == "ray-free body":
        found = [v for v in found if "reaches ray" in v]
    elif rule == "no package cycle":
        found = [v for v in found if "package cycle" in v]
    else:
        found = [v for v in found if "reaches ray" not in v and "package cycle" not in v]
    assert not found, "\n".join(found)
