"""The cache: one page store, one page pool, the radix tree, the live contexts, one lock.

Concurrency: one lock, and one busy flag per context.

1. ``Context._use`` (``Context._owned``): a flag (the holder's thread id) tested and set under the cache
   lock, never waited for: a second thread using the same context at the same
   time gets ``ContextBusyError``, a closed one ``ContextClosedError``. Every
   public operation on a context takes it, readers too (``tokens``, ``read``,
   ``read_layer``, ``read_layer_pages``, ``Cache.retain``, and ``snapshot``):
   they read the page list and the page bytes outside the cache lock, which is
   safe only while nobody else can write this context. ``fork`` runs whole under
   the cache lock, so it only tests the flag.
2. ``Cache.lock`` (an RLock), taken by ``allocate``, ``match``, ``clear``,
   ``observe``, ``stats``, by ``_owned`` for the flag, and inside every context
   operation that changes a page list, a length or a refcount. It guards
   refcounts, page lists and lengths, the busy flags, the live-context table,
   the radix tree and its clock, the arena's slot books, the page pool and its
   page table (token ids, ``filled`` marks) and the store counters. Nothing waits for a busy flag, so nothing can deadlock.

Outside the cache lock, while an operation holds the context only: validating and
encoding the caller's values, writing value bytes into pages (``Context._write``;
the token ids go into the pool's page table under the lock, as growing it copies it),
reading them back (``read``, ``tokens``, the key of ``retain``), and a snapshot's
file I/O. This is safe because a write goes only
into a page that ``writable`` or allocation made private (refcount 1) under the
lock, and no second holder can appear until this context's owner forks or
retains it, which it cannot do mid-write. A page that is shared is never written,
so readers of other holders need no lock. Each page's ``filled`` mark is raised
under the lock before its bytes land (in ``extend``'s critical section, or by
``Context._write`` for any other caller such as a restore), so ``observe``
(which checks that nothing past ``filled`` was written) never sees a
half-finished write as a dirty tail.

Under the cache lock although it is a copy: zeroing a recycled arena slot and
``writable``'s copy of one shared page. Each is one page, bounded, and doing it
under the lock keeps "a live page holds consistent bytes" true for ``observe``
and the slot books.

Page stores: ``allocate``, ``free``, ``copy``, ``is_zero_from``, ``arena_books``
and the counters are used under the cache lock; ``encode``, ``write``, ``read``,
``read_layer``, ``gather``, ``read_encoded``, ``from_encoded``, ``read_empty`` and
``concat`` are called outside it, from several threads at once, on different
pages, so a store must keep no shared scratch state there.

Tree entries are forks the tree owns; no user holds them, so they are touched
only under the cache lock (``retain``, ``match``, eviction, ``clear``). A
``match`` that forks an entry and a ``clear`` or eviction that releases it are
therefore ordered by the lock: the fork either takes its references first or
finds no entry.
"""

from __future__ import annotations

import threading
import warnings

from kvstate.spec.errors import (ConfigError, EmptyContextError, ForeignContextError, SecondTierWarning,
                                 UnsupportedModelError)
from kvstate.spec.layout import DEFAULT_PAGE_TOKENS, Layout, check_page_tokens
from kvstate.spec.observation import EntryView, Observation
from kvstate.spec.precision import check_precision
from kvstate.spec.protocol import Config
from kvstate.spec.snapshot_format import body_size

from .context import CLOSED, Context
from .holding import RELEASED, Holding
from .letting_go import evict_oldest, release_if_held
from .matching import finder_for
from .observing import PageViews, page_ids
from .pages import PagePool, ref_slots
from .pool_policy import PoolPolicy
from .query import packed_query, unpacked
from .radix import RadixTree
from .remote_deadline import CACHE, CALL, check_seconds, first_set
from .snapshot import restore_snapshot
from .tree_bounds import TreeBounds


