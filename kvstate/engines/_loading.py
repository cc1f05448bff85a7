"""How the engine loaders run a released package's real files with inert stand-ins around them.

An ``EngineLoader`` is one engine's list: the package, the one release it was read from, the real
files to execute (in load order), the modules they import that get stand-ins, the probes that get
answers. ``load()`` executes the real files from the installed package through a finder that
resolves the package's names during the load only, and refuses any name on no list (``ImportError``
naming it), so a new import in another release shows at once. ``sys.modules`` is left as it was: the
loaded modules hold what they imported, and a real ``import <package>`` elsewhere is not shadowed.

The files executed are the installed release's own, not merely files of the same name: the version
is read from the distribution's metadata, so the package folder ``import`` would find must be that
distribution's (a source checkout first on ``sys.path`` is refused), and each real file's bytes must
match the sha256 the distribution's RECORD lists for it (an edited file is refused). Either refusal
is an ``EngineVersionError`` naming the path, since a verdict would otherwise name a release whose
files did not run.

A stand-in's every call or attribute read raises ``StandInCalled`` and is recorded in
``STAND_IN_USES`` (one record for every engine: a test asserts it stays empty after a run, even
where the engine swallowed the exception).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import threading
import types
from dataclasses import dataclass, field

from kvstate.spec.errors import ConfigError


class EngineVersionError(ConfigError):
    """The installed engine is not the release an adapter was written and checked against."""


class StandInCalled(RuntimeError):
    """A module the cache should never touch was used: the stand-in list is wrong for this run."""


# Every use of a stand-in in this process, even one whose StandInCalled the engine swallowed.
STAND_IN_USES: list[str] = []


class _StandIn:
    """An inert name from a module the cache does not need: calling it, or reading from it, raises."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        STAND_IN_USES.append(self._qualname)
        raise StandInCalled(f"{self._qualname} is a stand-in (kvstate.engines) and was called")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        STAND_IN_USES.append(f"{self._qualname}.{name}")
        raise StandInCalled(f"{self._qualname}.{name} read: {self._qualname} is a stand-in")

    def __repr__(self) -> str:
        return f"<stand-in {self._qualname}>"


@dataclass
class EngineLoader:
    """One engine's real files, stand-ins and answers; ``load()`` runs them once per process."""

    package: str
    version: str
    real: tuple[str, ...]                                   # executed as installed, in this order
    stand_ins: dict[str, tuple[str, ...]]                   # module -> names that raise when used
    answers: dict[tuple[str, str], object] = field(default_factory=dict)   # (module, name) -> value
    reexports: tuple[tuple[str, str, str], ...] = ()        # (package, name, real module it comes from)
    _loaded: dict[str, types.ModuleType] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def installed_version(self) -> str | None:
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def require_supported(self, version: str | None) -> None:
        """``ImportError`` without the package, ``EngineVersionError`` for any release but ``version``."""
        if version is None:
            raise ImportError(f"{self.package} is not installed: pip install --no-deps {self.package}=={self.version}")
        if version != self.version:
            raise EngineVersionError(f"{self.package} {version} is installed; kvstate.engines loads {self.package} "
                                     f"{self.version} only (its stand-ins were read from that release)")

    def load(self) -> dict[str, types.ModuleType]:
        """The real modules, by name, loaded once per process."""
        with self._lock:
            if self._loaded:
                return self._loaded
            self.require_supported(self.installed_version())
            finder = _Finder(self, _installed_release(self))
            saved = {name: module for name, module in sys.modules.items() if self._owns(name)}
            for name in saved:
                del sys.modules[name]
            sys.meta_path.insert(0, finder)
            try:
                for name in self.real:
                    self._loaded[name] = importlib.import_module(name)
                    for package, attr, source in self.reexports:
                        if source == name:
                            setattr(sys.modules[package], attr, getattr(self._loaded[name], attr))
            except BaseException:
                self._loaded.clear()
                raise
            finally:
                sys.meta_path.remove(finder)
                for name in [n for n in sys.modules if self._owns(n)]:
                    del sys.modules[name]
                sys.modules.update(saved)
            return self._loaded

    def _owns(self, name: str) -> bool:
        return name == self.package or name.startswith(self.package + ".")

    def _named(self) -> set[str]:
        return {*self.real, *self.stand_ins, *(owner for owner, _ in self.answers)}

    def _is_parent(self, name: str) -> bool:
        return any(other.startswith(name + ".") for other in self._named())


