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
    holder: str               # the holder name under which its pages appear


@dataclass(frozen=True)
class Observation:
    pages: dict[int, PageView]                 # live pages by id
    holders: dict[str, tuple[int, ...]]        # "ctx:N" / "entry:N" -> page ids, in order
    lengths: dict[str, int]                    # holder -> number of positions
    pages_allocated: int
    pages_freed: int
    arena_size: int
    arena_out: dict[int, int]                  # slot -> page id
    arena_free: tuple[int, ...]
    tree: NodeView | None                      # root; None where a backend has no tree
    entries: tuple[EntryView, ...]             # eviction order: oldest tick first
    counters: dict[str, int] = field(default_factory=dict)
