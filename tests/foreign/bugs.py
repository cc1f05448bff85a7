"""The bug zoo: one planted bug per subclass of a foreign backend.

Each class breaks exactly one promise of README.md (its docstring names it); ``BUGS`` maps a
bug's name to a factory building the broken cache. ``tests/test_bug_zoo.py`` runs ``conform``
against each and asserts it is caught, with the report naming the right invariant or check.
"""

from __future__ import annotations

import numpy as np

from kvstate.spec import precision as precisions
from kvstate.spec.errors import ConfigError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite

from . import block_pool, dict_pages, no_arena, no_tree


# -- on the dict-of-pages engine ------------------------------------------------------------

class Q8HalfAwayFromZero(dict_pages.DictCache):
    """q8 codes round half away from zero; ``spec.precision`` rounds half to even (invariant 4).

    Only a value whose ``x / scale`` lands exactly on .5 tells them apart: rare in random data."""

    def encode(self, kv):
        if self.precision != "q8":
            return super().encode(kv)
        x = np.asarray(kv, dtype=np.float32)
        scales = (np.abs(x).max(axis=-1) / np.float32(precisions.Q8_MAX)).astype(np.float32)
        safe = np.where(scales > 0, scales, np.float32(1))[..., None]
        ratio = np.where(scales[..., None] > 0, x / safe, np.float32(0))
        rounded = np.sign(ratio) * np.floor(np.abs(ratio) + np.float32(0.5))
        return np.clip(rounded, -precisions.Q8_MAX, precisions.Q8_MAX).astype(np.int8), scales


class UnscrubbedArena(dict_pages.Arena):
    def scrub(self, slot: int) -> None:
        pass


class DirtySlotReportedClean(dict_pages.DictCache):
    """A recycled arena slot is issued without being zeroed (invariant 3: "a recycled slot reads
    zero where nothing was written"), and ``observe()`` reports ``dirty_tail=False`` whatever the
    bytes say: the backend's own flag cannot convict it."""

    arena_class = UnscrubbedArena

    def dirty_tail(self, page) -> bool:
        return False


class HeapPageReusedDirty(dict_pages.DictCache):
    """Without an arena, freed pages' arrays are kept and handed to the next new page as they are,
    not zeroed (the promise of invariant 3 for a recycled slot, kept by every page), and
    ``observe()`` reports ``dirty_tail=False``: no arena twin to compare with, no flag to convict."""

    def __init__(self, config):
        super().__init__(config)
        self.spares: list[dict_pages.Page] = []

    def release(self, page) -> None:
        super().release(page)
        if page.refcount == 0 and page.slot is None:
            self.spares.append(page)

    def new_page(self):
        if self.spares and not self.arena.free:
            spare = self.spares.pop()
            self.allocated += 1
            page = dict_pages.Page(self.allocated, None, spare.parts, spare.tokens)     # PLANTED: not zeroed
            self.pages[page.page_id] = page
            return page
        return super().new_page()

    def dirty_tail(self, page) -> bool:
        return False


class IgnoresArenaPages(dict_pages.DictCache):
    """``config.arena_pages`` is ignored: every page lives in ordinary memory and the observation
    reports ``arena_size`` 0 in an arena configuration."""

    def arena_size(self, config) -> int:
        return 0


