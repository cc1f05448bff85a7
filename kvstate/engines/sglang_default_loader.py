"""SGLang 0.5.23's default prefix tree: ``UnifiedRadixCache`` over its compiled Rust TreeCore.

Which tree SGLang's scheduler builds is decided in ``sglang/srt/mem_cache/registry.py``
(``default_radix_cache_factory``): for a model with full attention and no storage tier,
``create_unified_radix_cache``, whose TreeCore is the Rust one bundled in the wheel
(``mem_cache/rust_tree_core/mem_cache.cpython-*.so``; ``unified_cache/tree_core_registry.py``:
``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` defaults to "rust", and the Python TreeCore is used
only off Linux, under a torch outside 2.11-2.14, for session caching or custom components). The
legacy ``radix_cache.RadixCache`` (``sglang_loader``) still ships, but no default path builds it.

The legacy tree loads from ten files; this one cannot: ``unified_radix_cache.py`` imports some 640
SGLang modules, so it is imported the ordinary way, which takes SGLang's own dependencies
(``DEPENDENCIES``, each ``pip install --no-deps``: SGLang's full requirement list pulls a CUDA torch).
Importing ``sglang`` runs its ``__init__``, which patches transformers in this process: use it in
a process of its own (the benchmark's). One module on that import chain
(``sglang/srt/multimodal/internvl_utils.py``) imports torchvision at its top; where no torchvision
is installed (no build loads against torch 2.13.0+cpu), an inert stand-in is served for that import
alone: reading a name gives another stand-in (the module reads ``InterpolationMode`` for a default
argument), calling anything raises ``StandInCalled`` and is recorded in ``STAND_IN_USES``, as every
kvstate stand-in is. The tree calls none of it. Once SGLang is imported the stand-in leaves
``sys.modules`` again (SGLang's modules keep what they imported): a later ``import torchvision`` fails
as before. The files that ran are checked against the release's RECORD (``_check_release_files``).
"""

from __future__ import annotations

import functools
import glob
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types

from ._loading import (STAND_IN_USES, EngineVersionError, StandInCalled, _package_folder, _record_sha256,
                       recorded_sha256s)
from .sglang_loader import LOADER, SUPPORTED_VERSION

# What ``import sglang.srt.mem_cache.unified_radix_cache`` needs past kvstate's own requirements and
# ``sglang==0.5.23`` itself, each installed with ``--no-deps`` (the versions it was measured with).
# Each with the name it is imported by, so a missing one is found before any of SGLang is imported.
REQUIRED = {"pybase64==1.5.1": "pybase64", "triton==3.9.0": "triton", "pillow==13.0.0": "PIL",
            "starlette==1.10.0": "starlette", "msgspec==0.23.0": "msgspec", "pyzmq==27.3.0": "zmq",
            "apache-tvm-ffi==0.1.15.post2": "tvm_ffi", "dill==0.4.1": "dill", "openai==3.63.0": "openai",
            "partial-json-parser==0.2.1.1.post7": "partial_json_parser",
            "compressed-tensors==0.20.1": "compressed_tensors", "gguf==0.19.0": "gguf", "loguru==0.8.0": "loguru",
            "sentencepiece==0.2.3": "sentencepiece", "ipython==8.12.3": "IPython", "orjson==3.8.3": "orjson",
            "transformers": "transformers"}
DEPENDENCIES = tuple(pin for pin in REQUIRED if "==" in pin)      # transformers comes with kvstate[hf]
INSTALL = f"pip install --no-deps sglang=={SUPPORTED_VERSION} " + " ".join(DEPENDENCIES)
TREE = "sglang.srt.mem_cache.unified_radix_cache"

# Every name of the torchvision stand-in read while SGLang imported (reads only: a call raises).
TORCHVISION_READS: list[str] = []


def _read(qualname: str, name: str) -> "_Inert":
    """``qualname.name`` read from a stand-in: recorded, and another stand-in (a dunder is absent)."""
    if name.startswith("__"):
        raise AttributeError(name)
    TORCHVISION_READS.append(f"{qualname}.{name}")
    return _Inert(f"{qualname}.{name}")


