"""``PageTable`` (``impl/page_table.py``) writes a holder's token ids and raises its pages' ``filled``
marks in one vectorised step, or page by page for a few pages. Every small write, with the holder's
slots consecutive (a range: slices) or scattered (an array: gathers), must leave exactly what a
page-by-page loop over ``span_in_page`` leaves."""

import numpy as np

from kvstate.impl.page_table import SCALAR_PAGES, PageTable
from kvstate.spec.arithmetic import pages_touched, span_in_page

PAGES = 9       # a holder's pages in every case


def _slot_lists(pages: int):
    """The holder's slots: consecutive (from 2) and scattered, as the pool hands them out."""
    yield range(2, 2 + pages)
    yield np.array([11, 3, 7, 0, 12, 5, 9, 1, 14][:pages], np.intp)


def _cases():
    for page_tokens in (1, 2, 3, 5):
        for slots in _slot_lists(PAGES):
            for start in range(0, 2 * page_tokens + 2):
                for stop in range(start + 1, min(PAGES * page_tokens, start + 6 * page_tokens) + 1):
                    yield page_tokens, slots, start, stop


def _table(page_tokens: int, seed: int) -> PageTable:
    """A table whose marks and ids are already partly set, as a holder's pages' are mid-conversation."""
    rng = np.random.default_rng(seed)
    table = PageTable(16, page_tokens)
    table.filled[:] = rng.integers(0, page_tokens + 1, 16)
    table.ids[:] = rng.integers(0, 1000, (16, page_tokens))
    return table


def test_raise_filled_and_write_match_a_page_by_page_loop():
    cases = vectorised = 0
    for page_tokens, slots, start, stop in _cases():
        table, want = _table(page_tokens, cases), _table(page_tokens, cases)
        ids = np.arange(start, stop) + 5000
        table.raise_filled(slots, start, stop)
        table.write(slots, start, ids)
        for index in range(*pages_touched(start, stop, page_tokens)):
            lo, hi = span_in_page(index, start, stop, page_tokens)
            slot = slots[index]
            want.filled[slot] = max(want.filled[slot], hi)
            row = index * page_tokens + lo - start
            want.ids[slot, lo:hi] = ids[row:row + hi - lo]
        assert (table.filled == want.filled).all(), (page_tokens, slots, start, stop)
        assert (table.ids == want.ids).all(), (page_tokens, slots, start, stop)
        cases += 1
        vectorised += -(-stop // page_tokens) - start // page_tokens > SCALAR_PAGES
    assert cases > 500 and vectorised > 100


def test_gather_is_the_rows_in_order_and_a_copy():
    table = _table(3, 0)
    for slots in _slot_lists(5):
        got = table.gather(slots)
        assert got.tolist() == [i for slot in slots for i in table.ids[slot].tolist()]
        got[:] = -1                 # the caller's own: the table is unchanged
        assert (table.ids >= 0).all()


def test_grow_keeps_every_row():
    table = _table(2, 1)
    ids, filled = table.ids.copy(), table.filled.copy()
    table.grow(40)
    assert table.ids.shape == (40, 2) and (table.ids[:16] == ids).all() and (table.filled[:16] == filled).all()
    assert not table.ids[16:].any() and not table.filled[16:].any()
