"""Load vLLM 0.33.0's v1 block pool on a CPU machine, its own files unmodified.

``import vllm.v1.core.kv_cache_manager`` runs ``vllm.distributed`` (pyzmq, the process groups),
``vllm.config`` and ``vllm.v1.request`` (the sampling, multimodal and structured-output stacks),
none installable without vLLM's CUDA dependency set. The prefix cache's data structures live in two
files that need none of it: this loader executes them from the installed package and gives every
other module they import an inert stand-in that raises ``StandInCalled`` when used (the same
machinery as ``sglang_loader``).

Real files, executed as installed (``vllm/...``):
    v1/core/block_pool.py (``BlockPool``: the free queue, the hash-to-block map, ``touch``,
    ``get_new_blocks``, ``cache_full_blocks``, ``free_blocks``, ``evict_blocks``),
    v1/core/kv_cache_utils.py (``KVCacheBlock``, ``FreeKVCacheBlockQueue``, ``hash_block_tokens``,
    ``init_none_hash``), utils/math_utils.py

Stand-ins (module: names; why the block pool never calls them here):
    vllm.distributed.kv_events: MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored,
        KVCacheEvent -- KV events, built only when ``enable_kv_cache_events`` (off)
    vllm.multimodal.utils: get_mm_features_in_window -- multimodal extra keys (no images here)
    vllm.v1.core.kv_cache_metrics: KVCacheMetricsCollector -- metrics, ``metrics_collector=None``
    vllm.v1.request: Request -- the scheduler's request, annotations only (the adapter passes an
        object with the ``block_hashes`` ``cache_full_blocks`` reads)
    vllm.envs -- read only for KV event hash formats (events off)
    vllm.config: VllmConfig -- engine sizing helpers, annotations only
    vllm.utils.hashing: xxhash, xxhash_cbor -- only compared against (the adapter hashes with
        ``sha256`` over pickle, vLLM's ``sha256`` written with hashlib: vLLM's needs cbor2)
    vllm.v1.kv_cache_interface: KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, MambaSpec,
        UniformTypeKVCacheSpecs, iter_layer_specs -- spec types of the manager layers above the pool
    vllm.v1.kv_cache_spec_registry: KVCacheSpecRegistry -- same
    vllm.v1.utils: tensor_data -- prompt-embedding hashing (none here)

Answered, not raised: ``vllm.logger.init_logger(name)`` -> ``logging.getLogger(name)`` (both files
call it at import).

Not run, and why: ``vllm/v1/core/kv_cache_manager.py`` and ``single_type_kv_cache_manager.py``
import ``vllm.distributed`` (pyzmq), ``vllm.v1.request`` (sampling params, multimodal inputs,
structured output, metrics) and ``kv_cache_coordinator``; stand-ins for those would be stand-ins
for the scheduler itself, not for GPU-facing modules. The adapter therefore drives the block
pool as ``FullAttentionManager`` does (the longest run of cached block hashes, ``touch``,
``cache_full_blocks``, ``free_blocks`` in reverse order).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading
import types

from .sglang_loader import EngineVersionError, StandInCalled, _StandIn  # noqa: F401  (shared machinery)

SUPPORTED_VERSION = "0.33.0"

REAL = ("vllm.utils.math_utils", "vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool")

STAND_INS: dict[str, tuple[str, ...]] = {
    "vllm.distributed.kv_events": ("MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent"),
    "vllm.multimodal.utils": ("get_mm_features_in_window",),
    "vllm.v1.core.kv_cache_metrics": ("KVCacheMetricsCollector",),
    "vllm.v1.request": ("Request",),
    "vllm.envs": (),
    "vllm.config": ("VllmConfig",),
    "vllm.utils.hashing": ("xxhash", "xxhash_cbor"),
    "vllm.v1.kv_cache_interface": ("KVCacheConfig", "KVCacheGroupSpec", "KVCacheSpec", "MambaSpec",
                                   "UniformTypeKVCacheSpecs", "iter_layer_specs"),
    "vllm.v1.kv_cache_spec_registry": ("KVCacheSpecRegistry",),
    "vllm.v1.utils": ("tensor_data",),
}

ANSWERS: dict[tuple[str, str], object] = {("vllm.logger", "init_logger"): logging.getLogger}


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_supported(version: str | None) -> None:
    if version is None:
        raise ImportError("vllm is not installed: pip install --no-deps vllm==" + SUPPORTED_VERSION)
    if version != SUPPORTED_VERSION:
        raise EngineVersionError(f"vllm {version} is installed; kvstate.engines loads vllm "
                                 f"{SUPPORTED_VERSION} only (its stand-ins were read from that release)")


def _modules_named() -> set[str]:
    return set(REAL) | set(STAND_INS) | {owner for owner, _ in ANSWERS}


def _is_parent(name: str) -> bool:
    return any(other.startswith(name + ".") for other in _modules_named())


class _Finder:
    def __init__(self, root: str):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name != "vllm" and not name.startswith("vllm."):
            return None
        if name in _modules_named() or _is_parent(name):
            return importlib.machinery.ModuleSpec(name, self, is_package=_is_parent(name))
        raise ImportError(f"{name} is neither a real file nor a stand-in of kvstate.engines.vllm_loader "
                          f"(vllm {SUPPORTED_VERSION}): the release's imports changed", name=name)

    def create_module(self, spec):
        name = spec.name
        if name in REAL:
            return None
        module = types.ModuleType(name)
        if _is_parent(name):
            module.__path__ = [os.path.join(self.root, *name.split(".")[1:])] if name not in STAND_INS else []
        for attr in STAND_INS.get(name, ()):
            setattr(module, attr, _StandIn(f"{name}.{attr}"))
        for (owner, attr), value in ANSWERS.items():
            if owner == name:
                setattr(module, attr, value)
        return module

    def exec_module(self, module):
        name = module.__name__
        if name not in REAL:
            return
        path = os.path.join(self.root, *name.split(".")[1:]) + ".py"
        module.__file__ = path
        with open(path, "rb") as source:
            exec(compile(source.read(), path, "exec"), module.__dict__)


_lock = threading.Lock()
_loaded: dict[str, types.ModuleType] = {}


def load_modules() -> dict[str, types.ModuleType]:
    """The real modules of ``REAL``, loaded once per process; ``sys.modules`` is left as it was."""
    with _lock:
        if _loaded:
            return _loaded
        require_supported(installed_version())
        spec = importlib.util.find_spec("vllm")
        root = list(spec.submodule_search_locations)[0]
        finder = _Finder(root)
        saved = {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")}
        for n in saved:
            del sys.modules[n]
        sys.meta_path.insert(0, finder)
        try:
            for name in REAL:
                _loaded[name] = importlib.import_module(name)
        except BaseException:
            _loaded.clear()
            raise
        finally:
            sys.meta_path.remove(finder)
            for n in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
                del sys.modules[n]
            sys.modules.update(saved)
        return _loaded


def load_block_pool() -> tuple[types.ModuleType, types.ModuleType]:
    """vLLM's own ``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py`` modules."""
    modules = load_modules()
    return modules["vllm.v1.core.block_pool"], modules["vllm.v1.core.kv_cache_utils"]
