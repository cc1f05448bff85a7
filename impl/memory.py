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
    """``ConfigError`` for an arena larger than the machine's memory (it is allocated when the
    cache is built). A single page is allocated only at the first write, so a cache with huge
    pages can still be built and used for restores that are refused before allocating."""
    limit = physical_memory()
    if limit is not None and arena_pages and page_bytes * arena_pages > limit:
        raise ConfigError(f"an arena of {arena_pages} pages of {page_bytes} bytes is more than this machine's "
                          f"memory ({limit} bytes)")
