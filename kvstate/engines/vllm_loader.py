"""Load vLLM 0.33.0's v1 block pool on a CPU machine, its own files unmodified.

``import vllm.v1.core.kv_cache_manager`` runs ``vllm.distributed`` (pyzmq, the process groups),
``vllm.config`` and ``vllm.v1.request`` (the sampling, multimodal and structured-output stacks),
none installable without vLLM's CUDA dependency set. The prefix cache's data structures live in two
files that need none of it: this loader executes them from the installed package and gives every
other module they import an inert stand-in that raises ``StandInCalled`` when used (the same
machinery as ``sglang_loader``: ``kvstate.engines._loading``).

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

import logging
import types

from ._loading import EngineLoader, EngineVersionError, StandInCalled  # noqa: F401  (the tests name them here)

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

LOADER = EngineLoader("vllm", SUPPORTED_VERSION, REAL, STAND_INS, ANSWERS)
installed_version = LOADER.installed_version
require_supported = LOADER.require_supported
load_modules = LOADER.load


def load_block_pool() -> tuple[types.ModuleType, types.ModuleType]:
    """vLLM's own ``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py`` modules."""
    modules = load_modules()
    return modules["vllm.v1.core.block_pool"], modules["vllm.v1.core.kv_cache_utils"]
