"""The paged engine.

Where things live:
- ``cache.py``    the cache: store, pool, tree, live contexts, the lock
- ``context.py``  contexts; ``Context.writable`` is the only place a page is copied
- ``holding.py``  what a context holds (pages, refcount slots, length, key), replaced whole on every change
- ``pages.py``    pages, their refcount slots, and the one release path
- ``refcounts.py``  the refcount array, and the shares a fork or hit leaves pending until a count is read
- ``page_table.py``  each page's token ids and ``filled`` mark, in arrays by refcount slot
- ``radix.py``    the radix prefix tree (match, retain, eviction)
- ``arena.py``    slot books for a preallocated arena
- ``matching.py``    what a ``match`` hit returns, per declared semantics (entry, token, block)
- ``query.py``   a lookup's token ids checked and packed; ``TokenIds``, ids checked once as a conversation grows
- ``tree_bounds.py``  the tree's bounds (``max_entries``, the page budget ``max_pages``)
- ``pool_policy.py``  what a full pool does (``on_full``: fall back, evict, refuse)
- ``store.py``    what a page store provides (the ``PageStore`` protocol, counters)
- ``numpy_store.py``, ``torch_store.py``  the NumPy and torch page stores
- ``numpy.py``, ``torch.py``  the built-in backend factories (``kvstate conform kvstate.impl.numpy``)
- ``snapshot.py`` writing a context to a snapshot file, restoring one; ``remote_io.py`` the same at fsspec URLs
- ``memory.py``   what a store or a restore may allocate on this machine

Imports run one way: a factory module -> ``cache.py`` -> the rest (tests/test_import_graph.py).
"""

from .cache import Cache
from .context import Context
from .query import TokenIds

__all__ = ["Cache", "Context", "TokenIds"]
