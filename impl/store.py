"""What a page store provides to the engine.

A store owns the memory of pages at one precision: it allocates zeroed pages
(from its arena while slots last, ordinary storage after), writes encoded
positions into a page, reads them back as float32 (or in their stored form, for
snapshots), and copies a whole page.
``copy`` is the copy primitive; the engine calls it from ``Context.writable``
and nowhere else.

Threads: ``allocate``, ``allocate_all``, ``free``, ``free_all``, ``copy``, ``is_zero_from``,
``arena_books`` and the counters run under the cache lock; ``encode``, ``recycle``, ``write``, ``write_whole``, ``read``,
``read_layer``, ``gather``, ``read_encoded``, ``from_encoded``, ``read_empty`` and
``concat`` run outside it, concurrently on different pages, so no two calls may
use one scratch buffer or other mutable state at once (the NumPy store's encode
scratch is taken by one encode until ``recycle`` hands it back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvstate.spec.layout import Layout


@dataclass
class StoreCounters:
    arena_issued: int = 0      # pages placed in an arena slot
    arena_returned: int = 0
    heap_pages: int = 0        # pages placed in ordinary storage
    heap_fallbacks: int = 0    # ... of which because the arena was full
    pages_copied: int = 0
    bytes_copied: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class Buffer(Protocol):
    slot: int | None


class PageStore(Protocol):
    layout: Layout
    page_tokens: int
    precision: str
    arena_pages: int
    counters: StoreCounters

    def encode(self, kv: Any) -> Any:
        """Validate (finite, representable) and encode a position-major batch; writes nothing."""

    def recycle(self, encoded: Any) -> None:
        """``encode``'s result is read no more: scratch memory behind it may serve the next encode.
        Optional: the engine calls it through ``recycle`` below, which skips a store without it."""

    def allocate(self, page_id: int) -> Buffer:
        """A zeroed page for ``page_id``: an arena slot if one is free, else ordinary storage."""

    def allocate_all(self, first_page_id: int, count: int) -> list[Buffer]:
        """``allocate`` of pages ``first_page_id`` to ``first_page_id + count - 1``, all or none (what
        it made is freed before an error propagates). Optional: the pool calls ``allocate`` a page
        where a store has none."""

    def free(self, buffer: Buffer) -> None:
        """Return the page's memory (its arena slot, if it has one)."""

    def free_all(self, buffers: list[Buffer]) -> None:
        """``free`` of each of ``buffers`` (a release's pages: hundreds at one-token pages), in one call."""

    def copy(self, source: Buffer, page_id: int) -> Buffer:
        """A new page for ``page_id`` holding the same bytes as ``source``."""

    def write(self, buffer: Buffer, offset: int, encoded: Any, lo: int, hi: int) -> None:
        """Store rows ``[lo, hi)`` of ``encoded`` at page offsets ``[offset, offset + hi - lo)``."""

    def write_whole(self, buffers: list[Buffer], encoded: Any, row: int) -> None:
        """``write`` of whole pages, one page's rows each from ``row`` on, in order. Optional: a
        context writes page by page where a store has none."""

    def read(self, buffer: Buffer, start: int, stop: int) -> Any:
        """Positions ``[start, stop)`` of the page, position-major float32: a fresh array, never a view
        of the page (the caller may keep or change it)."""

    def read_empty(self) -> Any:
        """What ``read`` of no positions returns: float32 of shape ``layout.batch_shape(0)``."""

    def concat(self, parts: list[Any]) -> Any:
        """``read`` results of consecutive pages joined along the first axis (one part: itself)."""

    def read_encoded(self, buffer: Buffer, start: int, stop: int) -> tuple[Any, ...]:
        """Positions ``[start, stop)`` in the stored form, position-major, as NumPy arrays.

        ``(values,)`` for f32/f16, ``(codes, scales)`` for q8: ``spec.precision``'s encoded
        form, what a snapshot body holds. May be views: copy before the page is written again.
        """

    def from_encoded(self, parts: tuple[Any, ...]) -> Any:
        """Position-major NumPy parts in this store's precision -> the rows ``write`` takes.

        The inverse of ``read_encoded`` without re-quantising, so a same-precision restore is
        bit-exact. The caller has already validated the parts (snapshot checks); nothing is written.
        """

    def read_layer(self, buffer: Buffer, layer: int, start: int, stop: int) -> tuple[Any, Any]:
        """K and V of one layer at page offsets ``[start, stop)``, each ``(n, kv_heads, head_dim)`` float32.

        May return views into the page (``Context.read_layer_pages`` hands them to
        the forward pass, which only reads them; ``Context.read_layer`` gathers).
        """

    def gather(self, parts: list[Any], layer_shape: tuple[int, ...]) -> Any:
        """One fresh contiguous array of ``parts`` joined along the first axis (``layer_shape`` when empty)."""

    def is_zero_from(self, buffer: Buffer, offset: int) -> bool:
        """Whether every stored byte at page offsets ``>= offset`` is zero."""

    def arena_books(self) -> tuple[int, dict[int, int], tuple[int, ...]]:
        """(arena size, slot -> page id for issued slots, free slots)."""


def recycle(store: PageStore, encoded: Any) -> None:
    """``store.recycle(encoded)`` where the store has it: a third-party page store written before
    ``recycle`` existed keeps no scratch, so it has nothing to take back."""
    hand_back = getattr(store, "recycle", None)
    if hand_back is not None:
        hand_back(encoded)
