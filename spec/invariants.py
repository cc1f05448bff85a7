"""The six invariants of ARCHITECTURE.md as predicates.

Each ``check_*`` raises ``InvariantViolation`` naming the invariant and the
offending page, holder, position or node, and returns None when it holds.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain
from typing import Iterable, Mapping

import numpy as np

from .arithmetic import pages_needed
from .errors import InvariantViolation
from .observation import NodeView, Observation


TIERS = ("pages", "arena", "tree", "shape")
NO_ARENA = "a backend without an arena reports arena_size=None"


def tiers(obs: Observation) -> list[str]:
    """The observation tiers a backend exposes beyond the black box (values, tokens, matched
    counts and errors, which every backend gets checked on): ``pages`` (invariants 1, 2, 6),
    ``arena`` (3), ``tree`` (entries and eviction order, 5) and ``shape`` (the radix tree, 5).

    ``arena_size`` 0 is the arena tier of a configuration without an arena: its books hold no
    slot, so invariant 3 says only that no page has one. A backend without an arena reports None."""
    exposed = {"pages": obs.pages is not None and obs.holders is not None,
               "arena": obs.arena_size is not None, "tree": obs.entries is not None,
               "shape": obs.tree is not None}
    return [name for name in TIERS if exposed[name]]


def check_arena_size(obs: Observation, arena_pages: int) -> None:
    """3. An arena the backend reports has the configuration's ``arena_pages`` slots."""
    if obs.arena_size is None or obs.arena_size == arena_pages:
        return
    hint = f"; {NO_ARENA}" if obs.arena_size == 0 else ""
    raise InvariantViolation(3, f"the arena has {obs.arena_size} slots, the configuration {arena_pages} "
                                f"(arena_pages){hint}")


NAMED = 12      # holders a violation names before "and N more": a page a hundred contexts hold is one line


def check_refcounts(obs: Observation) -> None:
    """1. A page's refcount equals the number of holders that point at it (0 for a cached page)."""
    if obs.pages is None or obs.holders is None:
        return
    held = Counter(chain.from_iterable(obs.holders.values()))
    for pid, page in obs.pages.items():
        if page.refcount != held.get(pid, 0):
            # A holder listing the page twice is named so: "2 holders ['ctx:2']" hid the fault.
            holders = sorted(h if pages.count(pid) == 1 else f"{h}, {pages.count(pid)} times"
                             for h, pages in obs.holders.items() if pid in pages)
            shown = holders if len(holders) <= NAMED else [*holders[:NAMED], f"and {len(holders) - NAMED} more"]
            raise InvariantViolation(
                1, f"page {pid} has refcount {page.refcount} but {held.get(pid, 0)} holders {shown}")


def check_liveness(obs: Observation) -> None:
    """2. No holder points at a freed page; no live page but a cached one has refcount <= 0;
    allocated - freed = live (cached pages included)."""
    if obs.pages is None or obs.holders is None:
        return
    live = {pid for pid, page in obs.pages.items() if not page.freed}
    for holder, pages in obs.holders.items():
        if live.issuperset(pages):
            continue        # the common case, in one set operation; the first freed page is located below
        for index, pid in enumerate(pages):
            if pid not in live:
                raise InvariantViolation(2, f"{holder} page list[{index}] points at freed page {pid}")
    for pid, page in obs.pages.items():
        if page.refcount < 0 or (page.refcount == 0 and not page.cached):
            raise InvariantViolation(2, f"live page {pid} has refcount {page.refcount}"
                                        f"{' and is not marked cached' if page.refcount == 0 else ''}")
        if page.cached and page.refcount != 0:
            raise InvariantViolation(2, f"page {pid} is marked cached but has refcount {page.refcount}")
    if obs.pages_allocated - obs.pages_freed != len(obs.pages):
        raise InvariantViolation(
            2, f"pages allocated {obs.pages_allocated} - freed {obs.pages_freed} "
               f"!= {len(obs.pages)} live pages")


