"""Imports inside each kvstate folder run one way: no cycle among a folder's modules, lazy
(function-level) imports included; and spec/ imports nothing else of kvstate."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ["spec", "impl", "reference", "stateful", "fuzz", "bench", "model"]


def _imports(folder: Path) -> dict[str, set[str]]:
    """Module -> the sibling modules it imports (relative imports, at any depth of the file)."""
    graph = {}
    for path in folder.glob("*.py"):
        siblings = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                siblings |= {node.module} if node.module else {alias.name for alias in node.names}
        graph[path.stem] = siblings
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    def visit(name, path):
        for nxt in sorted(graph.get(name, ())):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt in graph:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        return None
    for start in sorted(graph):
        found = visit(start, [start])
        if found:
            return found
    return None


def _type_checking_only(path: Path) -> set[str]:
    """Siblings imported only under ``if TYPE_CHECKING:`` (annotations, never run)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and sub.level == 1:
                    names.add(sub.module)
    return names


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_import_cycle_within_a_folder(folder):
    graph = _imports(ROOT / folder)
    for name in graph:
        graph[name] -= _type_checking_only(ROOT / folder / f"{name}.py")
    assert _cycle(graph) is None, f"{folder}/: import cycle {' -> '.join(_cycle(graph))}"


def test_the_cycle_finder_finds_one():
    assert _cycle({"cache": {"numpy"}, "numpy": {"cache"}}) == ["cache", "numpy", "cache"]


def test_spec_imports_nothing_else_of_kvstate():
    for path in (ROOT / "spec").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvstate"):
                assert node.module.startswith("kvstate.spec"), f"{path.name} imports {node.module}"
