"""Planted bugs in the audit3 engine (``tests/foreign/audit3_locks.py``), one subclass each.

Each breaks one promise of README.md, named in its docstring. Run one with

    PYTHONPATH=. python -m kvstate conform tests/foreign/audit3_locks_bugs.py:NAME --workers 1

(``NAME`` a key of ``BUGS``; each is exported as a module-level factory with the engine's
``configs`` and ``thread_safe``). ``audit3_repro/run_bugs.sh`` runs them all.
"""

from __future__ import annotations

from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.errors import CapacityError

try:
    from . import audit3_locks as base
except ImportError:         # loaded as a plain file
    import importlib.util
    import pathlib
    import sys
    _path = pathlib.Path(__file__).with_name("audit3_locks.py")
    _spec = importlib.util.spec_from_file_location("audit3_locks", _path)
    base = importlib.util.module_from_spec(_spec)
    sys.modules["audit3_locks"] = base
    _spec.loader.exec_module(base)

LockCache, LockContext = base.LockCache, base.LockContext


# 1 ------------------------------------------------------------------------------
class NoCopyContext(LockContext):
    """Copy-on-write: a write into a page another holder shares lands in place (invariant 4)."""

    def writable(self, index):
        return self.pages[index]


class WriteSharedNoCopy(LockCache):
    context_class = NoCopyContext


# 2 ------------------------------------------------------------------------------
class HitNotStamped(LockCache):
    """Hits stamp their entry: a hit leaves its entry's recency as it was."""

    def stamp(self, entry):
        pass


# 3 ------------------------------------------------------------------------------
class EvictsEntryContextsNeed(LockCache):
    """Eviction for room: evicts the least recently used entry whatever a context lists, so an entry
    whose every page a context still holds (evicting it frees nothing) goes first."""

    def eviction_candidate(self):
        return min(self.entries, key=lambda e: e.tick) if self.entries else None


# 4 ------------------------------------------------------------------------------
class LeakContext(LockContext):
    def close(self):
        with self.lock:
            self._open()
            with self.cache.lock:
                for page in self.pages[:-1]:       # the last page's reference is never given back
                    self.cache.release(page)
                self.pages = []
                self.closed = True
                del self.cache.contexts[self.serial]


class RefcountLeakOnClose(LockCache):
    """Invariants 1, 6: close gives back every page but its last (a refcount leaked)."""

    context_class = LeakContext


# 5 ------------------------------------------------------------------------------
class ForkNoContextLock(LockContext):
    def fork(self):
        self._open()
        with self.cache.lock:                       # the parent's lock not taken
            return self.cache.adopt(list(self.pages), self.length)


class ForkWithoutContextLock(LockCache):
    """Concurrency: fork skips the parent's lock, so it can share a page the parent is writing
    (made private under the cache lock, bytes landing with the context lock alone): the write
    then shows in the branch, or the branch copies half-written bytes."""

    context_class = ForkNoContextLock


# 6 ------------------------------------------------------------------------------
class CloseNoCacheLock(LockContext):
    def close(self):
        with self.lock:
            self._open()
            for page in self.pages:                 # refcounts and the books changed outside the cache lock
                self.cache.release(page)
            self.pages = []
            self.closed = True
            self.cache.contexts.pop(self.serial, None)


class CloseWithoutCacheLock(LockCache):
    """Concurrency: close releases its pages without the cache lock (refcounts, live pages and the
    contexts' dict changed while another thread evicts, matches or observes)."""

    context_class = CloseNoCacheLock


# 7 ------------------------------------------------------------------------------
class CloseWrongOrder(LockContext):
    def close(self):
        with self.cache.lock:                       # cache lock first, then the context's: the documented
            with self.lock:                         # order reversed (deadlocks against fork/extend)
                self._open()
                for page in self.pages:
                    self.cache.release(page)
                self.pages = []
                self.closed = True
                del self.cache.contexts[self.serial]


class CloseLocksInWrongOrder(LockCache):
    """Concurrency: close takes the cache lock before the context's (a deadlock with a fork or
    extend of the same context holding the context's lock and waiting for the cache lock)."""

    context_class = CloseWrongOrder


# 8 ------------------------------------------------------------------------------
class EagerPartialCopy(LockCache):
    """A hit ending inside a page gets its own copy of that page at match time, but the entry's
    page keeps the reference the hit would have held (invariant 1: refcount 2, holders 1)."""

    def match(self, tokens):
        ctx, matched = super().match(tokens)
        size = self.page_tokens
        if matched % size:
            with ctx.lock, self.lock:
                shared = ctx.pages[-1]
                private = self.new_page()
                private.values[:] = shared.values
                private.tokens[:] = shared.tokens
                ctx.pages[-1] = private              # no release of ``shared``: its refcount stays raised
        return ctx, matched


