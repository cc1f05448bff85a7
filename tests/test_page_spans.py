"""``Context``'s page loops take each page's span from ``_page_spans``: ``span_in_page`` (the spec's
checked arithmetic) for the first and the last page, whole pages between. Every case of small
writes must give exactly what ``span_in_page`` gives for every page ``pages_touched`` names."""

from kvstate.impl.context import _page_spans, _whole_pages
from kvstate.spec.arithmetic import pages_touched, span_in_page


def _writes(extra_pages: int):
    """(page_tokens, start, stop, what ``span_in_page`` gives for every page touched) for small writes."""
    for page_tokens in (1, 2, 3, 4, 7, 64):
        for start in range(0, 3 * page_tokens + 2):
            for stop in range(start + 1, start + extra_pages * page_tokens + 3):
                yield page_tokens, start, stop, [(index, *span_in_page(index, start, stop, page_tokens))
                                                 for index in range(*pages_touched(start, stop, page_tokens))]


def test_page_spans_are_span_in_page_for_every_page_touched():
    cases = 0
    for page_tokens, start, stop, want in _writes(4):
        assert list(_page_spans(start, stop, page_tokens)) == want, (start, stop, page_tokens)
        cases += 1
    assert cases > 10_000


def test_whole_pages_are_those_covered_whole_and_the_spans_skip_them():
    """``Context._write`` writes the whole pages between in one store call (``write_whole``) and the
    rest span by span: together, every page touched, each once, each whole page really whole."""
    runs = 0
    for page_tokens, start, stop, want in _writes(5):
        whole = _whole_pages(start, stop, page_tokens)
        covered = [index for index, lo, hi in want if (lo, hi) == (0, page_tokens)]
        assert list(whole) == (covered if len(covered) > 1 else []), (start, stop, page_tokens)
        assert list(_page_spans(start, stop, page_tokens, skip=whole)) == \
            [span for span in want if span[0] not in whole], (start, stop, page_tokens)
        runs += len(whole) > 1
    assert runs > 5_000
