"""``finelock``'s engine with a try-lock per context (audit s67/audit3): a context already in use by
another thread is refused by name (``ContextBusyError``, nothing changed) instead of waited for.
Everything else (tree lock, pool lock, lock order) is ``finelock``'s."""

from __future__ import annotations

import threading

from kvstate.spec.errors import ContextBusyError

try:
    from . import finelock as base
except ImportError:         # loaded as a plain file: kvstate's loader puts its folder on sys.path
    import finelock as base


class TryLock:
    def __init__(self):
        self._lock = threading.Lock()

    def __enter__(self):
        if not self._lock.acquire(blocking=False):
            raise ContextBusyError("this context is in use by another thread")
        return self

    def __exit__(self, *exc):
        self._lock.release()


class TryContext(base.Context):
    def __init__(self, cache, pages, length):
        super().__init__(cache, pages, length)
        self.lock = TryLock()


class TryCache(base.FineLockCache):
    context_class = TryContext


def factory(config):
    return TryCache(config)


factory.configs = base.factory.configs
factory.any_page_size = True
factory.thread_safe = True
