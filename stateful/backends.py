"""Loading a backend factory by name and checking that its caches speak the protocol.

Shared by ``kvstate conform``, the sweep's runs (in pool processes and Dask workers) and
``kvstate replay``; it imports nothing else of the suite, so all of them can import it.
"""

from __future__ import annotations

import importlib
import importlib.util
import shlex
import sys
import weakref
from pathlib import Path

from kvstate.spec.errors import KVStateError
from kvstate.spec.observation import Observation
from kvstate.spec.protocol import CacheProtocol, Config, ContextProtocol, Factory

from .deadline import Overran, in_daemon_thread


class FactoryError(KVStateError):
    """A backend factory could not be loaded or does not speak the protocol."""


BUILTIN_BACKENDS = ("kvstate.impl.numpy", "kvstate.impl.torch")
"""Modules a replay file, journal or report may name and have imported unasked; any other needs ``--backend``."""


def canonical_backend(name: str) -> str:
    """``name`` as a journal, replay file or printed command keeps it: a file's path made absolute
    (``path/to/file.py[:callable]``), so the command works from any folder; a module name unchanged."""
    module, colon, attribute = name.partition(":")
    if not module.endswith(".py"):
        return name
    return str(Path(module).resolve()) + colon + attribute


def backend_option(name: str) -> str:
    """`` --backend NAME`` for a printed replay or resume command, "" where the backend is built in
    (those commands import only built-in backends unasked)."""
    if name.partition(":")[0] in BUILTIN_BACKENDS:
        return ""
    return f" --backend {shlex.quote(canonical_backend(name))}"


def load_factory(path: str) -> Factory:
    """``package.module:callable``, or ``package.module`` for that module's ``factory``.

    ``some/file.py[:callable]`` loads a module from a file: as its package's module where the file
    is in one (relative imports work), else under its stem, its folder on ``sys.path`` (a backend
    split over sibling files imports).
    """
    module_name, _, attribute = path.partition(":")
    try:
        if module_name.endswith(".py"):
            module = _load_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except Exception as error:   # any import failure is the user's to read, by name
        hint = ""
        if isinstance(error, ModuleNotFoundError) and error.name == module_name and Path(f"{module_name}.py").is_file():
            hint = f" (a file here: pass it as ./{module_name}.py)"
        raise FactoryError(f"cannot import backend module {module_name!r}: {error!r}{hint}") from error
    attribute = attribute or "factory"
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise FactoryError(f"{module_name!r} has no callable {attribute!r} (a backend factory)")
    try:
        _LOADED_AS[factory] = canonical_backend(path)
    except TypeError:       # a callable no weak reference can name (a builtin): ``backend_name`` guesses
        pass
    return factory


# How each factory ``load_factory`` returned was named, so a report's command names it the same way.
_LOADED_AS: "weakref.WeakKeyDictionary[Factory, str]" = weakref.WeakKeyDictionary()


def backend_name(factory: Factory) -> str:
    """What ``--backend`` takes to load ``factory`` again: the name it was loaded by (a file path
    included), else its ``module:name``."""
    try:
        named = _LOADED_AS.get(factory)
    except TypeError:
        named = None
    return named or f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', '?')}"


# The module each file given by path was loaded as (``_load_file``), for whoever must find it again.
_FILE_MODULES: dict[Path, object] = {}


def _load_file(path: Path):
    """The module in the file at ``path``. A file inside a package (its folder has an ``__init__.py``)
    is imported as that package's module, the folder above the top package put on ``sys.path``, so
    its relative imports (``from .pages import Page``) work as they do under pytest. Any other file,
    or one whose package name this process already holds for another folder (an installed package
    named ``tests``), is loaded under its stem, its folder put on ``sys.path`` so its sibling
    modules import."""
    if not path.is_file():
        raise FileNotFoundError(f"no file {str(path)!r}")
    path = path.resolve()
    dotted = _dotted_name(path)
    if dotted is not None:
        try:
            return _import_from_package(path, *dotted)
        except _NameTaken as taken:
            try:
                return _load_by_stem(path)
            except ImportError as error:     # its relative imports need the package it cannot be imported as
                raise ImportError(f"{taken}; loaded by its file name instead, it failed: {error}") from error
    return _load_by_stem(path)


def _load_by_stem(path: Path):
    folder, name = str(path.parent), path.stem
    # A file named like a module this process has or can import (numpy.py, as kvstate names its own
    # backends; random.py, queue.py) was put in its place, and the suite then failed a correct backend
    # (numpy.random missing) or died: such a file gets a name of its own, and its folder goes last
    # on sys.path, behind the modules it is named like.
    taken = name in sys.modules or _importable_elsewhere(name, path)
    if taken:
        name = f"_kvstate_backend_{name}"
    if folder not in sys.path:
        if taken:
            sys.path.append(folder)
        else:
            sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _FILE_MODULES[path] = module
    return module


