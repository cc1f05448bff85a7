"""Bugs planted on purpose, to prove the checkers catch them.

Each is a context manager that monkeypatches the engine for its duration. The
suite asserts that the lockstep machine (and the exhaustive checker) fail
while a bug is planted: a checker that cannot catch these is not done.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable, ContextManager

import numpy as np

from kvstate.impl import cache as cache_module
from kvstate.impl import context as context_module
from kvstate.impl import holding as holding_module
from kvstate.impl import numpy_store as numpy_module
from kvstate.impl import pages as pages_module
from kvstate.impl import pool_policy as pool_policy_module
from kvstate.impl import radix as radix_module
from kvstate.impl import refcounts as refcounts_module
from kvstate.spec import arithmetic
from kvstate.spec import precision as precisions
from kvstate.spec.errors import CapacityError, PositionError
from kvstate.spec.layout import require_finite


@contextmanager
def _patched_all(patches):
    """Several ``(owner, name, replacement)`` patches at once, undone in reverse."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


@contextmanager
def _patched(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield original
    finally:
        setattr(owner, name, original)


def missing_copy_on_write() -> ContextManager:
    """``writable`` writes into a shared page instead of copying it."""
    return _patched(context_module.Context, "writable", lambda self, index: self._pages[index])


def refcount_kept_on_close() -> ContextManager:
    """``close`` forgets its pages without decrementing their refcounts."""
    def close_without_release(cache, ctx):
        with cache.lock:
            ctx._holding = holding_module.RELEASED
            ctx._use = context_module.CLOSED
            del cache._contexts[ctx.context_id]
    return _patched(cache_module.Cache, "_close", close_without_release)


def truncate_off_by_one() -> ContextManager:
    """``truncate`` keeps one page too few whenever ``n`` ends inside a page (rounds down)."""
    def keep_floor(length, keep, page_tokens):
        kept = keep // page_tokens            # should round up
        return kept, arithmetic.pages_needed(length, page_tokens) - kept
    return _patched(context_module, "truncate_keep", keep_floor)


def truncate_releases_nothing() -> ContextManager:
    """``truncate`` shortens the context but releases none of the pages past its new length: they
    stay listed, and held, until it closes. Every read is right (a later extend writes over them),
    and closing frees them all; only the holder's page count against its length shows it."""
    def keep_first(self, n):
        self._holding = self._holding.with_length(n)
    return _patched(context_module.Context, "_keep_first", keep_first)


def truncate_shared_boundary() -> ContextManager:
    """A fast path for "drop the lone position on a shared second page": ``truncate`` to
    exactly one full page, from one position more, while a fork shares the second page,
    releases the kept first page instead of (and as well as) the second.

    Everything must line up: page size >= 2, length exactly ``page_tokens + 1``,
    ``n == page_tokens``, and a fork still holding the second page. Random runs,
    whose contexts quickly grow long, rarely get there; an exhaustive search at page
    size 2 reaches it in five operations.
    """
    def truncate(self, n):
        def work():
            if not (isinstance(n, int) and 0 <= n <= self._length):
                raise PositionError(f"truncate to {n} is outside context {self.context_id} of length {self._length}")
            with self._cache.lock:
                keep, _released = arithmetic.truncate_keep(self._length, n, self.page_tokens)
                first = keep
                if (self.page_tokens >= 2 and n == self.page_tokens and self._length == n + 1
                        and self._pages[keep].refcount > 1):
                    first = keep - 1
                for page in self._pages[first:]:
                    self._cache.pool.release(page)
                held = self._holding
                self._holding = held.replaced(held.pages[:keep], held.slots[:keep], keep_base=False).with_length(n)
        self._owned(work)
    return _patched(context_module.Context, "truncate", truncate)


def split_node_evicted() -> ContextManager:
    """Eviction picks the oldest *node*, split nodes without an entry included."""
    def pop_oldest(tree, spare=None, where=None):
        stack = [tree.root]
        while stack:
            node = stack.pop()
            if node is not tree.root and node.value is None:
                # A split node: "evicting" it drops the whole subtree below it.
                doomed = []
                pending = [node]
                while pending:
                    n = pending.pop()
                    if n.value is not None and n.value is not spare:
                        doomed.append(n)
                    pending.extend(n.children.values())
                if doomed:
                    victim = doomed[0]
                    value = victim.value
                    tree.remove(victim)
                    return value
            stack.extend(node.children.values())
        original_pop = radix_module.RadixTree.__dict__["_planted_original_pop"]
        return original_pop(tree, spare, where)
    @contextmanager
    def planted():
        radix_module.RadixTree._planted_original_pop = radix_module.RadixTree.pop_oldest
        try:
            with _patched(radix_module.RadixTree, "pop_oldest", pop_oldest):
                yield
        finally:
            del radix_module.RadixTree._planted_original_pop
    return planted()


def arena_slot_kept_on_eviction() -> ContextManager:
    """Pages freed by tree eviction keep their arena slot."""
    def pop_oldest(tree, spare=None, where=None):
        value = original(tree, spare, where)
        for page in value._pages if value is not None else ():
            if page.refcount == 1 and page.buffer.slot is not None:
                page.buffer.slot = None      # the page forgets its slot; the arena never gets it back
        return value
    original = radix_module.RadixTree.pop_oldest
    return _patched(radix_module.RadixTree, "pop_oldest", pop_oldest)


def dirty_recycled_slot() -> ContextManager:
    """Arena slots are handed out without being zeroed."""
    original = numpy_module.NumpyStore._take
    return _patched(numpy_module.NumpyStore, "allocate", lambda store, page_id: original(store, page_id, zero=False))


def release_skips_last_page() -> ContextManager:
    """The release path decrements refcounts but never frees a page."""
    def free(pool, pages, slots, *release):      # what every release path calls
        if release:
            pool._commit(*release, None)        # the counts and the holder let go; no page freed
    return _patched(pages_module.PagePool, "_free", free)


def restore_drops_partial_page() -> ContextManager:
    """``restore`` writes whole pages only: positions in a partly filled last page read back as zeros."""
    from kvstate.impl import snapshot_restore

    def adopt(cache, tokens, encoded, n):
        with cache.lock:
            pages = cache.pool.new_pages(arithmetic.pages_needed(n, cache.page_tokens))
            ctx = cache._new_context(pages, n)
        full = n - n % cache.page_tokens
        if full:
            ctx._write(0, full, tokens, encoded)
        return ctx
    return _patched(snapshot_restore, "_adopt", adopt)


def q8_rounds_half_away_from_zero() -> ContextManager:
    """The NumPy store's q8 codes round half away from zero instead of half to even.

    Only a value whose ``x / scale`` lands exactly on .5 tells the two apart, which random
    K/V values almost never do.
    """
    original = numpy_module.NumpyStore.encode

    def encode(store, kv):
        if store.precision != "q8":
            return original(store, kv)
        x = np.asarray(kv, dtype=np.float32)
        require_finite(x)
        scales = (np.abs(x).max(axis=-1) / np.float32(precisions.Q8_MAX)).astype(np.float32)
        safe = np.where(scales > 0, scales, np.float32(1))[..., None]
        ratio = np.where(scales[..., None] > 0, x / safe, np.float32(0))
        rounded = np.sign(ratio) * np.floor(np.abs(ratio) + np.float32(0.5))
        codes = np.clip(rounded, -precisions.Q8_MAX, precisions.Q8_MAX).astype(np.int8)
        return tuple(np.moveaxis(part, 0, 2) for part in (codes, scales))
    return _patched(numpy_module.NumpyStore, "encode", encode)


def match_shortest_key() -> ContextManager:
    """``match`` answers with the shallowest entry on the walked path: the *shortest* retained key
    that prefixes the query instead of the longest. Only nested keys tell them apart."""
    def shallowest(has_entry):
        return next((i for i, has in enumerate(has_entry) if has), -1)
    return _patched(radix_module, "match_stop", shallowest)


def hits_append_in_place() -> ContextManager:
    """A ``match`` hit extends into its entry's partly used last page in place, without
    copy-on-write, on the theory that the entry never reads past its key: true for one hit, but
    two hits of one entry then write the same positions. Forks still copy."""
    original_match, original_extend = cache_module.Cache.match, context_module.Context.extend
    original_writable = context_module.Context.writable
    # Kept beside the contexts, not on them: the engine's Context has slots.
    hits, appending = weakref.WeakSet(), weakref.WeakSet()

    def match(cache, tokens):
        ctx, matched = original_match(cache, tokens)
        hits.add(ctx)
        return ctx, matched

    def extend(ctx, tokens, kv):
        appending.add(ctx)
        try:
            return original_extend(ctx, tokens, kv)
        finally:
            appending.discard(ctx)

    def writable(ctx, index):
        if ctx in hits and ctx in appending:
            return ctx._pages[index]
        return original_writable(ctx, index)
    return _patched_all([(cache_module.Cache, "match", match), (context_module.Context, "extend", extend),
                         (context_module.Context, "writable", writable)])


def snapshot_of_hit_stale_tokens() -> ContextManager:
    """A hit keeps a copy of its token ids from the match, which ``overwrite`` does not update, and
    ``snapshot`` writes the token ids from that copy: the snapshot of an overwritten hit restores
    to the old ids. Reads are right; only a snapshot shows it."""
    original_match, original_snapshot = cache_module.Cache.match, context_module.Context.snapshot
    original_tokens = context_module.Context._tokens
    kept_at_match = weakref.WeakKeyDictionary()     # beside the contexts: the engine's Context has slots
    snapshotting = weakref.WeakKeyDictionary()      # a hit being snapshotted -> the ids it writes

    def match(cache, tokens):
        ctx, matched = original_match(cache, tokens)
        kept_at_match[ctx] = original_tokens(ctx).copy()
        return ctx, matched

    def snapshot(ctx, target):
        kept = kept_at_match.get(ctx)
        if kept is None or len(kept) != len(ctx):
            return original_snapshot(ctx, target)
        snapshotting[ctx] = kept
        try:
            return original_snapshot(ctx, target)
        finally:
            del snapshotting[ctx]

    def tokens(ctx):
        kept = snapshotting.get(ctx)
        return original_tokens(ctx) if kept is None else kept.copy()
    return _patched_all([(cache_module.Cache, "match", match), (context_module.Context, "snapshot", snapshot),
                         (context_module.Context, "_tokens", tokens)])


def refused_extend_keeps_pages() -> ContextManager:
    """``extend`` takes its new pages first and asks the pool after: a refusal (``CapacityError``)
    leaves them in the context's page list, held, although its length did not change. Every
    invariant still holds; the pool is smaller for good."""
    def extend(ctx, tokens, kv):
        tokens = context_module.check_tokens(tokens)
        kv = context_module.check_values(ctx._cache.layout, kv, len(tokens))
        def work():
            if len(tokens) == 0:
                return
            encoded = ctx._cache.store.encode(kv)
            start, stop = ctx._length, ctx._length + len(tokens)
            with ctx._cache.lock:
                first, end = arithmetic.pages_touched(start, stop, ctx.page_tokens)
                held = len(ctx._pages)
                pages = ctx._pages + tuple(ctx._cache.pool.new_pages(end - held, room_made=True))
                ctx._holding = ctx._holding.replaced(pages, pages_module.ref_slots(pages), keep_base=True)
                partial_shared = first < held and ctx._pages[first].refcount > 1
                ctx._cache.pool.make_room(partial_shared + end - held)     # too late: the pages are taken
                if first < held:
                    ctx.writable(first)
            ctx._write(start, stop, tokens, encoded)
            with ctx._cache.lock:
                ctx._holding = ctx._holding.with_length(stop)
        ctx._owned(work)
    return _patched(context_module.Context, "extend", extend)


def evicts_before_refusing() -> ContextManager:
    """Under ``on_full="evict-then-refuse"`` the pool evicts entries first and refuses only when that
    did not make room: the refusal has changed the cache (the entries it evicted are gone), where
    the rule refuses at once when even evicting every entry would not make room (found by an audit:
    conform missed it in a configuration with a tree bound)."""
    def make_room(self, needed):
        if needed <= 0 or self.fits(needed) or self.on_full != "evict-then-refuse":
            return original(self, needed)
        held = self.context_page_ids()
        while not self.fits(needed):
            victim = self.tree.pop_oldest(where=lambda entry: pool_policy_module._keeps_a_page(entry, held))
            if victim is None:
                raise CapacityError(f"{self.pool.live_count} live pages + {needed} needed > pool of {self.limit}")
            self.release_entry(victim)
            self.evictions += 1
    original = pool_policy_module.PoolPolicy.make_room
    return _patched(pool_policy_module.PoolPolicy, "make_room", make_room)


def refcounts_split_on_growth() -> ContextManager:
    """When the refcount array fills up, the pool moves to a new, larger array, but pages made
    before keep reading the old one: a shared page then looks private to ``writable`` and a fork's
    write lands in place. Only a cache that passes the array's first size (256 live pages) shows it."""
    original = pages_module.PagePool._grow

    def grow(pool, count):
        books = pool.books
        if pool._next_ref + count > len(books.counts):
            pool.books = refcounts_module.Refcounts(2 * len(books.counts))   # the old pages keep ``books``
            pool.books.counts[:len(books.counts)] = books.counts
        return original(pool, count)
    return _patched(pages_module.PagePool, "_grow", grow)


def pool_evicts_newest() -> ContextManager:
    """A full pool that evicts (``evict``, ``evict-then-refuse``) makes room from the most recently used
    entry keeping a page no context lists, not the least recently used one; the tree's own bound
    (``max_entries``) still evicts the oldest."""
    original = radix_module.RadixTree.pop_oldest

    def pop_oldest(tree, spare=None, where=None):
        if where is None:
            return original(tree, spare, where)
        for node in reversed(tree.recency):
            if node.value is not spare and where(node.value):
                value = node.value
                tree.remove(node)
                return value
        return None
    return _patched(radix_module.RadixTree, "pop_oldest", pop_oldest)


def dirty_recycled_heap_page() -> ContextManager:
    """Freed heap pages are kept for reuse (``NumpyStore.free_all``, at every page size) and come
    back unzeroed: a new page reads the last page's bytes where nothing was written."""
    original = numpy_module.NumpyStore._heap_buffer
    return _patched(numpy_module.NumpyStore, "_heap_buffer", lambda store, zero: original(store, False))


PLANTED: dict[str, Callable[[], ContextManager]] = {
    "missing_copy_on_write": missing_copy_on_write,
    "refcount_kept_on_close": refcount_kept_on_close,
    "truncate_off_by_one": truncate_off_by_one,
    "truncate_releases_nothing": truncate_releases_nothing,
    "truncate_shared_boundary": truncate_shared_boundary,
    "split_node_evicted": split_node_evicted,
    "arena_slot_kept_on_eviction": arena_slot_kept_on_eviction,
    "dirty_recycled_slot": dirty_recycled_slot,
    "release_skips_last_page": release_skips_last_page,
    "restore_drops_partial_page": restore_drops_partial_page,
    "q8_rounds_half_away_from_zero": q8_rounds_half_away_from_zero,
    "match_shortest_key": match_shortest_key,
    "hits_append_in_place": hits_append_in_place,
    "snapshot_of_hit_stale_tokens": snapshot_of_hit_stale_tokens,
    "refused_extend_keeps_pages": refused_extend_keeps_pages,
    "refcounts_split_on_growth": refcounts_split_on_growth,
    "evicts_before_refusing": evicts_before_refusing,
    "pool_evicts_newest": pool_evicts_newest,
    "dirty_recycled_heap_page": dirty_recycled_heap_page,
}
