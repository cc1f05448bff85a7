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


def common_prefix_length(a: tuple, b: tuple) -> int:
    """How many leading items ``a`` and ``b`` share (where a radix edge splits).

    post: 0 <= __return__ <= min(len(a), len(b))
    post: list(a[:__return__]) == list(b[:__return__])
    post: __return__ == min(len(a), len(b)) or a[__return__] != b[__return__]
    """
    limit = min(len(a), len(b))
    i = 0
    while i < limit and a[i] == b[i]:
        i += 1
    return i


def q8_code(ratio_rounded: int) -> int:
    """Clip a rounded ``x / scale`` into the symmetric int8 range.

    post: -127 <= __return__ <= 127
    post: __return__ == ratio_rounded or abs(ratio_rounded) > 127
    """
    return max(-127, min(127, ratio_rounded))
