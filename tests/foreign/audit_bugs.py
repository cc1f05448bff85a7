"""Planted bugs in the audit's engine (``tests/foreign/audit_minimal.py``), one subclass each.

Each is a mistake an engine author could plausibly make; its docstring names the promise it
breaks. Run one with ``kvstate conform tests/foreign/audit_bugs.py:NAME`` (``NAME`` a key of
``BUGS``, each exported as a module-level factory with the engine's ``configs``).
"""

from __future__ import annotations

from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.errors import CapacityError

from . import audit_minimal as base


# 1 ------------------------------------------------------------------------------------------
class EvictNewestForRoom(base.AuditCache):
    """``evict``: a full pool evicts the MOST recently used entries first (a sort without reverse
    the wrong way round). Breaks: eviction for room, least recently used first."""

    def make_room(self, need):
        if not need or not self.pool or self.live + need <= self.pool:
            return
        if self.config.on_full == "refuse":
            raise CapacityError("full")
        for entry in sorted(self.entries, key=lambda e: -e.stamp):
            if self.live + need <= self.pool:
                break
            if any(p.ctx_refs == 0 for p in entry.pages):
                self.drop(entry)


# 2 ------------------------------------------------------------------------------------------
class CowCtx(base.AuditContext):
    def writable(self, index):
        page = self.pages[index]
        if page.ctx_refs > 1:       # forgets that entries hold references too
            copy = self.cache.new_page()
            copy.values[:] = page.values
            copy.tokens[:] = page.tokens
            self.cache.ref(copy, ctx=True)
            self.cache.unref(page, ctx=True)
            self.pages[index] = copy
        return self.pages[index]


class CowIgnoresEntries(base.AuditCache):
    """Copy-on-write looks at context references only: a write into a page only an entry shares
    lands in place. Breaks: invariant 4/5 (a retained entry's values never change)."""
    context_class = CowCtx


# 3 ------------------------------------------------------------------------------------------
class NoTailCopyCtx(base.AuditContext):
    def extend_need(self, n):
        if n == 0:
            return 0
        return pages_needed(self.length + n, self.cache.page_tokens) - len(self.pages)


class NeedOmitsTailCopy(base.AuditCache):
    """An extend's need omits the copy of a shared, partly filled last page. Breaks: the pool rule
    (refuse: accepts past the pool; evict: evicts too few)."""
    context_class = NoTailCopyCtx


