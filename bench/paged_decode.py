"""Paged vs contiguous attention: one GPT-2-small decode step over K/V read from pages or from one array.

Both contexts hold the same random K/V (the step's cost does not depend on
where the values came from, so no prefill is needed to fill them). The paged
step reads each layer's pages in place (``Context.read_layer_pages``); the
contiguous one reads views of one preallocated array, as an HF-style cache does.
Both run the same blocked attention (64-position blocks). A third column runs
the contiguous cache with attention over the whole array in one matmul per
layer (``model.block = None``): the best our code does without blocks.
"""

from __future__ import annotations

import numpy as np

from kvstate.impl import Cache
from kvstate.model import GPT2, GPT2Config, ContiguousKV
from kvstate.model.numpy_gpt2 import ATTENTION_BLOCK

from .timing import best_of


def run(quick: bool = False, model: GPT2 | None = None) -> dict:
    lengths = [512] if quick else [512, 4096]
    config = GPT2Config.small(n_positions=max(lengths) + 8)
    model = model if model is not None and model.config.n_positions > max(lengths) else GPT2.random(config)
    layout = config.layout
    rows = []
    rng = np.random.default_rng(0)
    for n in lengths:
        kv = rng.standard_normal(layout.batch_shape(n), dtype=np.float32)
        tokens = rng.integers(0, config.vocab_size, n)
        cache = Cache(layout, page_tokens=64)
        paged = cache.allocate()
        paged.extend(tokens, kv)
        contiguous = ContiguousKV(layout, n + 1)
        contiguous.extend(tokens, kv)

        def paged_step():
            with paged.fork() as step:
                model.decode(step, 7)

        def contiguous_step():
            model.decode(contiguous, 7)
            contiguous.length = n          # drop the step's position again

        def unblocked_step():
            model.block = None
            try:
                contiguous_step()
            finally:
                model.block = ATTENTION_BLOCK

        repeat = 3 if n > 1000 else 5
        p, c = best_of(paged_step, repeat), best_of(contiguous_step, repeat)
        u = best_of(unblocked_step, repeat)
        rows.append({"tokens": n, "paged_ms": 1e3 * p, "contiguous_ms": 1e3 * c, "contiguous_one_matmul_ms": 1e3 * u,
                     "paged_over_contiguous": p / c, "paged_over_one_matmul": p / u})
        paged.close()
    return {"name": "paged_vs_contiguous_decode", "params": {"shape": "GPT-2 small, f32, page_tokens 64"},
            "rows": rows, "targets": {"paged_over_contiguous": 1.25}}
