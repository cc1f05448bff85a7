"""Imports inside each kvstate folder run one way: no cycle among a folder's modules, lazy
(function-level) imports included; and spec/ imports nothing else of kvstate."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ["spec", "impl", "reference", "stateful", "fuzz", "bench", "model"]


def _module_name(folder: Path, path: Path) -> str:
    """``directed/common.py`` -> ``directed.common``; a package's ``__init__.py`` -> its name."""
    parts = list(path.relative_to(folder).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(folder: Path, path: Path, node: ast.ImportFrom) -> set[str]:
    """The modules of ``folder`` a relative import names (``from ..ops import x`` in
    ``directed/edges.py`` -> ``ops``; ``from . import ops`` -> ``ops``)."""
    package = list(path.relative_to(folder).parent.parts)
    base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
    prefix = ".".join(base + ([node.module] if node.module else []))
    if node.module and not (folder / prefix.replace(".", "/")).is_dir():
        return {prefix}
    # ``from .pkg import module`` (or ``from . import module``) imports the module itself
    return {f"{prefix}.{alias.name}" if prefix else alias.name for alias in node.names}


def _imports(folder: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same folder (subpackages included) it imports, through
    relative imports at any depth of the file."""
    graph = {}
    for path in folder.rglob("*.py"):
        siblings = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                siblings |= _resolve(folder, path, node)
        graph[_module_name(folder, path)] = siblings - {""}
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


def _type_checking_only(folder: Path, path: Path) -> set[str]:
    """Siblings imported only under ``if TYPE_CHECKING:`` (annotations, never run)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and sub.level >= 1:
                    names |= _resolve(folder, path, sub)
    return names


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_import_cycle_within_a_folder(folder):
    graph = _imports(ROOT / folder)
    for path in (ROOT / folder).rglob("*.py"):
        graph[_module_name(ROOT / folder, path)] -= _type_checking_only(ROOT / folder, path)
    assert _cycle(graph) is None, f"{folder}/: import cycle {' -> '.join(_cycle(graph))}"


def test_the_cycle_finder_finds_one():
    assert _cycle({"cache": {"numpy"}, "numpy": {"cache"}}) == ["cache", "numpy", "cache"]


def test_relative_imports_resolve_across_subpackages(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "ops.py").write_text("from .sub import edges\n")
    (tmp_path / "sub" / "__init__.py").write_text("")
    (tmp_path / "sub" / "edges.py").write_text("from .. import ops\nfrom .common import y\n")
    (tmp_path / "sub" / "common.py").write_text("")
    graph = _imports(tmp_path)
    assert graph["sub.edges"] == {"ops", "sub.common"} and graph["ops"] == {"sub.edges"}
    assert _cycle(graph) == ["ops", "sub.edges", "ops"]


def test_spec_imports_nothing_else_of_kvstate():
    for path in (ROOT / "spec").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvstate"):
                assert node.module.startswith("kvstate.spec"), f"{path.name} imports {node.module}"
