"""The package is arranged by stage: imports point only down the data flow, and no module imports itself back.

The stages, lowest first (docs/architecture.md draws them): a stage may import its own modules and any
stage of a lower rank, never one of the same or a higher rank. The vLLM plugin runs inside the engine's
processes and imports nothing of the pipeline.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "wmtp"

RANK = {
    "layout": 0,  # the on-disk contract: file names, cell ids
    "config": 1,  # the study: its declaration and validation, the matrix of cells
    "plugin": 1,  # windowed MTP inside vLLM
    "analyze": 1,  # raw files → tidy tables, formulas, cost model
    "engines": 2,  # engine adapters and environment builds
    "replica": 2,  # the GPU cost-side replica
    "report": 2,  # tidy tables → figures and HTML
    "model": 3,  # the tiny models the embedded study serves: made before any cell measures them
    "measure": 4,  # prompts, servers, cells, counters, power
    "cli": 5,
    "__main__": 6,  # `python -m wmtp` calls the command
}


def _stage(module: str) -> str:
    """``wmtp.measure.cell`` → ``measure``; the package's own ``__init__`` is stage ``layout`` (it imports nothing)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "layout"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every wmtp module this file imports, at module level or inside functions."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name.split(".")[0] == "wmtp"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "wmtp":
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                out.add(candidate if _is_module(candidate) else target)
    return out


def _is_module(dotted: str) -> bool:
    path = SRC.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(SRC.rglob("*.py"))}


def test_every_top_level_module_and_package_has_a_stage():
    tops = {
        p.stem if p.is_file() else p.name
        for p in SRC.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    }
    assert tops <= set(RANK), f"assign these to a stage in RANK (and docs/architecture.md): {tops - set(RANK)}"


@pytest.mark.parametrize("module", sorted(_graph()))
def test_imports_point_down_the_data_flow(module: str):
    own = _stage(module)
    upward = sorted(t for t in _graph()[module] if _stage(t) != own and RANK[_stage(t)] >= RANK[own])
    assert not upward, f"{module} (stage {own}, rank {RANK[own]}) imports {upward} of the same or a higher rank"


def test_the_plugin_imports_only_itself():
    graph = _graph()
    outside = {m: sorted(t for t in ts if _stage(t) != "plugin") for m, ts in graph.items() if _stage(m) == "plugin"}
    assert not any(outside.values()), outside


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " → ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule is not vacuous: a config module importing a cell is caught."""
    fake = tmp_path / "wmtp"
    (fake / "measure").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "measure" / "__init__.py").write_text("")
    (fake / "measure" / "cell.py").write_text("X = 1\n")
    (fake / "config.py").write_text("from wmtp.measure.cell import X\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    imports = _imports(fake / "config.py")
    assert imports == {"wmtp.measure.cell"}
    assert RANK[_stage("wmtp.measure.cell")] >= RANK[_stage("wmtp.config")]
