"""SGLang 0.5.23's own ``RadixCache`` and slot allocators, driven through the kvstate protocol.

    python -m kvstate conform kvstate.engines.sglang

The engine is SGLang's released code, loaded unmodified by ``kvstate.engines.sglang_loader``
(which lists every stand-in). The adapter plays the part of SGLang's scheduler, with the
engine's own operations only:

- a context is a request: its row of slot ids (``req_to_token``), the first ``protected``
  positions owned by the tree and held by ``inc_lock_ref`` on the tree node that ends them, the
  rest in private pages from the engine's allocator (``alloc``, whole pages; ``free``);
- ``match`` is ``match_prefix`` (page-aligned by the engine) and a lock on the node it returns;
- ``retain`` is what ``RadixCache.checkpoint`` does for a running request: ``insert`` of the
  page-aligned key, ``free`` of the request's slots the tree already held (the engine keeps its
  old slots), the row repointed at the tree's slots, the lock moved to the new node;
- ``close`` is ``dec_lock_ref`` and ``free`` of the private pages; ``clear`` first gives every
  live context private copies of its tree-owned positions (SGLang flushes only an idle cache),
  then ``evict`` of everything;
- writing into a tree-owned position (``overwrite``, ``truncate`` into it) copies those pages
  into private ones and moves the lock to the ancestor node that ends before them (SGLang never
  writes into the tree; a copy is how the adapter keeps the tree's values intact);
- ``fork`` locks the same node (pages shared through the prefix cache) and copies the private
  pages.

The K/V values live in the adapter's own array, indexed by the engine's slot ids: the engine
decides which slots, the adapter only stores bytes there.

Declared semantics, from the engine's code: ``match`` is ``token`` at page size 1 and
``block`` (``block_tokens`` = page size) at 16 and 64 (``RadixKey.page_aligned`` and page-wise
child keys); ``values="prefix"`` (an insert of a key the tree holds keeps the old slots: the
engine assumes one prefix, one K/V); no entry bound (the tree evicts only for memory:
``max_entries`` is set past anything a run retains). Two kinds of pool: in the first
configurations, a pool larger than any run needs (``on_full`` ``fallback``, never reached: the
adapter raises ``PoolExhausted`` rather than evict behind the suite's back); in
``reclaiming_configs``, a pool of the declared size whose tree evicts for room as SGLang's
scheduler does (``on_full="reclaim"``; ``kvstate.engines.sglang_reclaim``, which also says how its
contexts hold pages).

Observation: the black-box tier, because the others cannot be filled from SGLang's own state, and
the pages allocated and freed, which can: the adapter counts the pages ``alloc`` hands out, and
SGLang's allocator says how many are out (its size less ``available_size()``), so invariant 6
(empty after every context is closed and the cache cleared) sees a page never given back.

- pages: SGLang keeps no count per page. A tree node's ``lock_ref`` counts the requests locked at
  or below it, and a request's private slots have no count at all; SGLang has no fork, so the
  adapter's ``fork`` copies the private pages. The pages tier brings the checks that a fork
  allocates nothing and one write copies one page (copy-on-write, kvstate's design): they would
  fail on a promise SGLang never made, and passing them would take refcounts the adapter keeps
  itself, which is kvstate's design again, not the engine's.
- tree (entries in eviction order) and shape: the tree does not record which keys were inserted.
  ``match_prefix`` splits a node where a query diverges, so a node boundary is not a key; a
  retained prefix of a retained key leaves only such a boundary; nodes never merge again (the
  shape invariant wants a node with one child and no entry collapsed); recency is per node.

Left out: snapshots, thread safety. Eviction under memory pressure is checked under ``reclaim``
only (SGLang evicts leaf *nodes* by its own policy, so part of an entry can go while its prefix
stays; the suite's ``evict`` rule drops whole entries).
"""

from __future__ import annotations

import dataclasses
from array import array

import torch

