"""The built-in torch backends: ``kvstate conform kvstate.impl.torch`` (CUDA when available,
else CPU), ``...:cpu_factory`` and ``...:cuda_factory``.

A factory module only, so imports run one way: this module -> ``cache.py`` ->
``torch_store.py`` (the store). Importing it needs torch.
"""

from __future__ import annotations

import torch  # noqa: F401  (``kvstate.impl.torch`` is importable exactly where torch is)

from kvstate.spec.protocol import SEMANTICS_TAGS, Config

from .cache import Cache
from .torch_store import TorchBuffer, TorchStore, default_device  # noqa: F401  (where callers looked for them)


def make_factory(device: str | None):
    """A factory building torch-store caches on ``device`` (None: CUDA when available, else CPU)."""
    def factory(config: Config) -> Cache:
        return Cache.from_config(config, store="torch", device=device or default_device())
    factory.__doc__ = f"The built-in torch backend on {device or 'CUDA when available, else CPU'}."
    factory.thread_safe = True      # kvstate conform runs the thread-race scenarios against it
    factory.semantics = SEMANTICS_TAGS
    return factory


factory = make_factory(None)        # kvstate conform kvstate.impl.torch
cpu_factory = make_factory("cpu")   # kvstate conform kvstate.impl.torch:cpu_factory
cuda_factory = make_factory("cuda")