def make_store(store: str, layout: Layout, page_tokens: int, precision: str, arena_pages: int, device: str):
    if store == "numpy":
        if device != "cpu":
            raise ConfigError(f"the numpy store runs on the cpu, not {device!r}")
        from .numpy_store import NumpyStore

        return NumpyStore(layout, page_tokens, precision, arena_pages)
    if store == "torch":
        try:
            from .torch_store import TorchStore
        except ImportError as error:
            raise ConfigError(f"store='torch' needs torch (pip install 'kvstate[torch]'): {error}") from None

        return TorchStore(layout, page_tokens, precision, arena_pages, device)
    if isinstance(store, type):
        raise ConfigError(f"store takes a page store object, not the class {store.__name__}: pass an instance")
    if not isinstance(store, str) and hasattr(store, "allocate"):
        _check_store_fits(store, layout=layout, page_tokens=page_tokens, precision=precision)
        return store    # a third-party page store instance
    raise ConfigError(f"store must be 'numpy', 'torch' or a page store object, got {store!r}")


def _check_store_fits(store, **wanted) -> None:
    """``ConfigError`` for a page store built for another layout, page size or precision than the cache
    (``PageStore`` names each): an extend then failed with a bare ``ValueError``, or an f32 cache kept
    q8 values. A store that does not name one is taken at its word."""
    for name, value in wanted.items():
        held = getattr(store, name, value)
        if held != value:
            raise ConfigError(f"the page store's {name} is {held!r}, the cache's {value!r}: build both alike")


