"""Build a factory around an adapter with one bug planted (``planted_sglang``, ``planted_vllm``)."""

from __future__ import annotations


def planted(adapter_factory, cache_class, context_class):
    """A factory of ``cache_class`` caches whose contexts are ``context_class``, in the adapter's configurations."""
    cache = type(f"Planted{cache_class.__name__}", (cache_class,), {"context_class": context_class})

    def factory(config):
        return cache(config)

    factory.configs = adapter_factory.configs
    factory.any_page_size = False
    return factory
