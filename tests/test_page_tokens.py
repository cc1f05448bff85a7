"""A page's token ids are its row of the pool's page table (``impl/page_table.py``), read through
``Page.tokens`` and ``Context.tokens``: what is written must read back through every way a page is
made, including a pickled or deep-copied cache, and a copy-on-write page gets a row of its own."""

import copy
import pickle
import threading

import numpy as np

from kvstate.impl import Cache
from kvstate.spec import Layout

TINY = Layout(1, 1, 1)


def _zeros(n):
    return np.zeros((n, *TINY.position_shape), np.float32)


def _cache_with_half_page():
    cache = Cache(TINY, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend([7], _zeros(1))
    return cache, ctx


def _clone(copier):
    """A copy of a cache and its context made by ``copier``; the lock does not copy, the page books do."""
    cache, ctx = _cache_with_half_page()
    cache.lock = None
    clone_cache, clone = copier((cache, ctx))
    clone_cache.lock, cache.lock = threading.RLock(), threading.RLock()
    return ctx, clone


def test_a_write_after_a_deep_copy_lands_in_the_tokens_read_back():
    ctx, clone = _clone(copy.deepcopy)
    clone.extend([9], _zeros(1))
    assert clone.tokens == [7, 9]
    assert ctx.tokens == [7]                # the original is not the clone's memory


def test_a_write_after_pickling_lands_in_the_tokens_read_back():
    ctx, clone = _clone(lambda state: pickle.loads(pickle.dumps(state)))
    clone.extend([9], _zeros(1))
    assert clone.tokens == [7, 9]


def test_writable_copies_token_ids_into_memory_of_their_own():
    cache, ctx = _cache_with_half_page()
    cache.retain(ctx)
    ctx.extend([9], _zeros(1))              # the shared half page is copied by writable first
    (entry,) = [node.value for node in cache.tree.entries()]
    assert entry.tokens == [7] and ctx.tokens == [7, 9]
    assert ctx._pages[0].ref != entry._pages[0].ref      # a row of the token table of its own