def check_page_counts(obs: Observation, page_tokens: int) -> None:
    """2, for each holder: it lists exactly the pages its length needs at ``page_tokens`` a page.
    A page past them is one that ``truncate`` should have released (or an ``extend`` made and
    never used): held until the holder closes, it is memory nothing can read, which a bounded
    pool would evict or refuse over while the reference has room."""
    if obs.holders is None or obs.lengths is None:
        return
    for holder, pages in obs.holders.items():
        length = obs.lengths.get(holder)
        if length is None:
            continue
        needed = pages_needed(length, page_tokens)
        if len(pages) != needed:
            why = "pages past its length are still held" if len(pages) > needed else "positions without a page"
            raise InvariantViolation(
                2, f"{holder} lists {_pages(len(pages))} for its {length} positions, which need {needed} at "
                   f"{page_tokens} a page: {why}")


def _pages(n: int) -> str:
    return f"{n} page" + "s" * (n != 1)


def check_arena(obs: Observation) -> None:
    """3. Out slots back live pages, no slot is claimed twice, out + free = size; issued slots are clean."""
    if obs.arena_size is None or obs.pages is None:
        return
    claimed: dict[int, int] = {}
    for pid, page in obs.pages.items():
        if page.slot is None:
            continue
        if page.slot in claimed:
            raise InvariantViolation(3, f"pages {claimed[page.slot]} and {pid} both claim arena slot {page.slot}")
        claimed[page.slot] = pid
    for slot, pid in obs.arena_out.items():
        if pid not in obs.pages:
            raise InvariantViolation(3, f"arena slot {slot} is out for page {pid}, which is not live")
        if obs.pages[pid].slot != slot:
            raise InvariantViolation(3, f"arena slot {slot} is out for page {pid}, which uses slot {obs.pages[pid].slot}")
    if set(claimed) != set(obs.arena_out):
        missing = sorted(set(claimed) ^ set(obs.arena_out))
        raise InvariantViolation(3, f"arena slots {missing} disagree between pages and the arena's books")
    free = set(obs.arena_free)
    if len(free) != len(obs.arena_free) or free & set(obs.arena_out):
        raise InvariantViolation(3, f"arena free list {sorted(obs.arena_free)} repeats or overlaps out slots")
    if len(obs.arena_out) + len(free) != obs.arena_size:
        raise InvariantViolation(
            3, f"arena out {len(obs.arena_out)} + free {len(free)} != size {obs.arena_size}")
    for pid, page in obs.pages.items():
        if page.dirty_tail:
            raise InvariantViolation(3, f"page {pid} (slot {page.slot}) reads non-zero where nothing was written")


def check_values(
    engine: Mapping[str, tuple[np.ndarray, np.ndarray]],
    reference: Mapping[str, tuple[np.ndarray, np.ndarray]],
) -> None:
    """4. Every position of every live context reads exactly what its reference twin reads.

    Both mappings are context name -> (values, tokens) of the whole context.
    Equality is bitwise (``array_equal``), never approximate.
    """
    if set(engine) != set(reference):
        raise InvariantViolation(4, f"live contexts differ: engine {sorted(engine)} vs reference {sorted(reference)}")
    for name in sorted(reference):
        values, tokens = engine[name]
        want_values, want_tokens = reference[name]
        if _same_bytes(tokens, want_tokens) and _same_bytes(values, want_values):
            continue        # the common case, in one memcmp each; a difference is located below
        if len(tokens) != len(want_tokens):
            raise InvariantViolation(4, f"{name} has {len(tokens)} positions, reference has {len(want_tokens)}")
        if not np.array_equal(tokens, want_tokens):
            pos = int(np.flatnonzero(np.asarray(tokens) != np.asarray(want_tokens))[0])
            raise InvariantViolation(4, f"{name} position {pos}: token {tokens[pos]} != reference {want_tokens[pos]}")
        if values.shape != want_values.shape or values.dtype != want_values.dtype:
            raise InvariantViolation(
                4, f"{name} values {values.dtype}{values.shape} != reference {want_values.dtype}{want_values.shape}")
        differs = values.view(np.uint32) != want_values.view(np.uint32)
        if differs.any():
            index = tuple(int(i) for i in np.argwhere(differs)[0])
            raise InvariantViolation(
                4, f"{name} position {index[0]} (index {index}): {values[index]!r} != reference {want_values[index]!r}")


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal, dtype and shape included: what invariant 4 asks, as one byte comparison."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check_tree(obs: Observation, expected: Iterable[tuple[tuple[int, ...], int]], block_tokens: int = 0) -> None:
    """5. Entry set and eviction order equal the reference's; the tree is a well-formed radix tree.

    Only the order of the keys is compared: tick numbers are each side's own bookkeeping (a clock
    may start anywhere, reset on ``clear`` or advance on a miss without changing any behaviour).
    An entry holds its key's positions; under ``match="block"`` (``block_tokens``) at least its whole
    blocks: no hit reaches past them, so the rest is the engine's to keep or not (vLLM keeps none).
    """
    if obs.entries is None:
        return
    expected = [tuple(key) for key, _tick in expected]
    actual = [tuple(entry.key) for entry in obs.entries]
    if actual != expected:
        raise InvariantViolation(5, f"entry keys in eviction order (oldest first) {actual} != reference {expected}")
    for entry in obs.entries:
        if obs.lengths is None or entry.holder is None:     # an entry that holds no pages (EntryView)
            continue
        if entry.holder not in obs.lengths:
            raise InvariantViolation(5, f"entry {entry.key} names holder {entry.holder!r}, which lengths does not "
                                        f"list (an entry holding no pages, as a cached-page engine's, names None)")
        held, key = obs.lengths[entry.holder], len(entry.key)
        if held != key and not (block_tokens and key - key % block_tokens <= held < key):
            raise InvariantViolation(5, f"entry {entry.key} holds {held} positions, key has {key}" + (
                f" (at least its whole blocks of {block_tokens}: {key - key % block_tokens})" if block_tokens else ""))
    if obs.tree is None:
        return
    keys = _check_nodes(obs.tree)
    if sorted(keys) != sorted(expected):
        raise InvariantViolation(5, f"keys spelled by the tree {sorted(keys)} != entries {sorted(expected)}")


