"""``finelock``'s engine with a try-lock per context (audit s67/audit3): a context already in use by
another thread is refused by name (``ContextBusyError``, nothing changed) instead of waited for.
Everything else (tree lock, pool lock, lock order) is ``finelock``'s."""

from __future__ import annotations

import threading

from kvstate.spec.errors import ContextBusyError

try:
    from . import finelock as base
except ImportError:         # loaded as a plain file
    import importlib.util
    import pathlib
    import sys
    _path = pathlib.Path(__file__).with_name("finelock.py")
    _spec = importlib.util.spec_from_file_location("finelock", _path)
    base = importlib.util.module_from_spec(_spec)
    sys.modules["finelock"] = base
    _spec.loader.exec_module(base)


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
