"""The integer arithmetic that paging and the radix tree rest on.

The engine calls these functions instead of re-deriving them, so the contracts
below (checked by CrossHair, see ``kvstate spec-check``) cover the engine's own
pointer arithmetic.
"""

from __future__ import annotations


def page_of(position: int, page_tokens: int) -> int:
    """Index of the page that holds ``position``.

    pre: position >= 0
    pre: page_tokens >= 1
    post: __return__ * page_tokens <= position < (__return__ + 1) * page_tokens
    """
    return position // page_tokens


def offset_in_page(position: int, page_tokens: int) -> int:
    """Where ``position`` sits inside its page.

    pre: position >= 0
    pre: page_tokens >= 1
    post: 0 <= __return__ < page_tokens
    post: page_of(position, page_tokens) * page_tokens + __return__ == position
    """
    return position % page_tokens


def pages_needed(positions: int, page_tokens: int) -> int:
    """The fewest pages that hold ``positions`` positions.

    pre: positions >= 0
    pre: page_tokens >= 1
    post: __return__ * page_tokens >= positions
    post: __return__ == 0 or (__return__ - 1) * page_tokens < positions
    """
    return (positions + page_tokens - 1) // page_tokens


def pages_touched(start: int, stop: int, page_tokens: int) -> tuple[int, int]:
    """The page range ``[first, end)`` that a write of positions ``[start, stop)`` touches.

    pre: 0 <= start < stop
    pre: page_tokens >= 1
    post: __return__[0] * page_tokens <= start
    post: (__return__[1] - 1) * page_tokens < stop <= __return__[1] * page_tokens
    post: __return__[0] < __return__[1]
    """
    return page_of(start, page_tokens), pages_needed(stop, page_tokens)


def span_in_page(page: int, start: int, stop: int, page_tokens: int) -> tuple[int, int]:
    """The part ``[lo, hi)`` of page ``page`` (offsets inside it) that positions ``[start, stop)`` cover.

    pre: 0 <= start < stop
    pre: page_tokens >= 1
    pre: page_of(start, page_tokens) <= page < pages_needed(stop, page_tokens)
    post: 0 <= __return__[0] < __return__[1] <= page_tokens
    post: page * page_tokens + __return__[0] == max(start, page * page_tokens)
    post: page * page_tokens + __return__[1] == min(stop, (page + 1) * page_tokens)
    """
    base = page * page_tokens
    return max(start, base) - base, min(stop, base + page_tokens) - base


def truncate_keep(length: int, keep: int, page_tokens: int) -> tuple[int, int]:
    """Truncating ``length`` positions to ``keep``: ``(pages kept, pages released)``.

    pre: 0 <= keep <= length
    pre: page_tokens >= 1
    post: __return__[0] + __return__[1] == pages_needed(length, page_tokens)
    post: __return__[0] * page_tokens >= keep
    post: __return__[0] == 0 or (__return__[0] - 1) * page_tokens < keep
    """
    kept = pages_needed(keep, page_tokens)
    return kept, pages_needed(length, page_tokens) - kept


def common_prefix_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading items ``a`` and ``b`` share (where a radix edge splits).

    post: 0 <= __return__ <= min(len(a), len(b))
    post: list(a[:__return__]) == list(b[:__return__])
    post: __return__ == min(len(a), len(b)) or a[__return__] != b[__return__]
    """
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:      # the common case in a radix walk, compared at C speed
        return limit
    i = 0
    while i < limit and a[i] == b[i]:
        i += 1
    return i


def split_edge(edge_len: int, rest_len: int, shared: int) -> tuple[int, int, int]:
    """Inserting a key whose remaining ``rest_len`` tokens share ``shared`` with a child's edge.

    The walk stopped at this child, so the edge is not fully matched (``shared < edge_len``),
    and the child was found by its first token (``shared >= 1``). The edge splits into an
    upper part of ``upper`` tokens (a new node) over the old child's ``lower`` tokens; the
    new key hangs ``leaf`` tokens below the upper node, or sits on it when ``leaf == 0``.
    Returns ``(upper, lower, leaf)``.

    pre: 1 <= shared < edge_len
    pre: shared <= rest_len
    post: __return__[0] == shared
    post: __return__[0] >= 1 and __return__[1] >= 1 and __return__[2] >= 0
    post: __return__[0] + __return__[1] == edge_len
    post: __return__[0] + __return__[2] == rest_len
    """
    return shared, edge_len - shared, rest_len - shared


def walk_step(depth: int, edge_len: int, shared: int) -> int:
    """One step of a radix walk at ``depth``: the depth after a child whose edge has
    ``edge_len`` tokens of which ``shared`` match the query, or -1 where the walk stops.

    A walk enters a node only when the node's whole edge matches; a partly matched
    edge ends the walk above it (that is where ``insert`` splits and ``match`` stops).

    pre: depth >= 0
    pre: 1 <= edge_len
    pre: 0 <= shared <= edge_len
    post: (__return__ == depth + edge_len) == (shared == edge_len)
    post: __return__ == -1 or __return__ > depth
    """
    return depth + edge_len if shared == edge_len else -1


def match_stop(has_entry: tuple[bool, ...]) -> int:
    """Which node of a walked path ``match`` answers with: the deepest one holding an entry.

    ``has_entry[i]`` says whether the i-th node entered by the walk (root excluded) has
    an entry; each is deeper than the one before, so the deepest entry is the longest
    key that is a prefix of the query. -1: no node on the path has one (a miss).

    post: -1 <= __return__ < len(has_entry)
    post: __return__ == -1 or has_entry[__return__]
    post: not any(has_entry[__return__ + 1:])
    """
    for i in range(len(has_entry) - 1, -1, -1):
        if has_entry[i]:
            return i
    return -1


def q8_code(ratio_rounded: int) -> int:
    """Clip a rounded ``x / scale`` into the symmetric int8 range.

    The scalar rule behind ``spec.precision.q8_encode``, which applies it to whole
    arrays at once (``np.clip(np.rint(ratio), -127, 127)``); the two agree element by
    element (``tests/test_spec_check.py`` checks that).

    post: -127 <= __return__ <= 127
    post: __return__ == ratio_rounded or abs(ratio_rounded) > 127
    """
    return max(-127, min(127, ratio_rounded))