def _check_nodes(root: NodeView) -> list[tuple[int, ...]]:
    """Every node's shape, walked with an explicit stack (chat-style retains nest thousands deep);
    the entry keys the tree spells."""
    keys: list[tuple[int, ...]] = []
    stack: list[tuple[NodeView, tuple[int, ...], bool]] = [(root, (), True)]
    while stack:
        node, path, is_root = stack.pop()
        spelled = path + tuple(node.edge)
        if not is_root:
            if not node.edge:
                raise InvariantViolation(5, f"node under {path} has an empty edge")
            if node.key is None and len(node.children) == 1:
                raise InvariantViolation(5, f"node {spelled} has no entry and one child: it should have collapsed")
            if node.key is None and not node.children:
                raise InvariantViolation(5, f"node {spelled} has no entry and no children: it should have been pruned")
        if node.key is not None:
            if tuple(node.key) != spelled:
                raise InvariantViolation(5, f"entry {node.key} sits at path {spelled}")
            keys.append(tuple(node.key))
        firsts = [child.edge[0] for child in node.children if child.edge]
        if len(firsts) != len(set(firsts)):
            raise InvariantViolation(5, f"children of {spelled} share a first token: {sorted(firsts)}")
        stack.extend((child, spelled, False) for child in reversed(node.children))
    return keys


def check_empty(obs: Observation) -> None:
    """6. After closing every context and clearing the tree, cache and arena are empty
    (cached pages too: ``clear`` drops whatever the prefix cache keeps). The counts of pages allocated
    and freed are compared without the pages tier too: an engine's allocator may count what it has
    out without listing pages (a black box reports 0 and 0)."""
    if obs.pages or obs.holders or obs.entries:
        raise InvariantViolation(
            6, f"not empty: {len(obs.pages or ())} live pages, holders {sorted(obs.holders or ())}, "
               f"{len(obs.entries or ())} entries")
    if obs.pages_allocated != obs.pages_freed:
        raise InvariantViolation(6, f"allocated {obs.pages_allocated} != freed {obs.pages_freed}: "
                                    f"{_pages(obs.pages_allocated - obs.pages_freed)} still out")
    if obs.arena_size is not None and (obs.arena_out or len(obs.arena_free) != obs.arena_size):
        raise InvariantViolation(6, f"arena slots still out: {sorted(obs.arena_out)}")
    if obs.tree is not None and (obs.tree.children or obs.tree.key is not None):
        raise InvariantViolation(6, "the tree still has nodes after clear")


def check_structure(obs: Observation) -> None:
    """Invariants 1-3: everything about pages and the arena that needs no reference."""
    check_refcounts(obs)
    check_liveness(obs)
    check_arena(obs)
