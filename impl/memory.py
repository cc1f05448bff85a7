"""How much memory this machine has: the ceiling for one cache's arena and one restore."""

from __future__ import annotations

import os

from kvstate.spec.errors import ConfigError


def physical_memory() -> int | None:
    """Bytes of RAM on this machine, where the OS says; None where it does not."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_store_size(page_bytes: int, arena_pages: int) -> None:
    """``ConfigError`` for a page, or an arena, larger than the machine's memory.

    Without it ``Cache(page_tokens=2**62)`` or ``arena_pages=2**62`` fails with NumPy's
    ``ValueError`` or a ``MemoryError`` from deep inside the allocator, or only at the first write.
    """
    limit = physical_memory()
    if limit is None:
        return
    for what, size in (("one page", page_bytes), (f"an arena of {arena_pages} pages", page_bytes * arena_pages)):
        if size > limit:
            raise ConfigError(f"{what} takes {size} bytes, more than this machine's memory ({limit} bytes)")
