"""SGLang under memory pressure (``on_full="reclaim"``): a pool of the declared size, whose tree
``evict``s for room as SGLang's scheduler does when ``alloc`` fails.

The engine's code is the same as ``kvstate.engines.sglang``'s (``RadixCache``, the slot allocators);
what differs is how the adapter holds pages, so that a full pool is judged on what the suite counts:

- SGLang has no fork, no clear while requests run and no writes into the tree, so the adapter's
  emulations of them copied pages (``sglang.py``): harmless in a pool no run fills, but a fork or a
  ``clear()`` that allocates would be refused where the declared pool has room. Here a private page
  is shared by holders the adapter counts (``HeldPages``): a fork holds its source's private pages, a
  write into a shared page copies that page alone (``writable``), and a context that stops holding
  tree nodes (``clear()``, a write or truncate into the tree's part) holds their pages itself instead
  of copying them.
- The tree is given ``HeldPages`` as its allocator: when it evicts a leaf (``free_segment``) it lets
  go of its hold, and a page goes back to SGLang's allocator once no holder is left.
- An allocation that ``alloc`` cannot serve is refused (``CapacityError``, nothing changed) when even
  every page only unlocked tree nodes hold would not make room; else ``tree.evict`` runs for the
  shortfall, SGLang's policy choosing the leaves, until ``alloc`` succeeds.
"""

from __future__ import annotations

import torch

from kvstate.spec.errors import CapacityError

from .sglang import SGLangCache, SGLangContext