class AliasingReadContext(dict_pages.DictContext):
    def read(self, start: int = 0, stop: int | None = None):
        stop = self.length if stop is None else stop
        size = self.cache.page_tokens
        if (self.cache.precision == "f32" and _is_int(start) and _is_int(stop) and 0 <= start < stop <= self.length
                and start // size == (stop - 1) // size and not self.closed):
            page, base = self.pages[start // size], start // size * size
            return page.parts[0][start - base:stop - base], page.tokens[start - base:stop - base]
        return super().read(start, stop)


class ReadAliasesStorage(dict_pages.DictCache):
    """``read`` of a range inside one page returns a view of the page itself (f32), not a copy:
    a caller that writes into what it read changes the cache (invariant 4: a write through one
    holder never shows in another; here the write needs no operation at all)."""

    context_class = AliasingReadContext


class ReadStopOnBoundaryContext(dict_pages.DictContext):
    def read(self, start: int = 0, stop: int | None = None):
        values, tokens = super().read(start, stop)
        size, stop = self.cache.page_tokens, self.length if stop is None else stop
        if len(tokens) and _is_int(stop) and stop % size == 0 and stop < self.length:
            # ``stop // size`` for ``(stop - 1) // size``: the last row comes from the next page's first
            after, after_tokens = super().read(stop, stop + 1)
            values[-1], tokens[-1] = after[0], after_tokens[0]
        return values, tokens


class ReadStopOnPageBoundary(dict_pages.DictCache):
    """``read(start, stop)`` whose stop is a page boundary inside the context (``read(0, page)``, a
    prefix read) takes its last row from the next page (invariant 4: a read of a range reads the
    positions a whole read holds there). A whole read, a snapshot and ``tokens`` are right."""

    context_class = ReadStopOnBoundaryContext


class MemoryOrderContext(dict_pages.DictContext):
    def _validated(self, tokens, kv, start=None):
        kv = np.asarray(kv)
        # the K/V as raw memory in C order, strides ignored (a pointer copy): right only for a C-contiguous argument
        flat = np.ravel(kv, order="K") if isinstance(kv, np.ndarray) and kv.ndim else kv
        return super()._validated(tokens, np.reshape(flat, kv.shape) if kv.ndim else kv, start)


class IngestsMemoryOrder(dict_pages.DictCache):
    """``extend``/``overwrite`` read their K/V argument in memory order, not by index: a transposed
    view, a Fortran-ordered or reversed-stride array is stored scrambled (invariant 4). Every array
    the suite wrote was C-contiguous until the lockstep handed writes over in several layouts."""

    context_class = MemoryOrderContext


class HeadsSwappedContext(dict_pages.DictContext):
    def read(self, start: int = 0, stop: int | None = None):
        values, tokens = super().read(start, stop)
        if values.shape[3] > 3:     # a head table that only goes wrong past the third head
            values[:, :, :, [2, 3]] = values[:, :, :, [3, 2]]
        return values, tokens


class HeadsSwappedPastTheThird(dict_pages.DictCache):
    """With more than three KV heads, heads 2 and 3 read back swapped (invariant 4). Every check but
    ``scale`` stores at a 2x2x4 layout, and ``scale``'s one wide run was skipped, its pass silent,
    for a factory refusing that run's head dimension (a data-plane audit, s68)."""

    context_class = HeadsSwappedContext

    def __init__(self, config):
        if config.layout.head_dim > 256:
            raise ConfigError(f"head_dim {config.layout.head_dim} past 256 is not supported")
        super().__init__(config)


class RetainKeepsOldEntry(dict_pages.DictCache):
    """Retaining a key that is already retained keeps the old entry (its pages and its tick)
    instead of replacing it (invariant 5: entries and eviction order equal the reference's)."""

    def retain(self, ctx) -> None:
        ctx = self._own(ctx)
        if ctx.length and tuple(ctx.tokens) in self.entries:
            return
        super().retain(ctx)


class ZeroLengthWriteContext(dict_pages.DictContext):
    def _write(self, start, tokens, parts) -> None:
        if len(tokens) == 0:
            size = self.cache.page_tokens
            index = start // size
            while index >= len(self.pages):
                self.pages.append(self.cache.new_page())
            self.writable(index)
            return
        super()._write(start, tokens, parts)


class ZeroLengthWriteAllocates(dict_pages.DictCache):
    """A zero-length ``extend``/``overwrite`` still makes the page at its start position
    writable: it allocates a fresh page at a page boundary and copies a shared page inside one.
    README: a zero-length write copies and allocates nothing."""

    context_class = ZeroLengthWriteContext


class SnapshotDropsPartialPage(dict_pages.DictCache):
    """The snapshot body carries whole pages only: the positions of a partly filled last page are
    written as zeros (a valid file, with the right size and checksums), so the restored context
    reads zeros there (invariant 4; the damaged-snapshot check's intact round trip)."""

    def snapshot_sections(self, ctx):
        sections = [np.array(section) for section in super().snapshot_sections(ctx)]
        full = ctx.length - ctx.length % self.page_tokens
        for section in sections:
            section[full:] = 0
        return sections


class InPlaceHitContext(dict_pages.DictContext):
    key_end = None            # a hit's entry key length: the entry never reads past it

    def _write(self, start, tokens, parts) -> None:
        self.writing_from = start
        super()._write(start, tokens, parts)

    def writable(self, index: int):
        if self.key_end is not None and index * self.cache.page_tokens < self.key_end <= self.writing_from:
            return self.pages[index]
        return super().writable(index)


class HitsAppendInPlace(dict_pages.DictCache):
    """A hit appends past its entry's key into the shared, partly filled last page in place, on the
    theory that the entry never reads there (forks still copy). Two live hits of one entry then write
    the same rows, and the first reads the second's positions (invariant 4: a write through one
    holder never shows in another)."""

    context_class = InPlaceHitContext

    def match(self, tokens):
        hit, matched = super().match(tokens)
        if matched:
            hit.key_end = matched
        return hit, matched


class KeyCacheContext(dict_pages.DictContext):
    key = None                # a hit's token ids, kept so a snapshot need not gather them from pages

    def extend(self, tokens, kv) -> None:
        super().extend(tokens, kv)
        if self.key is not None:
            self.key += tuple(check_tokens(tokens).tolist())

    def truncate(self, n: int) -> None:
        super().truncate(n)
        if self.key is not None:
            self.key = self.key[:n]


class SnapshotStaleTokens(dict_pages.DictCache):
    """A hit keeps its entry's key as a token cache that ``extend`` and ``truncate`` maintain but
    ``overwrite`` does not, and a snapshot writes its token ids from that cache: the snapshot of an
    overwritten hit restores the old token ids (invariant 4 on the restored context; README: a
    snapshot holds a context's tokens and values)."""

    context_class = KeyCacheContext

    def match(self, tokens):
        hit, matched = super().match(tokens)
        if matched:
            hit.key = tuple(hit.tokens)
        return hit, matched

    def snapshot_sections(self, ctx):
        sections = super().snapshot_sections(ctx)
        if ctx.key is not None:
            sections[0] = np.array(ctx.key, np.int64)
        return sections


class ArenaSlotKeptOnEviction(dict_pages.DictCache):
    """Pages freed by tree eviction forget their arena slot, which stays out in the arena's books
    for a page that is gone (invariant 3: every slot that is out backs a live page)."""

    def evict(self, entry) -> None:
        for page in entry.pages:
            if page.refcount == 1:
                page.slot = None
        super().evict(entry)


# -- on the engine without a tree ----------------------------------------------------------------

class ShortestMatch(no_tree.ListEngine):
    """``match`` answers with the *shortest* retained key that prefixes the query instead of the
    longest (invariant 5 / the matched count). Needs nested keys, which random runs rarely build."""

    def best_hit(self, query):
        hits = [e for e in self.entries if query[:len(e.key)] == e.key]
        return min(hits, key=lambda e: len(e.key)) if hits else None


class NoCopyContext(no_tree.PlainContext):
    def writable(self, index: int):
        return self.engine.table.records[self.page_ids[index]]


class MissingCopyOnWrite(no_tree.ListEngine):
    """``writable`` writes into a shared page instead of copying it: a write through a fork shows
    in its parent (invariant 4)."""

    context_class = NoCopyContext


class FloorTruncateContext(no_tree.PlainContext):
    def pages_to_keep(self, n: int) -> int:
        return n // self.engine.table.page_tokens


class TruncateOffByOne(no_tree.ListEngine):
    """``truncate`` keeps one page too few when ``n`` ends inside a page (rounds down, not up): the
    kept positions of that page are lost (invariant 4)."""

    context_class = FloorTruncateContext


# -- on the engine without an arena -------------------------------------------------------------

class PageGranularMatch(no_arena.HeapEngine):
    """``match`` reports the matched count in whole pages (the hit's page count times the page
    size, capped by the query) instead of the key's length: the caller would skip prefilling
    tokens the returned context does not hold."""

    def matched_count(self, key, query) -> int:
        pages = -(-len(key) // self.page_tokens)
        return min(len(query), pages * self.page_tokens)


class KeepRefsBlock(no_arena.Block):
    def release_pages(self) -> None:
        self.pages = []


class RefcountKeptOnClose(no_arena.HeapEngine):
    """``close`` forgets its pages without decrementing their refcounts (invariant 1: a page's
    refcount equals its holders; 6: nothing is left after closing everything)."""

    block_class = KeepRefsBlock


class KeepPagesBlock(no_arena.Block):
    def truncate(self, n: int) -> None:
        self._alive()
        if not (_is_int(n) and 0 <= n <= self.length):
            raise PositionError(f"truncate to {n} but the context has {self.length} positions")
        self.length = n       # the pages past ``n`` stay listed and held


class TruncateReleasesNothing(no_arena.HeapEngine):
    """``truncate`` shortens the context but keeps every page past its new length, held until it
    closes: every read is right and closing frees them all, so only a holder's page count against
    its length shows it (invariant 2; README: ``truncate(n)`` releases the pages past n)."""

    block_class = KeepPagesBlock


class EvictsMostRecent(no_arena.HeapEngine):
    """When the tree is full, eviction drops the *most* recently used entry (other than the one
    just retained) instead of the least (invariant 5: eviction order)."""

    def eviction_victim(self, newest):
        return max((k for k in self.retained if k != newest), key=lambda k: self.retained[k][1])


class F16OverflowAccepted(no_arena.HeapEngine):
    """f16 values past 65504 are stored as infinity instead of refused with
    ``PrecisionRangeError`` (bad input raises its named error and changes nothing)."""

    def encode(self, kv):
        if self.precision != "f16":
            return super().encode(kv)
        with np.errstate(over="ignore"):
            return (np.asarray(kv).astype(np.float16),)


class NoRefForkBlock(no_arena.Block):
    def fork(self):
        self._alive()
        return self.engine.new_block(list(self.pages), self.length)


class ForkWithoutRefcount(no_arena.HeapEngine):
    """``fork`` copies the page list but does not increment the pages' refcounts (invariant 1),
    so the first close frees pages the other context still lists (invariant 2)."""

    block_class = NoRefForkBlock


# -- on the block-hash pool ----------------------------------------------------------------------

class EagerHashContext(block_pool.BlockContext):
    def extend(self, tokens, kv) -> None:
        ids = check_tokens(tokens).tolist()
        self._require_open()
        written = self.tokens
        size, parent = self.cache.page_tokens, self.hashes[-1] if self.hashes else block_pool.ROOT_HASH
        for index in range(len(self.hashes), (len(written) + len(ids)) // size):   # as vLLM hashes arriving tokens
            parent = block_pool.block_hash(parent, tuple((written + ids)[index * size:(index + 1) * size]))
            self.hashes.append(parent)
        super().extend(tokens, kv)


class HashBeforeWrite(block_pool.BlockPoolCache):
    """A block's hash joins the context's chain when its tokens arrive, before its K/V are written: an
    extend that is then refused (a full pool, a non-finite value) leaves the hash of a block that was
    never written, a later extend of other tokens keeps it, and ``retain`` publishes it: the entry's
    own key then matches short, and a query with the refused tokens hits blocks that hold other
    tokens (what ``match`` returns: invariant 5 through match, the matched count, invariant 4)."""

    context_class = EagerHashContext


class HitStampsNothing(block_pool.BlockPoolCache):
    """A ``match`` hit does not make its entry the most recently used, so eviction (past
    ``max_entries`` or for room) takes an entry just used instead of the least recently used one
    (README: a hit stamps its entry; invariant 5, seen through ``match``)."""

    def stamp(self, entry) -> None:
        pass


class PagewiseContext(block_pool.BlockContext):
    def extend(self, tokens, kv) -> None:
        tokens, parts = self._validated(tokens, kv)
        if len(tokens):
            self._write(self.length, tokens, parts)    # each new page asks the pool for itself


class RefusedExtendKeepsPages(block_pool.PagesTierCache):
    """``extend`` takes its pages one at a time, each asking the pool, instead of counting its need
    first; when the pool refuses a page, ``CapacityError`` leaves the pages already taken (and
    entries evicted for them) in place: the context lists pages past its length, held from the pool
    (README's full-pool row: refuse with ``CapacityError``, changing nothing)."""

    context_class = PagewiseContext

    def new_page(self) -> int:
        self.make_room(1)
        return super().new_page()


class RefcountsDroppedTable(block_pool.PageTable):
    def grow(self) -> None:
        super().grow()
        self.refcount = np.zeros_like(self.refcount)     # the doubled array, never filled from the old one


class RefcountsLostOnGrowth(block_pool.BlockPoolCache):
    """When the page table doubles past its first ``INITIAL_PAGES`` rows, the refcounts of the pages
    made before the growth are not carried over: a page a fork shares reads as private, so the
    fork's write lands in place and shows in the parent (invariant 4). Only a run that holds more
    than 64 live pages at once crosses it."""

    table_class = RefcountsDroppedTable


# -- caught by one directed check (tests/test_directed_edges.py runs it alone: DIRECTED_CATCHES) ------

class NarrowTokenContext(no_tree.PlainContext):
    def _prepare(self, tokens, kv, start=None):
        tokens, values = super()._prepare(tokens, kv, start)
        return tokens.astype(np.uint16).astype(np.int64), values


class TokenIdsIn16Bits(no_tree.ListEngine):
    """Token ids are stored in 16 bits: an id from 65,536 up reads back wrapped (invariant 4),
    where random sequences draw ids 0-2 only."""

    context_class = NarrowTokenContext


class TokenLimitContext(no_tree.PlainContext):
    def _prepare(self, tokens, kv, start=None):
        ids = np.array(tokens, dtype=np.int64)
        return super()._prepare(np.where(ids == 2**31, 2**31 - 1, ids), kv, start)


class TokenLimitAccepted(no_tree.ListEngine):
    """The token id 2**31, the first past the limit, is accepted (stored as 2**31 - 1) instead of
    refused with ``TokenError``."""

    context_class = TokenLimitContext


class LooseTokenContext(no_tree.PlainContext):
    def _prepare(self, tokens, kv, start=None):
        ids = np.asarray(list(tokens)).astype(np.int64)      # PLANTED: bools, floats and sets convert
        return super()._prepare(ids, kv, start)


class TokenIdsConverted(no_tree.ListEngine):
    """Token ids are converted to int64, not checked: ``[True]``, ``[1.5]``, a float array and a set are
    stored where README refuses them (``DTypeError``)."""

    context_class = LooseTokenContext


class MatchUnchecked(no_tree.ListEngine):
    """``match`` does not check the ids it is given (a lookup stores nothing): ``[-1]`` and ``[2**31]``
    are a miss, not the ``TokenError`` README's "a lookup checks every token id it is given" asks for."""

    def match(self, tokens):
        query = [int(t) for t in tokens]
        if not all(0 <= t < 2**31 for t in query):
            return self.allocate(), 0                        # PLANTED: a miss, not a refusal
        return super().match(query)


class PageByPageOverwriteContext(dict_pages.DictContext):
    def overwrite(self, start: int, tokens, kv) -> None:
        tokens = check_tokens(tokens)
        kv = np.asarray(check_values(self.cache.layout, kv, len(tokens)))
        self._require_open()
        if not (_is_int(start) and 0 <= start and start + len(tokens) <= self.length):
            raise PositionError(f"overwrite of [{start}, {start + len(tokens)}) is outside context {self.context_id}")
        size, at, end = self.cache.page_tokens, start, start + len(tokens)
        while at < end:
            stop = min(end, (at // size + 1) * size)
            part = kv[at - start:stop - start]
            require_finite(part)        # PLANTED: checked as each page is written, after the ones before it
            self._write(at, tokens[at - start:stop - start], self.cache.encode(part))
            at = stop


class ChecksValuesPageByPage(dict_pages.DictCache):
    """``overwrite`` checks its values a page at a time as it writes them, so one refused for a NaN (or a
    value past f16's range) in a later page has written the pages before it (README: a refused operation
    changes nothing; ARCHITECTURE.md: non-finite input is refused before anything is written). Random
    sequences put a bad value in a one-position write, where the bug cannot show (an outside audit)."""

    context_class = PageByPageOverwriteContext


class RestoreKeepsTheFilePrecision(dict_pages.DictCache):
    """``restore`` of a snapshot written at another precision keeps the file's numbers as they are
    (q8 codes, unscaled, become values) instead of converting them (ARCHITECTURE.md: restore into
    another precision converts by the precision rules)."""

    def restore(self, source):
        from kvstate.spec import snapshot_format as fmt
        data = source.read()
        header = fmt.parse_header(data)     # reads the header's first bytes: 48, or 64 (version 3)
        arrays = fmt.check_body(header, memoryview(data)[header.size:header.size + header.body_bytes])
        parts = (arrays["values"], arrays["scales"]) if header.precision == "q8" else (arrays["values"],)
        if header.precision != self.precision:
            parts = self.encode(np.asarray(parts[0], np.float32))        # PLANTED: not decoded first
        ctx = self.allocate()
        ctx._write(0, arrays["tokens"].astype(np.int64), parts)
        ctx.length = header.positions
        return ctx


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _factory_for(cache_class, base_factory):
    def factory(config):
        return cache_class(config)
    factory.__name__ = factory.__qualname__ = f"{cache_class.__name__}_factory"
    factory.__doc__ = cache_class.__doc__
    for declared in ("configs", "any_page_size"):
        if hasattr(base_factory, declared):
            setattr(factory, declared, getattr(base_factory, declared))
    return factory


_PLANTED = {
    "q8_half_away_from_zero": (Q8HalfAwayFromZero, dict_pages.factory),
    "match_shortest_key": (ShortestMatch, no_tree.factory),
    "dirty_slot_reported_clean": (DirtySlotReportedClean, dict_pages.factory),
    "ignores_arena_pages": (IgnoresArenaPages, dict_pages.factory),
    "heap_page_reused_dirty": (HeapPageReusedDirty, dict_pages.factory),
    "match_count_in_pages": (PageGranularMatch, no_arena.factory),
    "read_aliases_storage": (ReadAliasesStorage, dict_pages.factory),
    "missing_copy_on_write": (MissingCopyOnWrite, no_tree.factory),
    "refcount_kept_on_close": (RefcountKeptOnClose, no_arena.factory),
    "truncate_off_by_one": (TruncateOffByOne, no_tree.factory),
    "truncate_releases_nothing": (TruncateReleasesNothing, no_arena.factory),
    "evicts_most_recent": (EvictsMostRecent, no_arena.factory),
    "retain_keeps_old_entry": (RetainKeepsOldEntry, dict_pages.factory),
    "read_stop_on_page_boundary": (ReadStopOnPageBoundary, dict_pages.factory),
    "ingests_memory_order": (IngestsMemoryOrder, dict_pages.factory),
    "heads_swapped_past_the_third": (HeadsSwappedPastTheThird, dict_pages.factory),
    "f16_overflow_accepted": (F16OverflowAccepted, no_arena.factory),
    "zero_length_write_allocates": (ZeroLengthWriteAllocates, dict_pages.factory),
    "snapshot_drops_partial_page": (SnapshotDropsPartialPage, dict_pages.factory),
    "arena_slot_kept_on_eviction": (ArenaSlotKeptOnEviction, dict_pages.factory),
    "fork_without_refcount": (ForkWithoutRefcount, no_arena.factory),
    "hits_append_in_place": (HitsAppendInPlace, dict_pages.factory),
    "snapshot_stale_tokens": (SnapshotStaleTokens, dict_pages.factory),
    "hash_before_write": (HashBeforeWrite, block_pool.factory),
    "hit_stamps_nothing": (HitStampsNothing, block_pool.factory),
    "refused_extend_keeps_pages": (RefusedExtendKeepsPages, block_pool.pages_factory),
    "refcounts_lost_on_growth": (RefcountsLostOnGrowth, block_pool.factory),
}
BUGS = {name: _factory_for(cls, base) for name, (cls, base) in _PLANTED.items()}

# name: (factory, its correct base's, the directed check that catches it, the configuration, what its report says)
DIRECTED_CATCHES = {
    "token_ids_in_16_bits": (_factory_for(TokenIdsIn16Bits, no_tree.factory), no_tree.factory, "boundaries",
                             "f32-heap", "token 0 != reference 65536"),
    "token_limit_accepted": (_factory_for(TokenLimitAccepted, no_tree.factory), no_tree.factory, "bad input",
                             "f16-heap", "extend with the token ids [2**31]: accepted"),
    "token_ids_converted": (_factory_for(TokenIdsConverted, no_tree.factory), no_tree.factory, "bad input",
                            "f32-heap", "extend with the token ids [True]: accepted, expected DTypeError"),
    "match_unchecked": (_factory_for(MatchUnchecked, no_tree.factory), no_tree.factory, "bad input", "q8-heap",
                        "match of the token ids [-1]: accepted, expected TokenError"),
    "checks_values_page_by_page": (_factory_for(ChecksValuesPageByPage, dict_pages.factory), dict_pages.factory,
                                   "bad input", "f16-heap", "overwrite with NaN in its last position: refused, but "
                                   "the context's token at position 0: 0 -> 7 changed (\"before anything is written\")"),
    "restore_keeps_the_file_precision": (_factory_for(RestoreKeepsTheFilePrecision, dict_pages.factory),
                                         dict_pages.factory, "portable snapshots", "q8-heap",
                                         "restore(stream) into a new f32 cache"),
}
