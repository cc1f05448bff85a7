"""The tree's bounds: ``max_entries`` and the page budget ``max_pages`` (``spec/semantics.py``).

The budget counts each entry's own pages, as if nothing were shared, so the
bound is the same whatever sharing an engine achieves.

The pages held are a running count the tree keeps (``RadixTree.weight``, with
``entry_pages`` as its ``weigh``), not a sum over the entries: ``retain`` checks
the bound after every eviction, and a sum there made each retain O(entries).
``recount`` is that sum, for tests that the running count has not drifted.
"""

from __future__ import annotations

from kvstate.spec.semantics import entry_pages

from .radix import RadixTree


class TreeBounds:
    def __init__(self, max_entries: int, max_pages: int, page_tokens: int):
        self.max_entries = max_entries
        self.max_pages = max_pages        # 0: no page budget
        self.page_tokens = page_tokens

    def entry_pages(self, entry) -> int:
        """What one entry (the tree's fork of a context) counts against ``max_pages``; the tree's ``weigh``."""
        return entry_pages(entry._length, self.page_tokens)

    def pages_held(self, tree: RadixTree) -> int:
        return tree.weight

    def recount(self, tree: RadixTree) -> int:
        """``pages_held`` summed afresh over every entry: O(entries), for checking the running count."""
        return sum(self.entry_pages(node.value) for node in tree.entries())

    def exceeded(self, tree: RadixTree) -> bool:
        if len(tree) > self.max_entries:
            return True
        return bool(self.max_pages) and tree.weight > self.max_pages
