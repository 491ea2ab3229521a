"""The api/ modules import one another without a circle, lazy imports included
(docs/architecture.md, "Where serving lives")."""

from __future__ import annotations

import ast
from pathlib import Path

API_DIR = Path(__file__).resolve().parent.parent / "api"


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (types only)."""
    nodes: list[ast.AST] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
    return nodes


def api_imports(path: Path) -> set[str]:
    """The api/ modules that ``path`` imports when it runs, anywhere in it (lazy
    imports in functions included; imports for type checking left out)."""
    imported: set[str] = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module == "trio_llm.api":
                imported |= {alias.name for alias in node.names}
            elif node.module.startswith("trio_llm.api."):
                imported.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[2] for alias in node.names
                         if alias.name.startswith("trio_llm.api.")}
    return imported - {path.stem}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, or None."""
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> list[str] | None:
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                return [*trail[trail.index(imported):], imported] if imported in trail else [
                    module, imported]
            if imported not in state:
                cycle = visit(imported, [*trail, imported])
                if cycle:
                    return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


def test_the_api_modules_import_one_another_without_a_circle() -> None:
    graph = {path.stem: api_imports(path) for path in API_DIR.glob("*.py")}
    assert "serving" in graph["processes"] and "server" in graph["serving"]
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_circle_finder_finds_a_circle() -> None:
    assert find_cycle({"cli": {"server"}, "server": {"cli"}}) == ["cli", "server", "cli"]
    assert find_cycle({"cli": {"server"}, "server": set()}) is None
