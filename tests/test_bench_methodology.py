"""The benchmarks' methodology, on stubs and made-up rows (no timing asserted beyond a sleep):
what each side is charged, what a verdict is decided on, which tree is the baseline."""

import time
from types import SimpleNamespace

import numpy as np

from kvstate.bench.one_token_pages import serve_requests


class _Books:
    """Refcounts' stand-in whose read (the flush of a pending hold) takes a known time."""

    def __init__(self):
        self.reads = 0

    @property
    def counts(self):
        self.reads += 1
        time.sleep(0.02)
        return np.zeros(1)


class _Cache:
    """A cache stub: ``match`` hits ``hit`` tokens at once; ``pool.books`` where ``books`` is given."""

    def __init__(self, page, hit, books=None):
        self.page_tokens, self.hit = page, hit
        self.layout = SimpleNamespace(position_shape=(1,))
        if books is not None:
            self.pool = SimpleNamespace(books=books)

    def match(self, tokens):
        ctx = SimpleNamespace(extend=lambda tokens, kv: None, close=lambda: None)
        return ctx, min(self.hit, len(tokens))

    def retain(self, ctx):
        pass


def test_a_hit_ending_inside_a_page_is_charged_its_hold_in_the_lookup():
    """The extend after a hit ending inside a page reads the counts, adding the hit's pending hold:
    that read is timed in ``match`` (as SGLang's ``inc_lock_ref`` is), once per such request."""
    queries = [np.arange(40)] * 3
    books = _Books()
    match_s, _, _ = serve_requests(_Cache(16, 20, books), queries)
    assert books.reads == 3 and (match_s >= 0.02).all()
    for hit in (32, 40):        # a page boundary (nothing reads the counts), or the whole request (no extend)
        books = _Books()
        match_s, _, _ = serve_requests(_Cache(16, hit, books), queries)
        assert books.reads == 0 and (match_s < 0.02).all()
    books = _Books()
    assert serve_requests(_Cache(1, 20, books), queries)[2] == 60 and books.reads == 0     # page 1: never inside
    assert serve_requests(_Cache(16, 20), queries)[2] == 60       # an older checkout without the books still runs