def _importable_elsewhere(name: str, path: Path) -> bool:
    """Whether ``import name`` finds a module other than the file at ``path``."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and (spec.origin is None or Path(spec.origin).resolve() != path)


def module_of_file(path: str | Path):
    """The module ``load_factory`` loaded from the file at ``path``."""
    return _FILE_MODULES[Path(path).resolve()]


def _dotted_name(path: Path) -> "tuple[Path, str] | None":
    """(the folder above its top package, its dotted module name) for a file inside a package, else None."""
    parts, folder = [path.stem], path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    if len(parts) == 1 or not all(part.isidentifier() for part in parts):     # no package an import can name
        return None
    return folder, ".".join(parts)


class _NameTaken(ImportError):
    """The file's dotted name is another file's in this process."""


def _import_from_package(path: Path, root: Path, dotted: str):
    """``dotted`` imported with ``root`` on ``sys.path``: ``_NameTaken`` where that name is another
    file's (a package of the same name imported, or found first, elsewhere)."""
    top = dotted.partition(".")[0]
    held = sys.modules.get(top)
    if held is not None and Path(getattr(held, "__file__", None) or "").resolve() != root / top / "__init__.py":
        raise _NameTaken(f"{str(path)!r} is module {dotted!r} of its package, but {top!r} is already "
                         f"{getattr(held, '__file__', None) or 'a module without a file'!r} in this process")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module = importlib.import_module(dotted)
    found = Path(getattr(module, "__file__", None) or "").resolve()
    if found != path:
        raise _NameTaken(f"{str(path)!r} is module {dotted!r} of its package, but that name is "
                         f"{str(found) if found.name else 'a module without a file'!r} in this process")
    _FILE_MODULES[path] = module
    return module


def check_backend(factory: Factory, configs: list[Config], time_limit: float = 60.0) -> None:
    """``FactoryError`` naming what is missing when the factory's caches do not speak the protocol.

    Runs in a daemon thread: a factory that never returns is a ``FactoryError`` after ``time_limit``.
    """
    try:
        in_daemon_thread(lambda: _check_backend(factory, configs), time_limit, "kvstate-conform-protocol",
                         "the backend's factory or its first cache")
    except Overran:
        raise FactoryError(f"the factory or its first cache did not answer within {time_limit:g} s") from None


def _check_backend(factory: Factory, configs: list[Config]) -> None:
    if not configs or not all(isinstance(c, Config) for c in configs):
        raise FactoryError(f"the factory declares configs {configs!r}: expected a non-empty list of Config")
    config = configs[0]
    try:
        cache = factory(config)
    except (Exception, SystemExit) as error:       # a backend's sys.exit is its failure, not the caller's exit
        raise FactoryError(f"the factory raised {error!r} building {config.name}") from error
    if isinstance(cache, type):     # its methods, called unbound, failed on a missing 'self'
        raise FactoryError(f"the factory returned the class {cache.__name__}, not a cache: return {cache.__name__}(config)")
    _require(cache, CacheProtocol, "the factory's cache")
    step = "cache.allocate()"
    try:
        ctx = cache.allocate()
        _require(ctx, ContextProtocol, "cache.allocate()'s context")
        step = "cache.observe()"
        observation = cache.observe()
        step = "close() of an empty context"
        ctx.close()
    except FactoryError:
        raise
    except (Exception, SystemExit) as error:
        raise FactoryError(f"the backend raised {error!r} in {step}, its first call of the kind") from error
    if not isinstance(observation, Observation):
        raise FactoryError(f"cache.observe() returned {type(observation).__name__}, not kvstate.spec.Observation")


def load_backend(backend: str, time_limit: float, configs_default=None, check: bool = True):
    """The factory named ``backend`` and the configurations it is checked in, imported (and, with
    ``check``, its first cache built) in a daemon thread: an import or factory that hangs is a
    ``FactoryError`` after ``time_limit``; so is one that calls ``sys.exit`` at import (it would end
    the caller with its status), and any other error of loading (unknown declared semantics among
    them), named. ``configs_default``: the configurations to hold a factory declaring none to (a
    replay's). A Ctrl-C or a sweep's SIGTERM (a ``KeyboardInterrupt``) is the caller's, passed on.
    The ``kvstate`` command and the pytest plugin both load through here."""
    from kvstate.spec.protocol import declared_configs

    from .configs import configs_for

    def load():
        factory = load_factory(backend)
        return factory, configs_for(factory) if configs_default is None else declared_configs(factory, configs_default)

    try:
        factory, configs = in_daemon_thread(load, time_limit, "kvstate-load-backend", f"importing backend {backend!r}")
    except Overran:
        raise FactoryError(f"importing backend {backend!r} did not finish within {time_limit:g} s") from None
    except SystemExit as error:
        raise FactoryError(f"backend {backend!r} called sys.exit({error.code!r}) while loading") from None
    except (FactoryError, KeyboardInterrupt):
        raise
    except BaseException as error:      # noqa: BLE001 - whatever loading raised is the backend's, by name
        raise FactoryError(f"loading backend {backend!r} failed: {error!r}") from None
    if check:
        check_backend(factory, configs, time_limit=time_limit)
    return factory, configs


def _require(obj, protocol, what: str) -> None:
    if not isinstance(obj, protocol):
        names = [n for n in dir(protocol) if not n.startswith("_") or n == "__len__"]
        missing = [n for n in names if not hasattr(obj, n)]
        raise FactoryError(f"{what} ({type(obj).__name__}) lacks {missing}: it does not speak {protocol.__name__}")
