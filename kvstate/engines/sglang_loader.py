"""Load SGLang's released radix cache on a CPU machine, its own files unmodified.

``import sglang.srt.mem_cache.radix_cache`` runs ``sglang/__init__.py`` and the server's utility
module, which drag in orjson, pybase64, triton, starlette, msgspec, pyzmq, IPython and torchvision
(which then fails against torch 2.13). The cache itself needs none of them: this loader executes
the real files below from the installed package and hands every other module they import an
inert stand-in whose every attribute raises ``StandInCalled`` when called, so a run that touched
one would fail loudly rather than pass on a stand-in's behalf.

Real files, executed as installed (``sglang/srt/mem_cache/...``):
    radix_cache.py, base_prefix_cache.py, cache_init_params.py, events.py, utils.py,
    evict_policy.py, unified_cache/component_type.py, and the slot allocators the server pairs
    with the tree: allocator/base.py, allocator/token.py (page size 1), allocator/paged.py

Stand-ins (module: names the real files import from it; why the cache never calls them here):
    sglang.kernels.ops.kvcache.mla_buffer: the nine MLA buffer kernels -- GPU kernels, re-exported
        by mem_cache/utils.py for the memory pools, never called by the tree
    sglang.srt.environ: envs -- read only by maybe_init_custom_mem_pool (Mooncake pools)
    sglang.srt.mem_cache.cpp_utils.native_hash: get_native_hash -- page hashing for storage and
        KV events, both off
    sglang.srt.disaggregation.kv_events: AllBlocksCleared, BlockRemoved, BlockStored,
        StorageMedium, kv_event_namespace_seed, namespaced_block_hash -- KV event payloads,
        built only when ``enable_kv_cache_events`` (off)
    sglang.srt.mem_cache.memory_pool: ReqToTokenPool -- the request-to-slot table, annotations only
    sglang.srt.observability.metrics_collector: STAT_LOGGER_ROLE_RADIX_CACHE,
        RadixCacheMetricsCollector, radix_cache_metric_labels, resolve_collector_class --
        Prometheus metrics, built only when ``enable_metrics`` (off)
    sglang.srt.runtime_context: get_observability, get_parallel -- server context, metrics only
    sglang.srt.utils.common: ceil_align -- used by RadixCache.checkpoint (a server request path
        the adapter does not use)
    sglang.kernels.ops.memory.allocator: alloc_decode_kernel, alloc_extend_kernel -- Triton
        kernels of the paged allocator's batched alloc_extend/alloc_decode; the adapter allocates
        with ``alloc`` (whole pages), which is plain torch
    sglang.srt.utils: get_num_new_pages, next_power_of_2 -- batched-alloc helpers (same paths)

Platform probes, answered for this CPU machine rather than raising (the paged allocator asks
them in ``__init__`` and at import):
    sglang.srt.platforms: current_platform.capabilities.supports_triton = False
    sglang.srt.utils: is_hip() -> False; get_bool_env_var(name) -> False (SGLANG_DEBUG_MEMORY_POOL off)

Any other ``sglang`` module a real file imports at load time is refused (``ImportError`` naming
it), so a new dependency in another release shows here, not as a silent stand-in. Only
``SUPPORTED_VERSION`` is loaded: another installed version is refused with
``EngineVersionError``, since the stand-in list above was read from that release's files.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import threading
import types

from kvstate.spec.errors import ConfigError

SUPPORTED_VERSION = "0.5.23"

REAL = (                # in load order: the allocator's base first, for base_prefix_cache's import
    "sglang.srt.mem_cache.allocator.base",
    "sglang.srt.mem_cache.allocator.token",
    "sglang.srt.mem_cache.allocator.paged",
    "sglang.srt.mem_cache.evict_policy",
    "sglang.srt.mem_cache.unified_cache.component_type",
    "sglang.srt.mem_cache.utils",
    "sglang.srt.mem_cache.events",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.radix_cache",
)

_MLA = ("get_mla_kv_buffer_kernel", "get_mla_kv_buffer_triton", "set_mla_kv_buffer_dcp_sharded_triton",
        "set_mla_kv_buffer_fp8_quant_kernel", "set_mla_kv_buffer_kernel", "set_mla_kv_buffer_triton",
        "set_mla_kv_buffer_triton_fp8_quant", "set_mla_kv_scale_buffer_kernel", "set_mla_kv_scale_buffer_triton")

STAND_INS: dict[str, tuple[str, ...]] = {
    "sglang.kernels.ops.kvcache.mla_buffer": _MLA,
    "sglang.srt.environ": ("envs",),
    "sglang.srt.mem_cache.cpp_utils.native_hash": ("get_native_hash",),
    "sglang.srt.disaggregation.kv_events": ("AllBlocksCleared", "BlockRemoved", "BlockStored", "StorageMedium",
                                            "kv_event_namespace_seed", "namespaced_block_hash"),
    "sglang.kernels.ops.memory.allocator": ("alloc_decode_kernel", "alloc_extend_kernel"),
    "sglang.srt.utils": ("get_num_new_pages", "next_power_of_2"),
    "sglang.srt.mem_cache.memory_pool": ("ReqToTokenPool",),
    "sglang.srt.observability.metrics_collector": ("STAT_LOGGER_ROLE_RADIX_CACHE", "RadixCacheMetricsCollector",
                                                   "radix_cache_metric_labels", "resolve_collector_class"),
    "sglang.srt.runtime_context": ("get_observability", "get_parallel"),
    "sglang.srt.utils.common": ("ceil_align",),
}


class _CpuPlatform:
    """What ``sglang.srt.platforms.current_platform`` answers on this machine: no Triton."""

    class capabilities:
        supports_triton = False


# Probes answered, not raised: (module, name) -> the value the real module gives on a CPU machine.
ANSWERS: dict[tuple[str, str], object] = {
    ("sglang.srt.platforms", "current_platform"): _CpuPlatform(),
    ("sglang.srt.utils", "is_hip"): lambda: False,
    ("sglang.srt.utils", "get_bool_env_var"): lambda name, default="false": False,
}

# Names reexported by a package's __init__ that the loader does not run: (package, name, real module).
REEXPORTS = (("sglang.srt.mem_cache.allocator", "BaseTokenToKVPoolAllocator", "sglang.srt.mem_cache.allocator.base"),)


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
        raise StandInCalled(f"{self._qualname} is a stand-in (kvstate.engines.sglang_loader) and was called")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        STAND_IN_USES.append(f"{self._qualname}.{name}")
        raise StandInCalled(f"{self._qualname}.{name} read: {self._qualname} is a stand-in")

    def __repr__(self) -> str:
        return f"<stand-in {self._qualname}>"


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_supported(version: str | None) -> None:
    """``ImportError`` without sglang, ``EngineVersionError`` for any release but ``SUPPORTED_VERSION``."""
    if version is None:
        raise ImportError("sglang is not installed: pip install --no-deps sglang==" + SUPPORTED_VERSION)
    if version != SUPPORTED_VERSION:
        raise EngineVersionError(f"sglang {version} is installed; kvstate.engines loads sglang "
                                 f"{SUPPORTED_VERSION} only (its stand-ins were read from that release)")


def _package_root() -> str:
    spec = importlib.util.find_spec("sglang")      # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed: pip install --no-deps sglang==" + SUPPORTED_VERSION)
    return list(spec.submodule_search_locations)[0]


def _bare_package(name: str, root: str) -> types.ModuleType:
    """A package module whose ``__init__`` is not run: only a path for its submodules."""
    module = types.ModuleType(name)
    module.__path__ = [os.path.join(root, *name.split(".")[1:])]
    module.__package__ = name
    return module


def _stand_in_module(name: str, names: tuple[str, ...]) -> types.ModuleType:
    module = types.ModuleType(name, "kvstate stand-in: every attribute raises StandInCalled when used")
    for attr in names:
        setattr(module, attr, _StandIn(f"{name}.{attr}"))
    for (owner, attr), value in ANSWERS.items():
        if owner == name:
            setattr(module, attr, value)
    return module


class _Finder:
    """Resolves ``sglang.*`` during the load only: real files, stand-ins, bare packages, else refuses."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name != "sglang" and not name.startswith("sglang."):
            return None
        if name in STAND_INS or name in REAL or _is_parent(name) or name in _answer_modules():
            return importlib.machinery.ModuleSpec(name, self, is_package=_is_parent(name))
        raise ImportError(f"{name} is neither a real file nor a stand-in of kvstate.engines.sglang_loader "
                          f"(sglang {SUPPORTED_VERSION}): the release's imports changed", name=name)

    def create_module(self, spec):
        name = spec.name
        if name in STAND_INS or name in _answer_modules():
            module = _stand_in_module(name, STAND_INS.get(name, ()))
            if _is_parent(name):            # a stand-in that is also a package (sglang.srt.utils)
                module.__path__ = []
            return module
        if name in REAL:
            return None
        return _bare_package(name, self.root)

    def exec_module(self, module):
        name = module.__name__
        if name not in REAL:
            return
        path = os.path.join(self.root, *name.split(".")[1:]) + ".py"
        module.__file__ = path
        with open(path, "rb") as source:
            code = compile(source.read(), path, "exec")
        exec(code, module.__dict__)