from kvstate.spec import Config, Layout
from kvstate.spec.errors import EmptyContextError
from kvstate.spec.layout import check_tokens
from kvstate.spec.observation import Observation, black_box
from kvstate.spec.semantics import reclaims

from .context_base import ENTRY_BOUND, EngineCache, EngineContext, PoolExhausted
from .sglang_loader import SUPPORTED_VERSION, load_allocators, load_radix_cache

POOL_PAGES = 1 << 14          # the allocator's pages: more than any run of the suite holds at once
RECLAIM_POOL_TOKENS = 24      # the reclaiming configurations' pools: small enough that runs evict
RECLAIM_POOL_PAGES = 12


class SGLangContext(EngineContext):
    """One request: tokens, its row of slot ids, the tree-owned prefix and the lock on it."""

    def __init__(self, cache: "SGLangCache", tokens: list[int], slots: list[int], protected: int, node):
        super().__init__(cache, tokens)
        self.slots = slots
        self.protected = protected      # positions [0, protected) are the tree's, held by the lock on node
        self.node = node                # what ``SGLangCache.hold`` gave for that lock (None: no lock)

    def _slots(self, start: int, stop: int) -> list[int]:
        return self.slots[start:stop]

    def extend(self, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv)
        if not tokens:
            return
        page = self.cache.page
        slots = []
        length = len(self)
        room = (-length) % page                  # free positions in the last, private, partial page
        if room:
            slots += [self.slots[-1] + 1 + i for i in range(min(room, len(tokens)))]
        rest = len(tokens) - len(slots)
        if rest:
            slots += self.cache.alloc_pages(-(-rest // page))[:rest]
        self.cache.store(slots, values)
        self.slots += slots
        self._tokens += tokens

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv, start)
        if not tokens:
            return
        if start < self.protected:
            self._detach(start - start % self.cache.page, self.protected)
        self.cache.store(self.slots[start:start + len(tokens)], values)
        self._tokens[start:start + len(tokens)] = tokens

    def _detach(self, boundary: int, copy_to: int) -> None:
        """Own positions [boundary, copy_to) privately (copies of the tree's slots) and hold the
        tree only up to ``boundary`` (page-aligned), through the node that ends there."""
        self._hold_to(boundary, self._copies(boundary, copy_to))

    def _copies(self, boundary: int, copy_to: int) -> list[int]:
        """Fresh private slots holding copies of positions [boundary, copy_to). Taken before anything
        changes: the allocation is the one step that can be refused."""
        cache, count = self.cache, copy_to - boundary
        if count <= 0:
            return []
        fresh = cache.alloc_pages(-(-count // cache.page))[:count]
        cache.store(fresh, cache.values_at(self.slots[boundary:copy_to]))
        return fresh

    def _hold_to(self, boundary: int, fresh: list[int]) -> None:
        """Positions from ``boundary`` on in the ``fresh`` private slots; the tree held up to ``boundary``."""
        cache = self.cache
        self.slots[boundary:boundary + len(fresh)] = fresh
        node = cache.node_for(self._tokens[:boundary]) if boundary else None
        held = cache.hold(node) if node is not None else None
        if self.node is not None:
            cache.let_go(self.node)
        self.node, self.protected = held, boundary

    def fork(self) -> "SGLangContext":
        self._open()
        cache = self.cache
        private = len(self) - self.protected
        slots = list(self.slots[:self.protected])
        if private:          # first: a refused fork changes nothing (no lock taken yet)
            fresh = cache.alloc_pages(-(-private // cache.page))[:private]
            cache.store(fresh, cache.values_at(self.slots[self.protected:]))
            slots += fresh
        held = cache.hold_again(self.node) if self.node is not None else None
        return cache.register(cache.context_class(cache, list(self._tokens), slots, self.protected, held))

    def _free_private_from(self, position: int) -> None:
        """Free the private pages that hold only positions >= ``position``."""
        page = self.cache.page
        first = max(self.protected, -(-position // page) * page)
        self.cache.free_slots(self.slots[first::page])

    def truncate(self, n: int) -> None:
        self._check_truncate(n)
        boundary = n - n % self.cache.page
        # Into the tree's part: the copies of [boundary, n) first, so a refusal changes nothing.
        fresh = self._copies(boundary, n) if n < self.protected else None
        self._free_private_from(n)
        del self.slots[n:]
        del self._tokens[n:]
        if fresh is not None:
            self._hold_to(boundary, fresh)

    def close(self) -> None:
        self._open()
        self._let_go_of_private()
        if self.node is not None:
            self.cache.let_go(self.node)
        self.node, self.slots, self.closed = None, [], True
        self.cache.contexts.remove(self)


    def _let_go_of_private(self) -> None:
        """``close``'s part for the private pages: ``free`` of each (a reclaiming pool's context lets go
        of its holds instead)."""
        self._free_private_from(0)


class SGLangCache(EngineCache):
    context_class = SGLangContext

    def __init__(self, config: Config):
        super().__init__(config)
        self.rc, (token_allocator, paged_allocator) = self._engine()
        self.page = config.page_tokens
        pool = config.pool_limit if reclaims(config.on_full) else POOL_PAGES
        self.evicted_tokens = 0       # what tree.evict let go for room (a measure of pressure, for reports)
        self.allocated_pages = 0      # what alloc handed out: SGLang's allocator counts only what is free
        if self.page == 1:
            self.allocator = token_allocator(pool, torch.float32, "cpu", None, False)
        else:
            self.allocator = paged_allocator(pool * self.page, self.page, torch.float32, "cpu", None, False)
        self.tree = self._make_tree(self.allocator)

    def _engine(self):
        """The engine's module (its tree's parameter classes and ``RadixKey``) and its two slot allocators."""
        return load_radix_cache(), load_allocators()

    def _make_tree(self, allocator):
        return self.rc.RadixCache.create_simulated(mock_allocator=allocator, page_size=self.page)

    def hold(self, node):
        """A request's lock on ``node`` (``inc_lock_ref``); what it returns is what ``let_go`` takes."""
        self.tree.inc_lock_ref(node)
        return node

    def hold_again(self, held):
        """A second lock where ``held`` (from ``hold``) is one (a fork's)."""
        return self.hold(held)

    def let_go(self, held) -> None:
        """The lock ``hold`` gave let go (``dec_lock_ref``)."""
        self.tree.dec_lock_ref(held)

    # -- the engine's operations ---------------------------------------------------------

    def alloc(self, tokens: int):
        """SGLang's ``alloc`` (a tensor of slots, None when it has too few free), its pages counted."""
        slots = self.allocator.alloc(tokens)
        if slots is not None:
            self.allocated_pages += tokens // self.page
        return slots

    def alloc_pages(self, pages: int) -> list[int]:
        slots = self.alloc(pages * self.page)
        if slots is None:
            raise PoolExhausted(f"the adapter's pool of {POOL_PAGES} pages ran out ({pages} more wanted)")
        return slots.tolist()

    def free_slots(self, slots: list[int]) -> None:
        """Free the pages of ``slots`` (one slot per page is enough: the allocator frees whole pages)."""
        if slots:
            self.allocator.free(torch.tensor(slots, dtype=torch.int64))

    def _key(self, tokens) -> object:
        return self.rc.RadixKey(array("q", tokens))

    def node_for(self, tokens: list[int]):
        """The tree node that ends exactly at ``tokens`` (page-aligned, held by a lock)."""
        result = self.tree.match_prefix(self.rc.MatchPrefixParams(key=self._key(tokens)))
        if result.device_prefix_len != len(tokens):
            raise AssertionError(f"sglang adapter: a locked prefix of {len(tokens)} tokens matched "
                                 f"{result.device_prefix_len}")
        return result.last_device_node

    # -- the protocol ----------------------------------------------------------------

    def allocate(self) -> SGLangContext:
        return self.register(self.context_class(self, [], [], 0, None))

    def retain(self, ctx: SGLangContext) -> None:
        self.own(ctx)
        if len(ctx) == 0:
            raise EmptyContextError("cannot retain an empty context")
        aligned = len(ctx) - len(ctx) % self.page
        if aligned <= ctx.protected:
            if aligned:
                self.node_for(ctx._tokens[:aligned])       # a hit refreshes the path, as a re-insert does
            return
        self._insert(ctx, aligned)
        node = self.node_for(ctx._tokens[:aligned])
        ctx.slots[:aligned] = self.tree.path_device_indices(node).tolist()
        held = self.hold(node)
        if ctx.node is not None:
            self.let_go(ctx.node)
        ctx.node, ctx.protected = held, aligned

    def _insert(self, ctx: SGLangContext, aligned: int) -> None:
        """``ctx``'s first ``aligned`` positions into the tree, its slots as their values."""
        key = self._key(ctx._tokens[:aligned])
        value = torch.tensor(ctx.slots[:aligned], dtype=torch.int64)
        result = self.tree.insert(self.rc.InsertParams(key=key, value=value))
        # the tree kept its own slots for [protected, prefix_len): ours there are duplicates
        self.free_slots(ctx.slots[ctx.protected:result.prefix_len:self.page])

    def match(self, tokens):
        query = [int(t) for t in check_tokens(tokens, private=False)]
        result = self.tree.match_prefix(self.rc.MatchPrefixParams(key=self._key(query)))
        hit = result.device_prefix_len
        if hit == 0:
            return self.allocate(), 0
        node = result.last_device_node
        held = self.hold(node)
        slots = self.tree.path_device_indices(node).tolist()
        return self.register(self.context_class(self, query[:hit], slots, hit, held)), hit

    def clear(self) -> None:
        for ctx in self.contexts:
            if ctx.protected:
                ctx._detach(0, ctx.protected)
        self.tree.evict(self.rc.EvictParams(num_tokens=self.tree.evictable_size() + 1))

    def observe(self) -> Observation:
        """Black box, but for the pages allocated and freed; freed is read from SGLang's allocator
        (allocated less the pages out), so "allocated = freed" holds only when it has every page back."""
        out = (self.allocator.size - self.allocator.available_size()) // self.page
        return dataclasses.replace(black_box(), pages_allocated=self.allocated_pages,
                                   pages_freed=self.allocated_pages - out)


def _configs() -> list[Config]:
    layout = Layout(layers=2, kv_heads=2, head_dim=4)
    configs = []
    for page in (1, 16, 64):
        match = dict(match="token") if page == 1 else dict(match="block", block_tokens=page)
        for precision in (("f32", "f16", "q8") if page == 1 else ("f32",)):
            configs.append(Config(layout, page_tokens=page, precision=precision, max_entries=ENTRY_BOUND,
                                  values="prefix", **match))
    return configs + reclaiming_configs(layout)


def reclaiming_configs(layout: Layout) -> list[Config]:
    """Fixed pools small enough that runs evict (``on_full="reclaim"``): SGLang's own ``evict`` makes
    the room when ``alloc`` fails."""
    return [Config(layout, page_tokens=1, match="token", max_entries=ENTRY_BOUND, values="prefix",
                   pool_pages=RECLAIM_POOL_TOKENS, on_full="reclaim"),
            Config(layout, page_tokens=16, match="block", block_tokens=16, max_entries=ENTRY_BOUND, values="prefix",
                   pool_pages=RECLAIM_POOL_PAGES, on_full="reclaim")]


def factory(config: Config) -> SGLangCache:
    if reclaims(config.on_full):
        from .sglang_reclaim import ReclaimingCache      # it builds on this module's classes
        return ReclaimingCache(config)
    return SGLangCache(config)


factory.configs = _configs()
factory.any_page_size = False
factory.engine_version = SUPPORTED_VERSION
