"""A deliberately broken backend: ``examples/listcache.py``, except that a write never copies a shared page.

A fork and its parent then write into the same page, so a write through one shows
in the other. ``kvstate conform examples/broken_sharing.py`` must reject it, and
print the short operation sequence that shows the leak.
"""

from __future__ import annotations

from listcache import ListCache, ListContext, factory as _working_factory


class SharingContext(ListContext):
    def writable(self, index: int):
        return self.pages[index]          # the bug: no copy, even when refcount > 1


class SharingCache(ListCache):
    context_class = SharingContext


def factory(config):
    return SharingCache(config)


factory.configs = _working_factory.configs
factory.any_page_size = _working_factory.any_page_size
