"""A backend given by path that lives in a package imports as that package's module.

Until 2026-12-06 ``load_factory`` loaded every file under its bare stem, so a backend split over a
package with relative imports (``from .pages import Page``, as ``tests/foreign/free_queue.py`` has)
could not be named by its path: ``kvstate conform pkg/engine.py`` failed with "attempted relative
import with no known parent package".
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from kvstate.stateful.backends import FactoryError, load_factory, module_of_file
from kvstate.stateful.sweeps import fingerprint as F

FOREIGN = Path(__file__).parent / "foreign"


def _package(root: Path, name: str) -> Path:
    """A package ``name`` under ``root`` whose ``engine.py`` imports its factory from a sibling, relatively."""
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "parts.py").write_text("from kvstate.impl.numpy import factory\n")
    (package / "engine.py").write_text("from .parts import factory\n")
    return package / "engine.py"


@pytest.fixture
def forget_modules():
    """Modules and ``sys.path`` entries a test's loads add are taken out again after it."""
    modules, path = set(sys.modules), list(sys.path)
    yield
    for name in set(sys.modules) - modules:
        del sys.modules[name]
    sys.path[:] = path


def test_a_file_inside_a_package_loads_with_its_relative_imports(tmp_path, forget_modules):
    from kvstate.impl.numpy import factory

    engine = _package(tmp_path, "kvs_pkg_backend")
    assert load_factory(str(engine)) is factory
    assert module_of_file(engine).__name__ == "kvs_pkg_backend.engine"


def test_the_foreign_free_queue_engine_loads_by_its_path(forget_modules):
    """The file README names as an example of a free-queue engine, by path, as a user would pass it."""
    factory = load_factory(str(FOREIGN / "free_queue.py"))
    assert callable(factory)
    assert module_of_file(FOREIGN / "free_queue.py").__name__.endswith("foreign.free_queue")


def test_a_package_name_another_folder_holds_falls_back_to_the_file_name(tmp_path, forget_modules):
    """A package name this process already holds for another folder (an installed package named
    ``tests``, say): the file loads by its stem as before, and where its relative imports need the
    package, the error names the clash."""
    from kvstate.impl.numpy import factory

    load_factory(str(_package(tmp_path / "a", "kvs_pkg_twice")))
    relative = _package(tmp_path / "b", "kvs_pkg_twice")
    with pytest.raises(FactoryError, match="'kvs_pkg_twice' is already .*loaded by its file name instead"):
        load_factory(str(relative))
    absolute = relative.parent / "absolute.py"
    absolute.write_text("from kvstate.impl.numpy import factory\n")
    assert load_factory(str(absolute)) is factory
    assert module_of_file(absolute).__name__ == "absolute"


def test_a_package_backends_fingerprint_covers_its_whole_top_package(tmp_path, forget_modules):
    """A sweep's workers and ``--resume`` compare this hash: a file the engine imports from its
    package (here a sibling reached by a relative import) changes it."""
    engine = _package(tmp_path, "kvs_pkg_hashed")
    before = F._take(str(engine))["backend source"]
    assert before is not None
    parts = engine.parent / "parts.py"
    parts.write_text(parts.read_text() + textwrap.dedent("""
        # changed
    """))
    assert F._take(str(engine))["backend source"] != before
