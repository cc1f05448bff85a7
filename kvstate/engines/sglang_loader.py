"""Load SGLang's released radix cache on a CPU machine, its own files unmodified.

``import sglang.srt.mem_cache.radix_cache`` runs ``sglang/__init__.py`` and the server's utility
module, which drag in orjson, pybase64, triton, starlette, msgspec, pyzmq, IPython and torchvision
(which then fails against torch 2.13). The cache itself needs none of them: this loader executes
the real files below from the installed package and hands every other module they import an
inert stand-in whose every attribute raises ``StandInCalled`` when called, so a run that touched
one would fail loudly rather than pass on a stand-in's behalf (the machinery, shared with the
other engines' loaders, is ``kvstate.engines._loading``).

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
``EngineVersionError``, since the stand-in list above was read from that release's files; so is a
``sglang`` folder other than the installed one, or a real file not matching the RECORD's sha256.
"""

from __future__ import annotations

import types

from ._loading import STAND_IN_USES, EngineLoader, EngineVersionError, StandInCalled, _StandIn  # noqa: F401

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

LOADER = EngineLoader("sglang", SUPPORTED_VERSION, REAL, STAND_INS, ANSWERS, REEXPORTS)
installed_version = LOADER.installed_version
require_supported = LOADER.require_supported
load_modules = LOADER.load


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