@dataclass(frozen=True)
class _Release:
    """The installed distribution's package folder, and the sha256 its RECORD lists for each real file."""

    root: str
    recorded: dict[str, str]        # real module name -> sha256, urlsafe base64 unpadded as in RECORD

    def source(self, loader: EngineLoader, name: str, path: str) -> bytes:
        """The file's bytes, refused unless they are the ones the release installed."""
        with open(path, "rb") as file:
            data = file.read()
        found = _record_sha256(data)
        if found != self.recorded[name]:
            raise EngineVersionError(f"{path} is not {loader.package} {loader.version}'s file: its sha256 {found} "
                                     f"differs from {self.recorded[name]} in the distribution's RECORD (edited "
                                     f"after install?); pip install --force-reinstall --no-deps "
                                     f"{loader.package}=={loader.version}")
        return data


def _installed_release(loader: EngineLoader) -> _Release:
    """The distribution whose version was checked, required to be the package ``import`` finds."""
    distribution = importlib.metadata.distribution(loader.package)
    root = _package_folder(loader, distribution)
    return _Release(root, _recorded_hashes(loader, distribution))


def _package_folder(loader: EngineLoader, distribution: importlib.metadata.Distribution) -> str:
    """The folder ``import <package>`` finds (its ``__init__`` not run), refused unless it is the
    distribution's: a checkout earlier on ``sys.path`` would otherwise run under the release's name."""
    spec = importlib.util.find_spec(loader.package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{loader.package} is installed without its package folder")
    found = os.path.realpath(list(spec.submodule_search_locations)[0])
    installed = os.path.realpath(distribution.locate_file(loader.package))
    if found != installed:
        raise EngineVersionError(f"{loader.package} is found at {found}, not at {installed} where "
                                 f"{loader.package} {loader.version} is installed (a source checkout or copy "
                                 f"earlier on sys.path?): kvstate.engines runs the installed release's files only")
    return found


def _recorded_hashes(loader: EngineLoader, distribution: importlib.metadata.Distribution) -> dict[str, str]:
    """The RECORD's sha256 of each real file; a file it does not list with one is refused."""
    wanted = {name.replace(".", "/") + ".py": name for name in loader.real}
    recorded = {wanted[path]: sha for path, sha in recorded_sha256s(distribution).items() if path in wanted}
    for path, name in wanted.items():
        if name not in recorded:
            raise EngineVersionError(f"{loader.package} {loader.version}'s RECORD lists no sha256 for {path}, "
                                     f"so the installed file cannot be checked as the release's")
    return recorded


def recorded_sha256s(distribution: importlib.metadata.Distribution) -> dict[str, str]:
    """Every file the distribution's RECORD lists with a sha256 (its path as RECORD writes it -> the hash)."""
    # Parsed by hand rather than through distribution.files: that builds ~10,000 paths (0.2 s).
    rows = csv.reader((distribution.read_text("RECORD") or "").splitlines())
    return {row[0]: row[1].removeprefix("sha256=") for row in rows if len(row) > 1 and row[1].startswith("sha256=")}


def _record_sha256(data: bytes) -> str:
    """sha256 as a wheel's RECORD writes it: urlsafe base64 without the padding."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")


class _Finder:
    """Resolves the package's names during a load only: real files, stand-ins, bare packages, else refuses."""

    def __init__(self, loader: EngineLoader, release: _Release):
        self.loader, self.release, self.root = loader, release, release.root

    def find_spec(self, name, path=None, target=None):
        loader = self.loader
        if not loader._owns(name):
            return None
        if name in loader._named() or loader._is_parent(name):
            return importlib.machinery.ModuleSpec(name, self, is_package=loader._is_parent(name))
        raise ImportError(f"{name} is neither a real file nor a stand-in of kvstate.engines "
                          f"({loader.package} {loader.version}): the release's imports changed", name=name)

    def create_module(self, spec):
        name, loader = spec.name, self.loader
        if name in loader.real:
            return None
        module = types.ModuleType(name, "kvstate stand-in: every attribute raises StandInCalled when used")
        if loader._is_parent(name):          # a bare package (its __init__ not run), or a stand-in that is one too
            stand_in = name in loader.stand_ins or any(owner == name for owner, _ in loader.answers)
            module.__path__ = [] if stand_in else [os.path.join(self.root, *name.split(".")[1:])]
            module.__package__ = name
        for attr in loader.stand_ins.get(name, ()):
            setattr(module, attr, _StandIn(f"{name}.{attr}"))
        for (owner, attr), value in loader.answers.items():
            if owner == name:
                setattr(module, attr, value)
        return module

    def exec_module(self, module):
        name = module.__name__
        if name not in self.loader.real:
            return
        path = os.path.join(self.root, *name.split(".")[1:]) + ".py"
        module.__file__ = path
        # The bytes checked are the bytes compiled, so nothing can change between check and run.
        exec(compile(self.release.source(self.loader, name, path), path, "exec"), module.__dict__)
