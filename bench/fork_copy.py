"""Fork vs copy: an 8-way fork of a 32-page context versus ``copy.deepcopy`` of the same contiguous cache.

The contiguous cache is what HF users hold and deep-copy to reuse a prompt:
per layer a (K, V) pair of ``(1, heads, tokens, head_dim)`` arrays.
"""

from __future__ import annotations

import copy

import numpy as np

from kvstate.impl import Cache
from kvstate.impl.context import FREE, Context
from kvstate.impl.context import _new_context as new_context
from kvstate.model import GPT2Config

from .timing import best_of

WAYS = 8
PAGES = 32
FORK_US = 1.5       # issue 15's target for one fork of a 32-page context
# Best of 200 groups of WAYS forks (a few ms in all): on a shared virtual machine whole seconds
# run 1.5-2x slow, and 20 groups could all fall inside such a stretch.
REPEAT = 200
COPY_REPEAT = 3     # groups of deep copies, and of forks for the ratio against them
DEEPCOPY_OVER_FORK = 100    # the target for deepcopy_over_fork_time


def run(quick: bool = False) -> dict:
    layout = GPT2Config.small().layout
    page_tokens = 16            # 32 pages = 512 tokens of GPT-2-small K/V: 37.7 MB
    tokens = PAGES * page_tokens
    cache = Cache(layout, page_tokens=page_tokens)
    ctx = cache.allocate()
    kv = np.random.default_rng(0).standard_normal(layout.batch_shape(tokens), dtype=np.float32)
    ctx.extend(np.arange(tokens), kv)
    contiguous = [(np.ascontiguousarray(kv[None, :, layer, 0].transpose(0, 2, 1, 3)),
                   np.ascontiguousarray(kv[None, :, layer, 1].transpose(0, 2, 1, 3))) for layer in range(layout.layers)]
    cache_bytes = sum(k.nbytes + v.nbytes for k, v in contiguous)

    before = cache.stats()
    forks = [ctx.fork() for _ in range(WAYS)]
    after = cache.stats()
    for f in forks:
        f.close()

    def fork_only():
        return [ctx.fork() for _ in range(WAYS)]

    held = []
    fork_s = best_of(lambda: held.append(fork_only()), repeat=REPEAT)
    for group in held:
        for f in group:
            f.close()
    # Shares are deferred, one count on the holding the forks share, until a count is looked at
    # (impl/refcounts.py ``Refcounts``): a fork alone says little on its own, so a fork closed again and
    # a fork whose counts are then read (a flush: one vectorised step) are measured too.
    cycle_s = best_of(lambda: [ctx.fork().close() for _ in range(WAYS)], repeat=REPEAT)

    def fork_then_flush():
        group = fork_only()
        cache.pool.refcounts        # reading the counts adds the pending shares
        held.append(group)
    held = []
    flushed_s = best_of(fork_then_flush, repeat=REPEAT)
    for group in held:
        for f in group:
            f.close()
    # The ratio's two sides get the same chances at a quiet moment: best of 3 groups each (a deep copy of
    # 8 x 37.7 MB is too slow for 200). The best of 200 fork groups above is for the fixed µs target only;
    # against a best of 3 copies it gave the fork ~67x the chances of a lucky minimum. Not interleaved: a
    # fork right after a 300 MB copy would run with every cache flushed, which no user's fork does.
    copy_s = best_of(lambda: [copy.deepcopy(contiguous) for _ in range(WAYS)], repeat=COPY_REPEAT)
    held = []
    ratio_fork_s = best_of(lambda: held.append(fork_only()), repeat=COPY_REPEAT)
    for group in held:
        for f in group:
            f.close()
    held = []
    ratio = copy_s / ratio_fork_s
    fork_us = 1e6 * fork_s / WAYS
    floor_us = 1e6 * best_of(lambda: held.append(bare_forks(ctx)), repeat=REPEAT) / WAYS
    held = []
    return {
        "name": "fork_vs_copy",
        "params": {"ways": WAYS, "pages": PAGES, "page_tokens": page_tokens, "layout": "GPT-2 small (12, 12, 64) f32"},
        "rows": [
            {"method": "fork", "pages_allocated": after["pages_allocated"] - before["pages_allocated"],
             "bytes_copied": after["bytes_copied"] - before["bytes_copied"], "seconds": fork_s,
             "us_per_fork": 1e6 * fork_s / WAYS},
            {"method": "copy.deepcopy", "pages_allocated": None, "bytes_copied": WAYS * cache_bytes,
             "seconds": copy_s, "us_per_fork": 1e6 * copy_s / WAYS},
            {"method": "fork then close", "pages_allocated": 0, "bytes_copied": 0, "seconds": cycle_s,
             "us_per_fork": 1e6 * cycle_s / WAYS},
            {"method": "floor: the context object and the cache lock, no refcount step", "pages_allocated": 0,
             "bytes_copied": 0, "seconds": floor_us * WAYS / 1e6, "us_per_fork": floor_us},
            {"method": f"{WAYS} forks, then their counts read", "pages_allocated": 0, "bytes_copied": 0,
             "seconds": flushed_s, "us_per_fork": 1e6 * flushed_s / WAYS},
        ],
        "ratio": {"deepcopy_over_fork_time": ratio},
        "command": "python -m kvstate bench fork_copy",
        "targets": {f"deepcopy_over_fork_time >= {DEEPCOPY_OVER_FORK} (best of {COPY_REPEAT} groups each)":
                    f"{ratio:.0f} {'met' if ratio >= DEEPCOPY_OVER_FORK else 'MISSED'}",
                    f"us per fork of {PAGES} pages <= {FORK_US:g}": f"{fork_us:.2f} {'met' if fork_us <= FORK_US else 'MISSED'}"
                    + ("" if fork_us <= FORK_US else f"; floor {floor_us:.2f} us (context object + cache lock, no refcount "
                       f"step; the rest, {fork_us - floor_us:.2f} us, is the refcount step and the calls and checks around it); design that passes: {FORK_DESIGN}")},
    }


FORK_DESIGN = ("built: a slotted context whose owner is a flag under the cache lock (no lock per context); "
               "its page list, slots, length, key and base in one Holding that every change replaces whole, "
               "so a fork's child holds the very same object (one reference copied, nothing to test) and the "
               "fork's pending count is an int on it; the child built slot by slot (no __init__ call). "
               "What remains over the floor: that count and the child's registration in the cache")


def bare_forks(ctx) -> list:
    """What a fork cannot do without, ``WAYS`` times: the cache lock, the busy-flag test and a new
    context object holding its parent's holding; no refcount step, no registration. Never closed
    (nothing was counted): the caller drops them."""
    cache, out = ctx._cache, []
    for _ in range(WAYS):
        with cache.lock:
            if ctx._use:
                raise RuntimeError("the bench's context is in use")
            child = new_context(Context)          # as ``Context.fork`` builds its child
            child._cache = cache
            child.context_id = cache._next_context_id = cache._next_context_id + 1
            child._holding = ctx._holding
            child._use = FREE
            out.append(child)
    return out
