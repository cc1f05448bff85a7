"""What a cache reports about itself so the invariants can be checked from outside.

A backend builds an ``Observation`` in ``cache.observe()``. Everything is plain
data (ints, tuples, dicts), so a foreign engine can produce one without
importing anything but this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PageView:
    page_id: int
    refcount: int
    slot: int | None          # arena slot backing the page, None for ordinary storage
    freed: bool = False       # True would be a bug: observations list live pages only
    dirty_tail: bool = False  # a position never written reads non-zero (a dirty slot)
    cached: bool = False      # kept by the prefix cache for reuse while no holder lists it (refcount 0)


@dataclass(frozen=True)
class NodeView:
    """One radix-tree node: the edge into it, its entry (if any), its children."""

    edge: tuple[int, ...]
    key: tuple[int, ...] | None   # the entry's key, None for a node without an entry
    children: tuple["NodeView", ...] = ()


@dataclass(frozen=True)
class EntryView:
    key: tuple[int, ...]
    tick: int
    # The holder name under which its pages appear; None where entries hold no reference to their
    # pages (a cached-page engine: vLLM's hash map counts in no block's ref_cnt, its pages are cached).
    holder: str | None


@dataclass(frozen=True)
class Observation:
    """What a backend exposes, in tiers: a part it cannot expose is None and the invariants
    over it are reported n/a (``spec.invariants.tiers``). Values, tokens, matched counts and
    errors are checked for every backend, from outside.

    Engines whose prefix cache keeps pages no context holds (refcount 0 in a free queue, as
    vLLM's) list them in ``pages`` with ``cached=True`` and refcount 0: invariant 1 then reads
    "refcount = holders" for them too, and invariant 2 counts them live until they are reused
    or dropped.
    """

    pages: dict[int, PageView] | None          # live pages by id (tier "pages")
    holders: dict[str, tuple[int, ...]] | None  # "ctx:N" / "entry:N" -> page ids, in order
    lengths: dict[str, int] | None             # holder -> number of positions
    pages_allocated: int                       # may be counted without the pages tier: invariant 6
    pages_freed: int                           # compares the two (0 and 0 from a black box)
    arena_size: int | None                     # tier "arena"
    arena_out: dict[int, int]                  # slot -> page id
    arena_free: tuple[int, ...]
    tree: NodeView | None                      # root; None where a backend has no tree (tier "shape")
    entries: tuple[EntryView, ...] | None      # eviction order, oldest first (tier "tree")
    counters: dict[str, int] = field(default_factory=dict)


def black_box() -> Observation:
    """The observation of a backend that exposes nothing beyond its public operations."""
    return Observation(pages=None, holders=None, lengths=None, pages_allocated=0, pages_freed=0,
                       arena_size=None, arena_out={}, arena_free=(), tree=None, entries=None)
