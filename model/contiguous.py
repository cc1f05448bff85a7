"""A plain contiguous K/V cache: the baseline that benchmarks compare pages with.

What an HF-style cache is: one preallocated array per layer, grown in place,
read as a view. Same calls the model uses on a ``Context`` (``len``, ``layout``,
``precision``, ``read_layer_pages``, ``extend``); f32 only; no sharing.
"""

from __future__ import annotations

import numpy as np

from kvstate.spec.errors import PositionError
from kvstate.spec.layout import Layout, check_tokens, check_values


class ContiguousKV:
    precision = "f32"

    def __init__(self, layout: Layout, capacity: int):
        self.layout = layout
        self.capacity = capacity
        self.kv = np.zeros((layout.layers, 2, capacity, layout.kv_heads, layout.head_dim), np.float32)
        self.token_ids = np.zeros(capacity, np.int64)
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def extend(self, tokens, kv) -> None:
        tokens = check_tokens(tokens)
        kv = check_values(self.layout, kv, len(tokens))
        stop = self.length + len(tokens)
        if stop > self.capacity:
            raise PositionError(f"{stop} positions exceed the capacity {self.capacity}")
        self.kv[:, :, self.length:stop] = np.moveaxis(kv, 0, 2)
        self.token_ids[self.length:stop] = tokens
        self.length = stop

    def read_layer_pages(self, layer: int):
        """One part: views of K and V ``(n, kv_heads, head_dim)``, no copy, which is the point of the baseline."""
        return [(self.kv[layer, 0, :self.length], self.kv[layer, 1, :self.length])]