class HeldPages:
    """The allocator the tree is given: SGLang's own, with each page's holders counted (a context's
    private hold, a tree node's), a page freed to SGLang's allocator when its last holder lets go."""

    def __init__(self, allocator, page: int):
        self.allocator, self.page = allocator, page
        self.holders: dict[int, int] = {}      # page number (slot // page) -> holders

    def __getattr__(self, name):          # ``device`` and the rest: SGLang's allocator's
        return getattr(self.allocator, name)

    def pages(self, slots) -> list[int]:
        return sorted({slot // self.page for slot in slots})

    def take(self, slots) -> None:
        for page in self.pages(slots):
            self.holders[page] = 1

    def hold(self, slots) -> None:
        for page in self.pages(slots):
            self.holders[page] += 1

    def release(self, slots) -> None:
        freed = []
        for page in self.pages(slots):
            self.holders[page] -= 1
            if not self.holders[page]:
                del self.holders[page]
                freed.append(page * self.page)
        if freed:
            self.allocator.free(torch.tensor(freed, dtype=torch.int64))

    def shared(self, slot: int) -> bool:
        return self.holders[slot // self.page] > 1

    def free_segment(self, free_index, *, start_pos: int) -> None:
        """The tree evicted a node: its hold on the node's pages goes."""
        self.release(free_index.tolist())


class ReclaimingContext(SGLangContext):
    """A request whose private pages [protected, len) are held through ``HeldPages``."""

    def _private_pages(self) -> list[int]:
        """The first slot of each private page."""
        return self.slots[self.protected::self.cache.page]

    def extend(self, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv)
        if not tokens:
            return
        page, length = self.cache.page, len(self)
        room = (-length) % page                  # free positions in the last, private, partial page
        copy = bool(room) and self.cache.held.shared(self.slots[-1])
        new = -(-(len(tokens) - min(room, len(tokens))) // page)
        fresh = self.cache.alloc_pages(copy + new)          # all at once: a refusal changes nothing
        if copy:
            self._replace_page(length - length % page, fresh[:page])
            fresh = fresh[page:]
        slots = [self.slots[-1] + 1 + i for i in range(min(room, len(tokens)))]
        slots += fresh[:len(tokens) - len(slots)]
        self.cache.store(slots, values)
        self.slots += slots
        self._tokens += tokens

    def _replace_page(self, first: int, fresh: list[int]) -> None:
        """The private page from position ``first`` copied into ``fresh``, whose hold replaces the old one."""
        cache = self.cache
        old = self.slots[first:first + cache.page]
        cache.store(fresh[:len(old)], cache.values_at(old))
        cache.held.release(old)
        self.slots[first:first + len(old)] = fresh[:len(old)]

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv, start)
        if not tokens:
            return
        page = self.cache.page
        firsts = range(start - start % page, start + len(tokens), page)
        # a page of the tree's part is shared once this request holds it (the tree keeps it too)
        copied = [first for first in firsts if first < self.protected or self.cache.held.shared(self.slots[first])]
        fresh = self.cache.alloc_pages(len(copied))        # first: a refusal changes nothing
        if start < self.protected:
            self._hold_privately_from(start - start % page)
        for i, first in enumerate(copied):
            self._replace_page(first, fresh[i * page:(i + 1) * page])
        self.cache.store(self.slots[start:start + len(tokens)], values)
        self._tokens[start:start + len(tokens)] = tokens

    def _hold_privately_from(self, boundary: int) -> None:
        """Positions [boundary, protected) held as private pages (the same slots, held through
        ``HeldPages``), the tree held only up to ``boundary`` (page-aligned)."""
        self.cache.held.hold(self.slots[boundary:self.protected])
        self._hold_to(boundary, [])

    def fork(self) -> "ReclaimingContext":
        self._open()
        cache = self.cache
        cache.held.hold(self._private_pages())
        held = cache.hold_again(self.node) if self.node is not None else None
        return cache.register(type(self)(cache, list(self._tokens), list(self.slots), self.protected, held))

    def truncate(self, n: int) -> None:
        self._check_truncate(n)
        page, was_protected = self.cache.page, self.protected
        if n < self.protected:          # the tree's part from n's page on: its kept positions held privately
            boundary = n - n % page
            self.cache.held.hold(self.slots[boundary:n])
            self._hold_to(boundary, [])
        first = max(was_protected, -(-n // page) * page)      # pages wholly past n that were private
        self.cache.held.release(self.slots[first::page])
        del self.slots[n:]
        del self._tokens[n:]

    def _let_go_of_private(self) -> None:
        self.cache.held.release(self._private_pages())


class ReclaimingCache(SGLangCache):
    context_class = ReclaimingContext

    def _make_tree(self, allocator):
        self.held = HeldPages(allocator, self.page)
        return self.rc.RadixCache.create_simulated(mock_allocator=self.held, page_size=self.page)

    def alloc_pages(self, pages: int) -> list[int]:
        tokens = pages * self.page
        if not tokens:
            return []
        slots = self.alloc(tokens)
        if slots is None:
            slots = self._alloc_after_evicting(tokens)
        slots = slots.tolist()
        self.held.take(slots)
        return slots

    def _alloc_after_evicting(self, tokens: int):
        """As SGLang's scheduler does when ``alloc`` fails: ``evict`` the tree's unlocked leaves for the
        shortfall, then ``alloc`` again. Refused first, changing nothing, when even every page only
        unlocked nodes hold would not make room (the pages requests hold plus the need pass the pool)."""
        free, reclaimable = self.allocator.available_size(), self._reclaimable_pages() * self.page
        if free + reclaimable < tokens:
            raise CapacityError(f"{tokens} slots wanted, {free} free and {reclaimable} reclaimable from the tree")
        while (slots := self.alloc(tokens)) is None:
            if not self.tree.evictable_size():
                raise AssertionError("sglang adapter: the tree had no more to evict, though its pages counted")
            short = tokens - self.allocator.available_size()
            self.evicted_tokens += self.tree.evict(self.rc.EvictParams(num_tokens=short)).num_tokens_evicted
        return slots

    def _reclaimable_pages(self) -> int:
        """Pages every holder of which is an unlocked tree node: evicting those nodes frees them."""
        unlocked: dict[int, int] = {}
        stack = list(self.tree.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.lock_ref == 0:
                for page in self.held.pages(node.value.tolist()):
                    unlocked[page] = unlocked.get(page, 0) + 1
        return sum(1 for page, count in unlocked.items() if count == self.held.holders[page])

    def free_slots(self, slots: list[int]) -> None:
        """A request's private pages let go (one slot per page)."""
        self.held.release(slots)

    def clear(self) -> None:
        for ctx in self.contexts:
            if ctx.protected:
                ctx._hold_privately_from(0)
        self.tree.evict(self.rc.EvictParams(num_tokens=self.tree.evictable_size() + 1))
