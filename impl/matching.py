"""What a ``match`` hit returns, one function per declared semantics (``spec/semantics.py``).

Each takes the radix tree and a packed query and returns the entry node the hit is
taken from and how many positions it holds, or ``(None, 0)`` for a miss. None of
them stamps the clock or forks: ``Cache.match`` does both, once, for every kind.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from kvstate.spec.semantics import hit_length

from .radix import Node, RadixTree

Finder = Callable[[RadixTree, bytes], "tuple[Node | None, int]"]


def entry_hit(tree: RadixTree, query: bytes) -> tuple[Node | None, int]:
    """The longest retained key that prefixes the query; the hit holds the whole key."""
    return tree.longest_key(query)


def token_hit(tree: RadixTree, query: bytes) -> tuple[Node | None, int]:
    """``prefix_hit`` for ``token``, whose hit is the whole common prefix (``hit_length``'s identity
    case): no rounding to test, no second walk, two calls fewer on the path every lookup takes."""
    below, common = tree.deepest(query)
    return (None, 0) if below is None else (tree.newest_below(below), common)


def prefix_hit(match: str, block_tokens: int, tree: RadixTree, query: bytes) -> tuple[Node | None, int]:
    """``token``: the longest common prefix with any key; ``block``: that, rounded down to whole
    blocks. Taken from the most recently used entry of those sharing the hit's positions (under
    ``block``, every entry reaching its last whole block, whatever it shares past it)."""
    below, common = tree.deepest(query)
    length = hit_length(match, block_tokens, common)
    if below is None or length == 0:
        return None, 0
    if length < common:      # the subtree of entries sharing just the hit's positions
        below = tree.covering(below, length)
    return tree.newest_below(below), length


def finder_for(match: str, block_tokens: int) -> Finder:
    # a partial of a module-level function, not a closure: a cache stays picklable (the exhaustive
    # checker keeps each state it explores as a pickle)
    if match == "entry":
        return entry_hit
    return token_hit if match == "token" else partial(prefix_hit, match, block_tokens)