class Cache:
    def __init__(
        self,
        layout: Layout,
        page_tokens: int = DEFAULT_PAGE_TOKENS,
        precision: str = "f32",
        store="numpy",
        device: str = "cpu",
        arena_pages: int = 0,
        max_entries: int = 64,
        *,
        match: str = "entry",
        block_tokens: int = 0,
        max_pages: int = 0,
        pool_pages: int = 0,
        on_full: str = "fallback",
        second_tier=None,
        remote_deadline_s: float | None = None,
    ):
        """Storage (layout, page size, precision, store, device, arena) and the declared
        semantics of ``spec/semantics.py``: ``match``, ``block_tokens``, the tree's bounds
        ``max_entries`` and ``max_pages``, and the full-pool policy ``on_full`` over
        ``pool_pages`` (0: the arena's size). ``second_tier``: a ``kvstate.remote.SnapshotStore``
        that ``match`` consults on a miss or a short hit. ``remote_deadline_s``: the total seconds
        each remote operation of this cache may take (``restore``/``snapshot`` with a URL, the
        second tier's part of ``match``) unless the call names its own; ``None``: the store's,
        the enclosing ``kvstate.remote.deadline`` block's, or the default (``impl/remote_deadline.py``)."""
        if not isinstance(layout, Layout):
            raise ConfigError(f"layout must be a kvstate Layout, got {type(layout).__name__}")
        self.config = Config(layout, check_page_tokens(page_tokens), check_precision(precision), arena_pages,
                             max_entries, match, block_tokens, max_pages, pool_pages, on_full)
        self.layout = layout
        self.page_tokens = self.config.page_tokens
        self.precision = self.config.precision
        self.max_entries = self.config.max_entries      # the config's: a NumPy count made a Python int
        self.store = make_store(store, layout, self.page_tokens, precision, self.config.arena_pages, device)
        self.pool = PagePool(self.store)
        self.bounds = TreeBounds(self.config.max_entries, self.config.max_pages, self.page_tokens)
        self.tree = RadixTree(weigh=self.bounds.entry_pages)     # keeps the pages held as it changes
        self.find_hit = finder_for(match, self.config.block_tokens)
        self.policy = PoolPolicy(on_full, self.config.pool_limit, self.pool, self.tree, self._release,
                                 self._context_page_ids)
        self.pool.make_room = self.policy.make_room
        self.lock = threading.RLock()
        self._page_views = PageViews()     # observe's, reused where a page did not change
        self._contexts: dict[int, Context] = {}
        self._next_context_id = 0
        # A slower tier consulted by ``match`` on a miss or short hit (``kvstate.remote.SnapshotStore``):
        # anything with ``consult(cache, tokens, (ctx, matched)) -> (ctx, matched)``.
        if second_tier is not None and (isinstance(second_tier, type) or
                                        not callable(getattr(second_tier, "consult", None))):
            got = f"the class {second_tier.__name__}" if isinstance(second_tier, type) else type(second_tier).__name__
            raise ConfigError(f"second_tier must be a kvstate.remote.SnapshotStore (anything with consult()), "
                              f"got {got}; for a URL: second_tier=SnapshotStore(url)")
        self.second_tier = second_tier
        if remote_deadline_s is not None:
            check_seconds(remote_deadline_s, "remote_deadline_s", ConfigError)
        self.remote_deadline_s = remote_deadline_s
        # Why this cache's K/V may serve no other sequence, once ``refuse_prefix_reuse`` says so; else None.
        self.prefix_reuse_refused: str | None = None

    @classmethod
    def from_config(cls, config: Config, store="numpy", device: str = "cpu") -> "Cache":
        """A cache with a ``kvstate.spec.Config``'s storage, bounds and declared semantics."""
        if not isinstance(config, Config):      # else a bare AttributeError on its first field
            raise ConfigError(f"from_config needs a kvstate.spec.Config, got {type(config).__name__}")
        return cls(config.layout, page_tokens=config.page_tokens, precision=config.precision,
                   store=store, device=device, arena_pages=config.arena_pages, max_entries=config.max_entries,
                   match=config.match, block_tokens=config.block_tokens, max_pages=config.max_pages,
                   pool_pages=config.pool_pages, on_full=config.on_full)

    # -- contexts ------------------------------------------------------------------

    def _new_context(self, pages, length: int, register: bool = True) -> Context:
        """A context holding ``pages`` (new, held once) and the first ``length`` positions in them."""
        pages = tuple(pages)        # a tuple stays itself
        slots = ref_slots(pages) if pages else range(0)
        self._next_context_id += 1
        ctx = Context(self, self._next_context_id, Holding(pages, slots, length, b"" if length == 0 else None,
                                                            pages, slots))
        if register:
            self._contexts[ctx.context_id] = ctx
        return ctx

    def _new_pages_context(self, count: int) -> Context:
        """``count`` new pages (``PagePool.new_pages``) held by a new empty context, or neither: an
        interrupt between the two lets the pages go, which no holder would ever release. The caller
        holds the cache lock (a restore, before it writes the pages)."""
        pages = ctx = None
        try:
            pages = self.pool.new_pages(count)
            ctx = self._new_context(pages, 0, register=False)
            self._contexts[ctx.context_id] = ctx        # listed last, its return inside the ``try`` too
            return ctx
        except BaseException:
            if ctx is not None:     # an interrupt after it was listed: unlisted, or it names freed pages
                self._contexts.pop(ctx.context_id, None)
            if pages is not None:
                self.pool.release_slots(pages, ref_slots(pages))
            raise

    def allocate(self) -> Context:
        """A new empty context."""
        with self.lock:
            return self._new_context((), 0)

    def _fork(self, ctx: Context, register: bool = True, length: int | None = None) -> Context:
        """A context holding ``ctx``'s first ``length`` positions (all by default): the pages
        that hold them, shared, nothing copied. A partly used last page stays shared until a
        write makes it private through ``writable``. The caller holds the cache lock."""
        held = ctx._holding
        whole = length is None or length == held.length     # ``Context.fork``'s way: the same holding
        if whole:
            holding = held
        else:
            n = (length + self.page_tokens - 1) // self.page_tokens     # pages_needed, spelled out: the hottest path
            if n == len(held.pages):    # inside the last page: every page, and the base kept
                holding = held.with_length(length)
            elif len(held.base) == n:   # the kept base tuple and its slots: no slice of the page list
                holding = Holding(held.base, held.base_slots, length, held.key, held.base, held.base_slots)
            else:
                pages, slots = held.pages[:n], held.slots[:n]
                holding = Holding(pages, slots, length, held.key, pages, slots)
        # The child first, the count last: ``share``/``share_holding`` change the books in their last
        # step, with no call after it, so an interrupt (Ctrl-C, a run's deadline) that reaches here
        # counted nothing, and the child is undone. Counted before the child existed, the count was
        # one that no holder would ever withdraw: its pages were never freed.
        self._next_context_id += 1
        child = Context(self, self._next_context_id, holding)
        if register:
            self._contexts[child.context_id] = child
        try:
            if whole:
                self.pool.books.share_holding(held)
            else:
                # one pending count on the run (refcounts.Refcounts): hits at one prefix share it
                self.pool.books.share(holding.slots)
        except BaseException:
            if register:
                del self._contexts[child.context_id]
            child._holding = RELEASED
            child._use = CLOSED
            raise
        return child

    def _release(self, ctx: Context) -> None:
        """Let go of every page ``ctx`` holds; the one path for contexts and tree entries."""
        holding = ctx._holding
        try:
            # The holder lets go in the same step as its count goes (``PagePool.release_slots``): an
            # interrupt before it leaves the holder holding, counted, open; after it, released.
            if not self.pool.books.withdraw_holding(holding, ctx, RELEASED):   # a holder not counted yet
                self.pool.release_slots(holding.pages, holding.slots, ctx, RELEASED)
        finally:
            if ctx._holding is RELEASED:
                ctx._use = CLOSED

    def _context_page_ids(self) -> set[int]:
        """Live pages some context lists (under the lock): what evicting every entry would leave."""
        return {page.page_id for ctx in self._contexts.values() for page in ctx._pages}

    def _close(self, ctx: Context) -> None:
        """``ctx`` released and forgotten (the caller holds the cache lock)."""
        try:
            self._release(ctx)
        finally:
            if ctx._use == CLOSED:      # released; an interrupt before that leaves it open and listed
                del self._contexts[ctx.context_id]

    # -- the prefix tree -------------------------------------------------------------

    def refuse_prefix_reuse(self, why: str) -> None:
        """From now on ``retain`` and ``match`` raise ``UnsupportedModelError`` naming ``why``, for
        good: the K/V this cache holds must serve no sequence but the one that computed them.
        ``kvstate.hf`` says so for a model whose rotary embedding follows the sequence's length,
        here rather than in its own cache class, so that reaching this cache directly is refused too."""
        if not isinstance(why, str) or not why:
            raise ConfigError(f"refuse_prefix_reuse needs the reason as a non-empty str, got {why!r}")
        with self.lock:
            self.prefix_reuse_refused = why

    def _refuse_prefix_reuse(self, what: str) -> None:
        raise UnsupportedModelError(f"{what}: {self.prefix_reuse_refused}")

    def retain(self, ctx: Context) -> None:
        """Keep a fork of ``ctx`` under the key ``ctx.tokens``; evict the LRU entry past ``max_entries``."""
        if self.prefix_reuse_refused is not None:
            self._refuse_prefix_reuse("retain")
        if not isinstance(ctx, Context) or ctx._cache is not self:
            raise ForeignContextError(f"retain needs a context of this cache, got {ctx!r}")
        # ``fork``'s way when the context keeps its key (every write keeps it): the whole retain
        # under the cache lock, so the busy flag is only tested, no ``_owned`` taken and dropped.
        with self.lock:
            if ctx._use:
                ctx._refuse_use()
            if ctx._length == 0:
                raise EmptyContextError(f"cannot retain context {ctx.context_id}: it is empty")
            key = ctx._kept_key()
            if key is not None:
                self._keep(ctx, key)
                return
        ctx._owned(self._retain_reading_key, ctx)    # outside the lock, the context held

    def _retain_reading_key(self, ctx: Context) -> None:
        """``retain`` of a context that keeps no key: it is read from the pages."""
        if len(ctx) == 0:
            raise EmptyContextError(f"cannot retain context {ctx.context_id}: it is empty")
        key = ctx._packed_key()
        with self.lock:
            self._keep(ctx, key)

    def _keep(self, ctx: Context, key: bytes) -> None:
        """``retain``'s change to the tree, under the cache lock: the entry in, evictions past the bounds."""
        entry = self._fork(ctx, register=False)
        replaced = entry        # until ``insert`` returns (it never returns the value it stores)
        try:
            replaced = self.tree.insert(key, entry)
        finally:
            if replaced is entry:       # it raised (an interrupt, an error) or declined the entry
                self._insert_failed(key, entry)
            elif replaced is not None:
                try:
                    self._release(replaced)
                except BaseException:
                    release_if_held(self._release, replaced)
                    raise
        while self.bounds.exceeded(self.tree):
            if evict_oldest(self.tree, self._release, spare=entry) is None:
                break      # only the entry just retained is left: it stays

    def _insert_failed(self, key: bytes, entry: Context) -> None:
        """``_keep``'s ``insert`` of ``entry`` (counted by ``_fork``) under ``key`` did not return.
        Where the entry went in, the one it replaced is released (``RadixTree.put`` left it in
        ``displaced``); where it did not, the entry is, and a node made for it and left without
        an entry goes again. Before, an interrupt between the fork and the insert, inside it, or
        after it, left pages counted for a holder nobody would ever release."""
        tree = self.tree
        node, depth = tree._descend(key)
        at = node if depth == len(key) else None
        displaced, tree.displaced = tree.displaced, None
        if at is not None and at.value is entry:
            if displaced is not None and displaced[0] is at and displaced[1] is not None:
                self._release(displaced[1])
            return
        try:
            self._release(entry)
        finally:
            if at is not None:
                tree.prune(at)

    def match(self, tokens) -> tuple[Context, int]:
        """A context holding the hit for ``tokens`` under the declared ``match`` semantics, and
        how many positions it holds; a miss is a new empty context and 0. Stamps the hit's entry."""
        if self.prefix_reuse_refused is not None:
            self._refuse_prefix_reuse("match")
        query, tokens = packed_query(tokens)     # a copy, validated: nothing of the caller's is kept
        with self.lock:
            node, matched = self.find_hit(self.tree, query)
            if node is None:
                found = self._new_context((), 0), 0
            else:
                self.tree.stamp(node)
                found = self._fork(node.value, length=matched), matched
        # The second tier (kvstate.remote) does I/O, so outside the lock; it retains what it restores.
        if self.second_tier is not None:
            try:
                found = self.second_tier.consult(self, unpacked(query) if tokens is None else tokens, found)
            except BaseException as error:     # noqa: BLE001 - SnapshotStore never raises here; a duck tier may
                if found[0].closed:
                    raise
                if not isinstance(error, Exception):     # an interrupt: the hit no caller will hold is let go
                    found[0].close()
                    raise
                try:
                    warnings.warn(SecondTierWarning(f"second tier {type(self.second_tier).__name__} raised "
                                                    f"{type(error).__name__}; the local hit was used"), stacklevel=2)
                except BaseException:     # the warning made an error: the hit no caller will hold is let go
                    found[0].close()
                    raise
        return found

    def clear(self) -> None:
        """Drop every entry of the tree."""
        with self.lock:
            entries = self.tree.clear()
            try:
                for entry in entries:
                    self._release(entry)
            except BaseException:
                # A store error or an interrupt part way: the entries are in no tree any more, so the
                # rest are released here or by nobody, ever (their pages leaked). An entry whose counts
                # went down is released (``PagePool.release_slots`` lets go of it in that step); one
                # interrupted before that is not, and is released here too. The first error is the one raised.
                for entry in entries:
                    if entry._holding is not RELEASED:
                        try:
                            self._release(entry)
                        except BaseException:       # noqa: BLE001 - the first error is the one raised
                            pass
                raise

    # -- snapshots -----------------------------------------------------------------------

    def restore(self, source, max_bytes: int | None = None, deadline_s: float | None = None,
                producer: bytes | None = None) -> Context:
        """A new context holding the snapshot at ``source`` (a path, URL or binary stream; a stream
        from its position to its end, which must be the snapshot's end: README, Snapshots).

        ``max_bytes``: refuse (``SnapshotTooLargeError``) a file whose restore would allocate more.
        ``deadline_s``: a URL's restore in all, retries included (else ``remote_deadline_s``'s
        order); past it ``SnapshotDeadlineError``, naming the deadline.

        Validated in full first: a refused file raises a ``SnapshotError`` subclass
        (a file at another precision whose values overflow this cache's f16:
        ``SnapshotPrecisionError``, a ``PrecisionRangeError`` too) and changes nothing.
        ``producer``: what must have computed the values (``Context.snapshot``'s), where the file
        names what did; a file naming another is ``SnapshotProducerError``. See ``impl/snapshot.py``.
        """
        return restore_snapshot(self, source, max_bytes, self.remote_deadline(deadline_s), producer)

    def remote_deadline(self, deadline_s: float | None = None):
        """The deadline a remote operation of this cache runs under: the call's, else the cache's;
        ``None``: the store's, the block's or the default, chosen where the operation runs."""
        return first_set((deadline_s, CALL), (self.remote_deadline_s, CACHE))

    # -- observation -------------------------------------------------------------------

    def __copy__(self):
        # A shallow copy shared the pool, tree and lock but counted context ids on its own: the two
        # handed out one id twice, and a close through one broke the other (an audit).
        raise TypeError("a Cache is not copied: share the object itself (it is thread-safe); for an "
                        "independent one, build a new Cache and restore snapshots into it")

    def observe(self) -> Observation:
        """Pages, holders, arena books, counters and the tree, for the invariants."""
        with self.lock:
            holders, lengths = {}, {}
            for ctx in self._contexts.values():
                name = f"ctx:{ctx.context_id}"
                holders[name] = page_ids(ctx._pages)
                lengths[name] = ctx._length
            entries = []
            for node in self.tree.entries():
                name = f"entry:{node.value.context_id}"
                holders[name] = page_ids(node.value._pages)
                lengths[name] = node.value._length
                entries.append(EntryView(node.key(), node.tick, name))
            pages = self._page_views(self.pool.live, self.store, self.page_tokens)
            size, out, free = self.store.arena_books()
            counters = self.store.counters.as_dict()
            counters.update(pages_allocated=self.pool.allocated, pages_freed=self.pool.freed,
                            live_contexts=len(self._contexts), entries=len(self.tree),
                            tree_pages=self.bounds.pages_held(self.tree), pressure_evictions=self.policy.evictions)
            return Observation(
                pages=pages, holders=holders, lengths=lengths,
                pages_allocated=self.pool.allocated, pages_freed=self.pool.freed,
                arena_size=size, arena_out=out, arena_free=free,
                tree=self.tree.view(lambda entry: tuple(entry._tokens().tolist())),
                entries=tuple(entries), counters=counters,
            )

    def stats(self) -> dict[str, int]:
        """Counters only: cheap enough to call in a serving loop."""
        with self.lock:
            counters = self.store.counters.as_dict()
            counters.update(pages_allocated=self.pool.allocated, pages_freed=self.pool.freed,
                            live_pages=self.pool.live_count, live_contexts=len(self._contexts),
                            entries=len(self.tree), tree_pages=self.tree.weight,
                            tree_bytes=self.tree.weight * self.store_page_bytes(),
                            pressure_evictions=self.policy.evictions)
            return counters

    def store_page_bytes(self) -> int:
        """Bytes one full page holds in stored form (values, q8 scales, token ids), as a snapshot body counts them."""
        return body_size(self.layout, self.precision, self.page_tokens)
