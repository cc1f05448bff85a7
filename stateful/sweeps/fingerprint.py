"""What a machine would run a sweep with: versions and source hashes, to compare across machines.

A sweep's answer depends on the backend under test, on kvstate's own checking code (the
reference model, the lockstep, the generator) and, through them, on Python and NumPy. Two
machines that agree on all of these give the same report for the same seeds; a cluster
whose workers disagree would mix answers from different code. So the sweep compares every
worker's fingerprint with the submitting machine's before a worker gets a run.

Sources are hashed by path relative to their package folder, so the same files installed
under different prefixes (``/usr/lib/...`` here, a virtual environment there) agree.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
import platform
import stat
from pathlib import Path

import numpy

import kvstate

from ..backends import load_factory, module_of_file

# The folders a sweep's answer depends on, besides the backend: the spec it checks against, the
# reference model, the engine the generator draws from, and the lockstep, generator and shrinker.
CHECKER_PACKAGES = ("spec", "reference", "impl", "stateful")


_taken: dict[str, dict] = {}


def fingerprint(backend: str) -> dict[str, str | None]:
    """This process's versions and source hashes for ``backend``; importing it is part of the
    check (a worker that cannot import the backend differs in ``backend import``).

    Taken once per process and backend: what a process runs is what it imported first, even
    if the files change on disk later (a worker left running across an upgrade keeps its old
    fingerprint, as it keeps its old code). A failed import is tried again next time.
    """
    if backend not in _taken:
        found = _take(backend)
        if found["backend import"] != "ok":
            return found
        _taken[backend] = found
    return dict(_taken[backend])


def _take(backend: str) -> dict[str, str | None]:
    found: dict[str, str | None] = {
        "python": platform.python_version(),
        "kvstate": kvstate.__version__,
        "kvstate source": _digest(_package_sources(Path(kvstate.__file__).parent, CHECKER_PACKAGES)),
        "numpy": numpy.__version__,
        "torch": _installed_version("torch"),
    }
    try:
        load_factory(backend)
        found["backend import"] = "ok"
        found["backend source"] = _digest(backend_sources(backend))
    except Exception as error:          # whatever stops the import is the difference to report
        found["backend import"] = f"{type(error).__name__}: {error}"
        found["backend source"] = None
    return found


def differences(here: dict, there: dict) -> dict[str, tuple]:
    """``{what: (here, there)}`` for every entry the two fingerprints disagree on."""
    return {key: (here.get(key), there.get(key)) for key in sorted(set(here) | set(there))
            if here.get(key) != there.get(key)}


def describe(differs: dict[str, tuple]) -> str:
    return "; ".join(f"{key} {there!r} (here {here!r})" for key, (here, there) in differs.items())


def backend_sources(backend: str) -> list[tuple[str, Path]]:
    """The files a backend's code lives in, as (name relative to its folder, path): the whole
    folder of the module's package (for a file given by path inside a package, its top package), or, for a module outside any package (a ``.py`` file given by
    path, which ``load_factory`` lets import the modules beside it), every ``.py`` file in its
    folder and in the packages (folders with an ``__init__.py``) below it. A backend split over
    sibling modules so changes with any of them; a whole folder rather than what the backend
    happened to import, so the hash does not depend on the order a process imported things in
    (a module imported late, inside a function, counts too)."""
    module_name = backend.partition(":")[0]
    if module_name.endswith(".py"):
        module = module_of_file(module_name)
        path = Path(module.__file__).resolve()
        if module.__package__:      # loaded as its package's module: the whole top package, which it may import from
            return _package_sources(path.parents[module.__package__.count(".")], None)
        return _folder_sources(path.parent)
    module = importlib.import_module(module_name)
    path = Path(module.__file__).resolve()
    if getattr(module, "__path__", None) or module.__package__:
        return _package_sources(path.parent, None)
    return _folder_sources(path.parent)


def _folder_sources(root: Path) -> list[tuple[str, Path]]:
    """The ``.py`` files in ``root`` and, recursively, in its subfolders that are packages."""
    files = [(path.name, path) for path in root.glob("*.py") if path.is_file()]
    for init in root.glob("*/__init__.py"):
        files += [(name, path) for name, path in _package_sources(root, (init.parent.name,))]
    return sorted(files)


def _package_sources(root: Path, subfolders: tuple[str, ...] | None) -> list[tuple[str, Path]]:
    """Every ``.py`` file below ``root`` (or below the named subfolders of it), following the
    symlinks kvstate's own package is made of."""
    root = Path(root)
    tops = [root / name for name in subfolders] if subfolders else [root]
    files = []
    for top in tops:
        for path in top.rglob("*.py"):
            if "__pycache__" not in path.parts:
                files.append((path.relative_to(root).as_posix(), path))
    return sorted(files)


MAX_HASHED_FILES = 5000
"""Past this many source files, a fingerprint hashes their names and sizes only (and says so): a
backend folder that is a whole checkout would otherwise be read in full, by every worker."""


def _digest(files: list[tuple[str, Path]]) -> str:
    """A hash of ``files`` (name, then content): regular files only. One that is not (a FIFO named
    ``*.py`` would block the read for good), dangles or cannot be read counts by a marker, not by its
    content, and does not fail the fingerprint; past ``MAX_HASHED_FILES`` files, names and sizes only."""
    hasher = hashlib.sha256()
    if len(files) > MAX_HASHED_FILES:
        for name, path in files:
            try:
                size = str(os.stat(path).st_size)
            except OSError as error:
                size = f"unreadable {type(error).__name__}"
            hasher.update(f"{name}\0{size}\0".encode())
        return f"{hasher.hexdigest()[:16]} (names and sizes only: {len(files)} files, over {MAX_HASHED_FILES})"
    for name, path in files:
        content = _content(path)
        if isinstance(content, str):
            hasher.update(f"{name}\0{content}\0".encode())
            continue
        hasher.update(f"{name}\0{len(content)}\0".encode())
        hasher.update(content)
    return hasher.hexdigest()[:16]


def _content(path: Path) -> bytes | str:
    """``path``'s bytes, or a marker (a str) where it is no regular file or cannot be read. Opened
    without blocking and checked on the open file, so a FIFO swapped in after a look is not read."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:        # dangling symlink, no permission
        return f"<unreadable: {type(error).__name__}>"
    with os.fdopen(descriptor, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            return "<not a regular file>"
        try:
            return file.read()
        except OSError as error:
            return f"<unreadable: {type(error).__name__}>"


def _installed_version(distribution: str) -> str | None:
    """The installed version, without importing the package (importing torch takes seconds)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
