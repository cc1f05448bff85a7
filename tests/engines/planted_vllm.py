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


reset_ignored = planted(vllm.factory, ResetIgnoredCache, vllm.VLLMContext)
writes_shared_block = planted(vllm.factory, vllm.VLLMCache, WritesSharedBlockContext)