def _answer_modules() -> set[str]:
    return {owner for owner, _ in ANSWERS}


def _is_parent(name: str) -> bool:
    return any(other.startswith(name + ".") for other in (*REAL, *STAND_INS, *_answer_modules()))


_lock = threading.Lock()
_loaded: dict[str, types.ModuleType] = {}


def load_modules() -> dict[str, types.ModuleType]:
    """The real modules of ``REAL``, by name, loaded once per process.

    ``sys.modules`` is left as it was: the loaded modules hold what they imported, and a real
    ``import sglang`` elsewhere in the process is not shadowed.
    """
    with _lock:
        if _loaded:
            return _loaded
        require_supported(installed_version())
        finder = _Finder(_package_root())
        saved = {name: module for name, module in sys.modules.items()
                 if name == "sglang" or name.startswith("sglang.")}
        for name in saved:
            del sys.modules[name]
        sys.meta_path.insert(0, finder)
        try:
            for name in REAL:
                _loaded[name] = importlib.import_module(name)
                for package, attr, source in REEXPORTS:
                    if source == name:
                        setattr(sys.modules[package], attr, getattr(_loaded[name], attr))
        except BaseException:
            _loaded.clear()
            raise
        finally:
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
                del sys.modules[name]
            sys.modules.update(saved)
        return _loaded


def load_allocators() -> tuple[type, type]:
    """SGLang's own slot allocators: ``TokenToKVPoolAllocator`` (page size 1) and
    ``PagedTokenToKVPoolAllocator``."""
    modules = load_modules()
    return (modules["sglang.srt.mem_cache.allocator.token"].TokenToKVPoolAllocator,
            modules["sglang.srt.mem_cache.allocator.paged"].PagedTokenToKVPoolAllocator)


def load_radix_cache() -> types.ModuleType:
    """SGLang's own ``sglang/srt/mem_cache/radix_cache.py`` module (``RadixCache``, ``RadixKey``,
    ``TreeNode``; the parameter classes come with it: ``MatchPrefixParams``, ``InsertParams``,
    ``EvictParams``)."""
    return load_modules()["sglang.srt.mem_cache.radix_cache"]
