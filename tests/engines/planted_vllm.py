"""Bugs planted in the vLLM adapter, one per subclass: ``kvstate conform`` must reject each."""

from __future__ import annotations

from kvstate.engines import vllm

from .planting import planted


class ResetIgnoredCache(vllm.VLLMCache):
    """clear() is reset_prefix_cache(), its refusal ignored: while a request holds a block vLLM
    keeps every hash, so a cleared key still hits."""

    def clear(self) -> None:
        self.pool.reset_prefix_cache()


class WritesSharedBlockContext(vllm.VLLMContext):
    """overwrite() writes into a block other holders share (no is_block_writable check)."""

    def _writable(self, first: int, last: int) -> None:
        return None


class ForkWithoutTouchContext(vllm.VLLMContext):
    """fork() copies the block table without touch(): two requests list blocks counted once."""

    def fork(self) -> "vllm.VLLMContext":
        self._open()
        return self.cache.register(type(self)(self.cache, list(self._tokens), list(self.blocks)))


class LeakedBlocksContext(vllm.VLLMContext):
    """close() forgets free_blocks(): the pool keeps the blocks out, no request lists them."""

    def close(self) -> None:
        self._open()
        self.blocks, self.closed = [], True
        self.cache.contexts.remove(self)


reset_ignored = planted(vllm.factory, ResetIgnoredCache, vllm.VLLMContext)
writes_shared_block = planted(vllm.factory, vllm.VLLMCache, WritesSharedBlockContext)
fork_without_touch = planted(vllm.factory, vllm.VLLMCache, ForkWithoutTouchContext)
leaked_blocks = planted(vllm.factory, vllm.VLLMCache, LeakedBlocksContext)