# 9 ------------------------------------------------------------------------------
class EvictionFreesShared(LockCache):
    """Eviction for room frees every page of the evicted entry, though a context still lists
    some (invariant 2: a holder lists a freed page)."""

    def make_room(self, need):
        if not need or not self.limit or self.config.on_full != "evict":
            return super().make_room(need)
        while len(self.live) + need > self.limit:
            victim = self.eviction_candidate()
            if victim is None:
                return
            self.entries.remove(victim)
            for page in victim.pages:
                if page.page_id in self.live:
                    del self.live[page.page_id]      # freed whatever its refcount
                    self.freed += 1
                page.refcount = 0


# 10 -----------------------------------------------------------------------------
class LateRefuseContext(LockContext):
    def _prepare(self, start, stop, need):
        cache = self.cache
        if cache.config.on_full != "refuse":
            return super()._prepare(start, stop, need)
        size = cache.page_tokens
        before = len(cache.live)
        while len(self.pages) < pages_needed(stop, size):
            self.pages.append(cache.new_page())      # new pages taken first ...
        if before + need > cache.limit:              # ... the right count, judged too late
            raise CapacityError(f"{before} live pages + {need} needed > pool of {cache.limit}")
        for index in range(start // size, (stop - 1) // size + 1):
            self.writable(index)


class CapacityErrorAfterChange(LockCache):
    """A refusing pool counts the need right but raises CapacityError after it took the new pages
    (README: a refused operation changes nothing; the context keeps pages past its length)."""

    context_class = LateRefuseContext


# 11 -----------------------------------------------------------------------------
class NoPartialCopyNeed(LockContext):
    def extend_need(self, n):
        if n == 0:
            return 0
        return pages_needed(self.length + n, self.cache.page_tokens) - len(self.pages)


class NeedIgnoresPartialCopy(LockCache):
    """An extend's need leaves out the copy of a shared, partly filled last page (a token hit ending
    inside a page), so a full pool evicts one page too few and goes past the pool."""

    context_class = NoPartialCopyNeed


# 12 -----------------------------------------------------------------------------
class MaxPagesCountsShared(LockCache):
    """max_pages counts physical pages (shared pages once), not each entry's own pages."""

    def enforce_bounds(self, newest):
        def over():
            pages = len({id(p) for e in self.entries for p in e.pages})
            return len(self.entries) > self.config.max_entries or bool(self.config.max_pages and pages > self.config.max_pages)
        while over() and len(self.entries) > 1:
            self.drop(min((e for e in self.entries if e is not newest), key=lambda e: e.tick))


# 13 -----------------------------------------------------------------------------
class TieOldestWins(LockCache):
    """Token match: of entries tied for a hit the least recently used gives it (and is stamped)."""

    def match(self, tokens):
        from kvstate.spec.layout import check_tokens
        query = tuple(int(t) for t in check_tokens(tokens, private=False))
        with self.lock:
            best, winner = 0, None
            for entry in self.entries:
                common = base._common(entry.key, query)
                if common and (common > best or (common == best and entry.tick < winner.tick)):
                    best, winner = common, entry
            if winner is None:
                return self.adopt([], 0), 0
            self.stamp(winner)
            return self.adopt(winner.pages[:pages_needed(best, self.page_tokens)], best), best


# 14 -----------------------------------------------------------------------------
class StampOutsideLock(LockCache):
    """Concurrency: match picks its entry under the cache lock but stamps it after letting go (an
    eviction in between can drop the entry the hit came from, or stamp order crosses)."""

    def stamp(self, entry):
        self._pending = entry                       # stamped later, outside the lock


def _stamp_late_match(self, tokens, _match=LockCache.match):
    self._pending = None
    ctx, matched = _match(self, tokens)
    entry = getattr(self, "_pending", None)
    if entry is not None:
        entry.tick = self.tick()                    # outside the cache lock
    return ctx, matched


StampOutsideLock.match = _stamp_late_match


BUGS = {
    "write_shared_no_copy": WriteSharedNoCopy,
    "hit_not_stamped": HitNotStamped,
    "evicts_entry_contexts_need": EvictsEntryContextsNeed,
    "refcount_leak_on_close": RefcountLeakOnClose,
    "fork_without_context_lock": ForkWithoutContextLock,
    "close_without_cache_lock": CloseWithoutCacheLock,
    "close_locks_in_wrong_order": CloseLocksInWrongOrder,
    "eager_partial_copy": EagerPartialCopy,
    "eviction_frees_shared": EvictionFreesShared,
    "capacity_error_after_change": CapacityErrorAfterChange,
    "need_ignores_partial_copy": NeedIgnoresPartialCopy,
    "max_pages_counts_shared": MaxPagesCountsShared,
    "tie_oldest_wins": TieOldestWins,
    "stamp_outside_lock": StampOutsideLock,
}


def _export(name, cls):
    def make(config):
        return cls(config)
    make.__name__ = make.__qualname__ = name
    make.configs = base.factory.configs
    make.thread_safe = True
    return make


for _name, _cls in BUGS.items():
    globals()[_name] = _export(_name, _cls)