# 4 ------------------------------------------------------------------------------------------
class StampAllCandidates(base.AuditCache):
    """A hit stamps every entry holding the hit's last block, not only the one that gave it.
    Breaks: block ties / only the entry giving the hit is stamped (eviction order)."""

    def match(self, tokens):
        tokens = base.check_tokens(tokens)
        ctx, n = super().match(tokens)
        if n:
            query = tuple(int(t) for t in tokens)
            h = self.chain(query, n // self.block)[-1]
            for e in sorted(self.index.get(h, ()), key=lambda e: e.stamp):
                if e.key[:n] == query[:n]:
                    self.clock += 1
                    e.stamp = self.clock
        return ctx, n


# 5 ------------------------------------------------------------------------------------------
class TieFirstRetained(base.AuditCache):
    """Block ties go to the first entry published under the hash (vLLM's ``get_cached_block``
    returns the first block cached under a hash), not the most recently used. Breaks: block ties."""

    def lookup(self, query):
        blocks, parent, best = 0, 0, None
        B = self.block
        for i in range(len(query) // B):
            parent = hash((parent, tuple(int(t) for t in query[i * B:(i + 1) * B])))
            holders = self.index.get(parent)
            if not holders:
                break
            blocks, best = i + 1, holders
        if not blocks:
            return None, 0
        return best[0], blocks


# 6 ------------------------------------------------------------------------------------------
class UnchainedHash(base.AuditCache):
    """Blocks after the first hashed alone, not chained to their predecessor (the first block only is
    tagged as first), and the index trusted without comparing tokens: a key's later block matches a
    query's later block at another position, or after another first block. Breaks: a hit is a
    prefix of a retained key."""

    def chain(self, tokens, limit=None):
        B = self.block
        full = len(tokens) // B
        n = full if limit is None else min(full, limit)
        return [hash((i if i == 0 else 1, tuple(int(t) for t in tokens[i * B:(i + 1) * B]))) for i in range(n)]

    def lookup(self, query):
        blocks, best = 0, None
        hashes = self.chain(query)
        for i, h in enumerate(hashes):
            holders = self.index.get(h)
            if not holders:
                break
            blocks, best = i + 1, holders
        if not blocks:
            return None, 0
        return max(best, key=lambda e: e.stamp), blocks


class HashWithoutParent(UnchainedHash):
    """Every block hashed alone (the parent left out), the index trusted: a key's later block matches
    at a query's start. Breaks: a hit is a prefix of a retained key (README's own example)."""

    def chain(self, tokens, limit=None):
        B = self.block
        full = len(tokens) // B
        n = full if limit is None else min(full, limit)
        return [hash(tuple(int(t) for t in tokens[i * B:(i + 1) * B])) for i in range(n)]


# 7 ------------------------------------------------------------------------------------------
class RefuseMidway(base.AuditCache):
    """``refuse``: the pool is checked page by page as pages are taken, so a refused extend has
    already written its first pages. Breaks: a refused operation changes nothing."""

    def make_room(self, need):
        if self.config.on_full == "refuse":
            return
        super().make_room(need)

    def new_page(self):
        if self.config.on_full == "refuse" and self.pool and self.live >= self.pool:
            raise CapacityError("pool exhausted")
        return super().new_page()


# 8 ------------------------------------------------------------------------------------------
class TruncCtx(base.AuditContext):
    def truncate(self, n):
        self._open()
        if not (base._is_int(n) and 0 <= n <= self.length):
            raise base.PositionError(f"truncate to {n}")
        keep = min(len(self.pages), int(n) // self.cache.page_tokens + 1)     # off by one at a page boundary
        for page in self.pages[keep:]:
            self.cache.unref(page, ctx=True)
        del self.pages[keep:]
        self.length = int(n)

    def extend_need(self, n):       # consistent with the pages it keeps
        if n == 0:
            return 0
        P = self.cache.page_tokens
        need = max(0, pages_needed(self.length + n, P) - len(self.pages))
        if self.length % P and self.pages[-1].refcount > 1:
            need += 1
        return need


class TruncateKeepsPage(base.AuditCache):
    """``truncate`` to a page boundary keeps the page past it (``n // P + 1``): every read is right,
    but the pool counts a page no position needs. Breaks: the pool rule (refusing or evicting early)."""
    context_class = TruncCtx


# 9 ------------------------------------------------------------------------------------------
class ClearKeepsIndex(base.AuditCache):
    """``clear()`` releases every entry's pages but forgets the hash index: a cleared key still
    hits, on pages it no longer holds. Breaks: clear() drops every entry."""

    def clear(self):
        for entry in list(self.entries):
            self.entries.remove(entry)
            for page in entry.pages:
                self.unref(page, ctx=False)


# 10 -----------------------------------------------------------------------------------------
class EvictSkipsShared(base.AuditCache):
    """``evict``: skips an entry every page of which another entry also keeps ("it frees nothing"),
    so two entries sharing their pages are never evicted. Breaks: eviction for room (an entry whose
    pages another entry keeps too is evicted as well)."""

    def make_room(self, need):
        if not need or not self.pool or self.live + need <= self.pool:
            return
        if self.config.on_full == "refuse":
            raise CapacityError("full")
        for entry in sorted(self.entries, key=lambda e: e.stamp):
            if self.live + need <= self.pool:
                break
            frees = [p for p in entry.pages if p.refcount == 1]
            if frees:
                self.drop(entry)


# 11 -----------------------------------------------------------------------------------------
class PartialHitNoStamp(base.AuditCache):
    """A hit shorter than the key of the entry giving it does not refresh that entry (only a match
    of a whole key counts as a use). Breaks: a hit stamps the entry giving it (eviction order)."""

    def match(self, tokens):
        query = tuple(int(t) for t in base.check_tokens(tokens))
        entry, blocks = self.lookup(query)
        if entry is None:
            return self.allocate(), 0
        n = blocks * self.block
        if n == len(entry.key):
            self.clock += 1
            entry.stamp = self.clock
        return self.new_context(list(entry.pages[:pages_needed(n, self.page_tokens)]), n), n


BUGS = {
    "evict_newest_for_room": EvictNewestForRoom,
    "cow_ignores_entries": CowIgnoresEntries,
    "need_omits_tail_copy": NeedOmitsTailCopy,
    "stamp_all_candidates": StampAllCandidates,
    "tie_first_retained": TieFirstRetained,
    "unchained_hash": UnchainedHash,
    "hash_without_parent": HashWithoutParent,
    "refuse_midway": RefuseMidway,
    "truncate_keeps_page": TruncateKeepsPage,
    "clear_keeps_index": ClearKeepsIndex,
    "evict_skips_shared": EvictSkipsShared,
    "partial_hit_no_stamp": PartialHitNoStamp,
}


def _make(cls):
    def factory(config):
        return cls(config)
    factory.configs = base.factory.configs
    factory.__name__ = cls.__name__
    return factory


for _name, _cls in BUGS.items():
    globals()[_name] = _make(_cls)
