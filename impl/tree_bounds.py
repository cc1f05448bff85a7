"""The tree's bounds: ``max_entries`` and the page budget ``max_pages`` (``spec/semantics.py``).

The budget counts each entry's own pages, as if nothing were shared, so the
bound is the same whatever sharing an engine achieves.
"""

from __future__ import annotations

from kvstate.spec.semantics import entry_pages

from .radix import RadixTree


class TreeBounds:
    def __init__(self, max_entries: int, max_pages: int, page_tokens: int):
        self.max_entries = max_entries
        self.max_pages = max_pages        # 0: no page budget
        self.page_tokens = page_tokens

    def pages_held(self, tree: RadixTree) -> int:
        return sum(entry_pages(node.value._length, self.page_tokens) for node in tree.entries())

    def exceeded(self, tree: RadixTree) -> bool:
        if len(tree) > self.max_entries:
            return True
        return bool(self.max_pages) and self.pages_held(tree) > self.max_pages
