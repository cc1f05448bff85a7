"""The built-in NumPy backend: ``kvstate conform kvstate.impl.numpy``.

A factory module only, so imports run one way: this module -> ``cache.py`` ->
``numpy_store.py`` (the store).
"""

from __future__ import annotations

from kvstate.spec.protocol import SEMANTICS_TAGS, Config

from .cache import Cache
from .numpy_store import NumpyBuffer, NumpyStore  # noqa: F401  (the store, where callers looked for it)


def factory(config: Config) -> Cache:
    """A cache on the NumPy store for ``config``."""
    return Cache.from_config(config, store="numpy")


factory.thread_safe = True             # kvstate conform runs the thread-race scenarios against it
factory.semantics = SEMANTICS_TAGS     # and checks it under every declared semantics
