"""The paged engine.

Where things live:
- ``cache.py``    the cache: store, pool, tree, live contexts, the lock
- ``context.py``  contexts; ``Context.writable`` is the only place a page is copied
- ``pages.py``    pages, refcounts, and the one release path
- ``radix.py``    the radix prefix tree (match, retain, eviction)
- ``arena.py``    slot books for a preallocated arena
- ``store.py``    what a page store provides (the ``PageStore`` protocol, counters)
- ``numpy.py``    the NumPy page store (and factory); ``torch.py`` the torch one
- ``snapshot.py`` writing a context to a snapshot file, restoring one
"""

from .cache import Cache
from .context import Context

__all__ = ["Cache", "Context"]
