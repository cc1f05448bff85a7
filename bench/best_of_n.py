"""Best-of-N: sample N=8 continuations of 64 tokens from one 2,048-token prompt, forks versus independent copies.

Forks share the prompt's pages and copy only the partly filled last page, if any;
copies are what a contiguous cache needs: one full prompt cache per continuation.
A reduced GPT-2 shape (4 layers, 256 wide) keeps the run short: the memory
figures scale with the layout, and the time is dominated by the same decode in both.
"""

from __future__ import annotations

import time

import numpy as np

from kvstate.impl import Cache
from kvstate.model import GPT2, GPT2Config, ContiguousKV

N = 8


def sample(logits: np.ndarray, rng: np.random.Generator) -> int:
    """One token by the Gumbel-max trick (same draws for both methods: same seeds)."""
    return int(np.argmax(logits + rng.gumbel(size=logits.shape)))


def continue_all(model: GPT2, contexts, first_logits: np.ndarray, steps: int) -> list[list[int]]:
    outputs = []
    for branch, ctx in enumerate(contexts):
        rng = np.random.default_rng(branch)
        logits, tokens = first_logits, []
        for _ in range(steps):
            tokens.append(sample(logits, rng))
            logits = model.decode(ctx, tokens[-1])
        outputs.append(tokens)
    return outputs


def run(quick: bool = False) -> dict:
    prompt_len, steps = (512, 16) if quick else (2048, 64)
    config = GPT2Config(vocab_size=4096, n_positions=prompt_len + steps, n_embd=256, n_layer=4, n_head=4)
    model = GPT2.random(config, seed=1)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, prompt_len)

    cache = Cache(config.layout, page_tokens=64)
    parent = cache.allocate()
    first = model.prefill(parent, prompt)[-1]
    base = cache.stats()
    t0 = time.perf_counter()
    forks = [parent.fork() for _ in range(N)]
    fork_tokens = continue_all(model, forks, first, steps)
    fork_s = time.perf_counter() - t0
    grown = cache.stats()
    page_bytes = cache.store.page_bytes
    fork_bytes = (grown["live_pages"]) * page_bytes

    original = ContiguousKV(config.layout, prompt_len + steps)
    model.prefill(original, prompt)
    t0 = time.perf_counter()
    copies = []
    for _ in range(N):
        twin = ContiguousKV(config.layout, prompt_len + steps)
        twin.kv[...] = original.kv
        twin.token_ids[...] = original.token_ids
        twin.length = original.length
        copies.append(twin)
    copy_tokens = continue_all(model, copies, first, steps)
    copy_s = time.perf_counter() - t0
    copy_bytes = (N + 1) * original.kv.nbytes
    return {
        "name": "best_of_n",
        "params": {"n": N, "prompt_tokens": prompt_len, "new_tokens": steps,
                   "shape": "GPT-2 arch, 4 layers, 4 heads, 256 wide, f32, page_tokens 64"},
        "rows": [
            {"method": "forks", "kv_bytes": fork_bytes, "pages_allocated": grown["pages_allocated"] - base["pages_allocated"],
             "bytes_copied": grown["bytes_copied"] - base["bytes_copied"], "seconds": fork_s},
            {"method": "independent copies", "kv_bytes": copy_bytes, "pages_allocated": None,
             "bytes_copied": N * original.kv.nbytes, "seconds": copy_s},
        ],
        "ratio": {"copy_over_fork_memory": copy_bytes / fork_bytes, "copy_over_fork_time": copy_s / fork_s},
        "same_continuations": fork_tokens == copy_tokens,
    }