class _Inert:
    """A torchvision name: reading from it gives another, calling it raises."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __getattr__(self, name: str):
        return _read(self._qualname, name)

    def __call__(self, *args, **kwargs):
        STAND_IN_USES.append(self._qualname)
        raise StandInCalled(f"{self._qualname} is a stand-in (kvstate.engines.sglang_default_loader) and was called")

    def __repr__(self) -> str:
        return f"<stand-in {self._qualname}>"


class _InertModule(types.ModuleType):
    def __getattr__(self, name: str):
        return _read(self.__name__, name)


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` and its submodules as inert modules, while SGLang's tree is imported."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _InertModule(spec.name, "kvstate stand-in: reading gives stand-ins, calling raises StandInCalled")
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def missing_dependencies() -> list[str]:
    """The packages of ``REQUIRED`` this interpreter cannot import (none imported to find out)."""
    return [pin for pin, name in REQUIRED.items() if importlib.util.find_spec(name) is None]


@functools.cache     # once a process, as the legacy loader: conform builds a cache per run, each asking
def load_default_tree() -> types.SimpleNamespace:
    """SGLang's default tree and what building and driving it takes, imported from the installed
    release: ``UnifiedRadixCache``, ``CacheInitParams``, ``ComponentType``, ``MatchPrefixParams``,
    ``InsertParams``, ``EvictParams``, ``RadixKey``, ``select_tree_core_backend`` and the slot allocators
    ``TokenToKVPoolAllocator`` (page 1) and ``PagedTokenToKVPoolAllocator``.

    Raises ``EngineVersionError`` for another release, or for files other than its own: a ``sglang``
    folder found before the installed one (checked before anything is imported), or a module or the
    Rust extension whose sha256 differs from the distribution's RECORD (checked once imported, before
    anything is handed out); ``ImportError`` naming what is missing (and ``INSTALL``) where a dependency
    is. A failed import takes back the SGLang modules it left half made, so a second call fails alike
    (a failure is not cached); a success is, so the files are checked once a process."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"SGLang is not installed: {INSTALL}") from None
    if version != SUPPORTED_VERSION:
        raise EngineVersionError(f"SGLang {version} is installed; its default tree is loaded for {SUPPORTED_VERSION} "
                                 f"only: {INSTALL}")
    missing = missing_dependencies()
    if missing:     # refused before any of SGLang is imported
        raise ImportError(f"SGLang's default tree needs {', '.join(missing)}, not installed here: {INSTALL}")
    distribution = importlib.metadata.distribution("sglang")
    folder = _package_folder(LOADER, distribution)      # a source checkout first on sys.path: refused here
    before = set(sys.modules)
    stand_in = None
    if TREE not in sys.modules and importlib.util.find_spec("torchvision") is None:
        # transformers asks whether torchvision is there (and then its version) as SGLang's configs
        # import it: answered now, before the stand-in exists, its cached answer is the truth (absent).
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
        stand_in = _TorchvisionStandIn()
        sys.meta_path.insert(0, stand_in)
    try:
        importlib.import_module("torch")     # the extension links against libtorch: loaded first, as SGLang's loader does
        modules = {name: importlib.import_module(f"sglang.srt.mem_cache.{name}")
                   for name in ("unified_radix_cache", "cache_init_params", "unified_cache.component_type",
                                "unified_cache.tree_core_registry", "base_prefix_cache", "radix_cache",
                                "allocator.token", "allocator.paged", "rust_tree_core.extension")}
        _check_release_files(distribution, folder)
    except BaseException as error:
        for name in set(sys.modules) - before:      # what this call imported, half made or refused
            if name == "sglang" or name.startswith(("sglang.", "torchvision")):
                del sys.modules[name]
        if isinstance(error, ModuleNotFoundError):
            raise ImportError(f"SGLang's default tree needs {error.name!r}, which is not installed: {INSTALL}") from None
        raise
    finally:
        if stand_in is not None:
            sys.meta_path.remove(stand_in)
            for name in [name for name in sys.modules if name.split(".")[0] == "torchvision"]:
                del sys.modules[name]       # SGLang's modules keep theirs; a later import finds none, as before
    return types.SimpleNamespace(
        UnifiedRadixCache=modules["unified_radix_cache"].UnifiedRadixCache,
        CacheInitParams=modules["cache_init_params"].CacheInitParams,
        ComponentType=modules["unified_cache.component_type"].ComponentType,
        select_tree_core_backend=modules["unified_cache.tree_core_registry"].select_tree_core_backend,
        MatchPrefixParams=modules["base_prefix_cache"].MatchPrefixParams,
        InsertParams=modules["base_prefix_cache"].InsertParams,
        EvictParams=modules["base_prefix_cache"].EvictParams,
        RadixKey=modules["radix_cache"].RadixKey,
        TokenToKVPoolAllocator=modules["allocator.token"].TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=modules["allocator.paged"].PagedTokenToKVPoolAllocator,
    )


def _check_release_files(distribution: importlib.metadata.Distribution, folder: str) -> None:
    """Every SGLang module imported so far, and the Rust extension, is the release's own file: each lies
    in the installed package folder with the sha256 the distribution's RECORD lists for it."""
    recorded = recorded_sha256s(distribution)
    root = os.path.dirname(folder)
    files = {getattr(module, "__file__", None) for name, module in list(sys.modules.items())
             if name == "sglang" or name.startswith("sglang.")}
    files.update(glob.glob(os.path.join(folder, "srt", "mem_cache", "rust_tree_core", "mem_cache.*")))
    for path in sorted(filter(None, files)):
        relative = os.path.relpath(os.path.realpath(path), root).replace(os.sep, "/")
        if relative not in recorded:
            raise EngineVersionError(f"{path} ran as SGLang {SUPPORTED_VERSION}'s but its RECORD does not list it "
                                     f"with a sha256 (outside the installed package?)")
        with open(path, "rb") as file:
            found = _record_sha256(file.read())
        if found != recorded[relative]:
            raise EngineVersionError(f"{path} is not SGLang {SUPPORTED_VERSION}'s file: its sha256 {found} differs "
                                     f"from {recorded[relative]} in the distribution's RECORD (edited after "
                                     f"install?); pip install --force-reinstall --no-deps sglang=={SUPPORTED_VERSION}")


def build_default_tree(sg: types.SimpleNamespace, page: int, allocator):
    """``UnifiedRadixCache`` as ``registry.create_unified_radix_cache`` builds it for a model with full
    attention only (no host tier, storage, events or metrics), over ``allocator``; refused
    (``EngineVersionError``) where SGLang would run its Python TreeCore here instead of the Rust one."""
    params = sg.CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                                page_size=page)
    params.tree_components = (sg.ComponentType.FULL,)
    backend = sg.select_tree_core_backend(params)
    if backend != "rust":
        raise EngineVersionError(f"SGLang would use its {backend} TreeCore here, not its default Rust one "
                                 f"(see sglang/srt/mem_cache/unified_cache/tree_core_registry.py)")
    tree = sg.UnifiedRadixCache(params)
    core = type(tree.tree_core).__name__
    if core != "RustUnifiedTreeCore":
        raise EngineVersionError(f"UnifiedRadixCache built a {core}, not the Rust TreeCore")
    return tree
