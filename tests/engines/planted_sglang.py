"""Bugs planted in the SGLang adapter, one per subclass: ``kvstate conform`` must reject each."""

from __future__ import annotations

from kvstate.engines import sglang

from .planting import planted


class LeakedLockContext(sglang.SGLangContext):
    """close() skips the engine's dec_lock_ref: the node stays locked, so clear() cannot evict it."""

    def close(self) -> None:
        self._open()
        self._free_private_from(0)
        self.node, self.slots, self.closed = None, [], True
        self.cache.contexts.remove(self)


class WritesIntoTreeContext(sglang.SGLangContext):
    """overwrite() writes into the tree's slots instead of copying them first."""

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv, start)
        if tokens:
            self.cache.store(self.slots[start:start + len(tokens)], values)
            self._tokens[start:start + len(tokens)] = tokens


leaked_lock = planted(sglang.factory, sglang.SGLangCache, LeakedLockContext)
writes_into_tree = planted(sglang.factory, sglang.SGLangCache, WritesIntoTreeContext)


class LeakedPrivatePagesContext(sglang.SGLangContext):
    """close() never frees the request's private pages, as a scheduler that forgot ``free`` of a
    finished request's uncached slots (review s66/review1, finding 3: its ``plant/leaky_sglang.py``)."""

    def _let_go_of_private(self) -> None:
        pass


leaked_private_pages = planted(sglang.factory, sglang.SGLangCache, LeakedPrivatePagesContext)
