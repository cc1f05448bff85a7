"""Bugs planted in the vLLM adapter, one per subclass: ``kvstate conform`` must reject each."""

from __future__ import annotations

from kvstate.engines import vllm


class ResetIgnoredCache(vllm.VLLMCache):
    """clear() is reset_prefix_cache(), its refusal ignored: while a request holds a block vLLM
    keeps every hash, so a cleared key still hits."""

    def clear(self) -> None:
        self.pool.reset_prefix_cache()


class WritesSharedBlockContext(vllm.VLLMContext):
    """overwrite() writes into a block other holders share (no is_block_writable check)."""

    def _writable(self, first: int, last: int) -> None:
        return None


def _planted(context_class, base=vllm.VLLMCache):
    class Cache(base):
        pass

    Cache.context_class = context_class

    def factory(config):
        return Cache(config)

    factory.configs = vllm.factory.configs
    factory.any_page_size = False
    return factory


reset_ignored = _planted(vllm.VLLMContext, ResetIgnoredCache)
writes_shared_block = _planted(WritesSharedBlockContext)
