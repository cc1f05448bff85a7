"""Bugs planted in the adapter of SGLang's default tree (``kvstate.engines.sglang_default``), one per
factory: ``kvstate conform`` must reject each. The first three are ``planted_sglang``'s contexts on
the default tree; two get wrong what this tree does differently from the legacy one (the tree frees a
request's duplicate slots inside ``insert``); three show only under pressure, on the reclaiming pool
(one refuses early; two an audit found passing in pools no run fills)."""

from __future__ import annotations

from kvstate.engines import sglang_default

from .planted_sglang import LeakedLockContext, LeakedPrivatePagesContext, WritesIntoTreeContext
from .planting import planted

leaked_lock = planted(sglang_default.factory, sglang_default.SGLangDefaultCache, LeakedLockContext)
writes_into_tree = planted(sglang_default.factory, sglang_default.SGLangDefaultCache, WritesIntoTreeContext)
leaked_private_pages = planted(sglang_default.factory, sglang_default.SGLangDefaultCache, LeakedPrivatePagesContext)


class NoPrevPrefixCache(sglang_default.SGLangDefaultCache):
    """``insert`` without ``prev_prefix_len``: the tree frees the slots of every position it already held,
    the ones the request holds from the tree included (the default tree's, freed under it)."""

    def _insert(self, ctx, aligned: int) -> None:
        import torch

        value = torch.tensor(ctx.slots[:aligned], dtype=torch.int64)
        self.tree.insert(self.rc.InsertParams(key=self._key(ctx._tokens[:aligned]), value=value))


class FreesDuplicatesTwiceCache(sglang_default.SGLangDefaultCache):
    """The legacy adapter's own free of the duplicates after the tree freed them: each freed twice."""

    def _insert(self, ctx, aligned: int) -> None:
        before = self.allocator.available_size()
        super()._insert(ctx, aligned)
        if self.allocator.available_size() > before:        # the tree freed some: free what it freed again
            self.free_slots(ctx.slots[ctx.protected:aligned:self.page])


def _factory(cache_class):
    def factory(config):
        return cache_class(config)

    factory.configs = sglang_default.factory.configs
    factory.any_page_size = False
    return factory


class RefusesEarlyCache(sglang_default.SGLangDefaultReclaimingCache):
    """Under pressure, counts no page of the tree's unlocked nodes as reclaimable: refuses where
    SGLang's ``evict`` would have made room."""

    def _reclaimable_pages(self) -> int:
        return 0


class MatchWithoutLockCache(sglang_default.SGLangDefaultReclaimingCache):
    """``match`` takes the hit's slots without locking its node (audit s71): the tree may evict them
    under the request. Seen only under pressure, where eviction runs."""

    def match(self, tokens):
        query = list(tokens)
        result = self.tree.match_prefix(self.rc.MatchPrefixParams(key=self._key(query)))
        hit = result.device_prefix_len
        if hit == 0:
            return self.allocate(), 0
        slots = self.tree.path_device_indices(result.last_device_node).tolist()
        return self.register(self.context_class(self, query[:hit], slots, hit, None)), hit


class RetainKeepsOwnSlotsCache(sglang_default.SGLangDefaultReclaimingCache):
    """``retain`` keeps the request's own slots after the insert instead of reading the tree's back (audit
    s71): where the tree already held positions it freed the request's slots for them, which the request
    still reads. In a pool no run fills a freed slot is never reused at page 1; under pressure it is."""

    def retain(self, ctx) -> None:
        aligned = len(ctx) - len(ctx) % self.page
        if len(ctx) == 0 or aligned <= ctx.protected:
            return super().retain(ctx)
        self.own(ctx)
        self._insert(ctx, aligned)
        held = self.hold(self.node_for(ctx._tokens[:aligned]))
        if ctx.node is not None:
            self.let_go(ctx.node)
        ctx.node, ctx.protected = held, aligned


no_prev_prefix = _factory(NoPrevPrefixCache)
match_without_lock = _factory(MatchWithoutLockCache)
retain_keeps_own_slots = _factory(RetainKeepsOwnSlotsCache)
frees_duplicates_twice = _factory(FreesDuplicatesTwiceCache)
refuses_early = _factory(RefusesEarlyCache)
