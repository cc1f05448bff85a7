"""The radix prefix tree over token sequences.

Each node holds the edge of tokens leading into it and, optionally, an entry:
a value (the tree's own fork of a context) stored under the key spelled by the
path to the node. Recency is a logical clock: ``insert`` and a ``lookup`` hit
stamp the entry; the least recently stamped entry is the eviction victim.
A node without an entry is never a victim: only entries are in the recency order.

``remove`` prunes upward from the victim and collapses a node that has no entry
and one child into that child, so the tree never keeps splits that split nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterator

from kvstate.spec.arithmetic import common_prefix_length, match_stop, split_edge, walk_step
from kvstate.spec.observation import NodeView


class Node:
    __slots__ = ("edge", "children", "parent", "value", "tick")

    def __init__(self, edge: tuple[int, ...], parent: "Node | None"):
        self.edge = edge
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.value: Any = None      # None: no entry at this node
        self.tick = 0

    def key(self) -> tuple[int, ...]:
        parts, node = [], self
        while node is not None:
            parts.append(node.edge)
            node = node.parent
        return tuple(token for edge in reversed(parts) for token in edge)


class RadixTree:
    def __init__(self):
        self.root = Node((), None)
        self.recency: OrderedDict[Node, None] = OrderedDict()   # entries, least recent first
        self.clock = 0

    def __len__(self) -> int:
        return len(self.recency)

    # -- public operations ---------------------------------------------------------

    def insert(self, key: tuple[int, ...], value: Any) -> Any:
        """Store ``value`` under non-empty ``key``; returns the value it replaced, or None."""
        node, depth = self._descend(key)
        if depth < len(key):
            node = self._add_below(node, key[depth:])
        replaced, node.value = node.value, value
        self._stamp(node)
        return replaced

    def lookup(self, query: tuple[int, ...]) -> tuple[Any, int]:
        """The entry with the longest key that is a prefix of ``query``: ``(value, len(key))``.

        Stamps the entry it finds. ``(None, 0)`` when no key is a prefix of the query.
        """
        path = self._walk(query)
        stop = match_stop(tuple(node.value is not None for node, _ in path))
        if stop < 0:
            return None, 0
        best, depth = path[stop]
        self._stamp(best)
        return best.value, depth

    def pop_oldest(self, spare: Any = None) -> Any:
        """Remove the least recently used entry (never the one holding ``spare``); return its value."""
        for node in self.recency:
            if node.value is not spare:
                value = node.value
                self.remove(node)
                return value
        raise LookupError("no entry to evict")

    def remove(self, node: Node) -> None:
        """Drop the entry at ``node``, prune emptied nodes upward and collapse non-splits."""
        del self.recency[node]
        node.value = None
        while node is not self.root and node.value is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node is not self.root and node.value is None and len(node.children) == 1:
            self._collapse(node)

    def clear(self) -> list[Any]:
        """Drop every entry; returns their values."""
        values = [node.value for node in self.recency]
        self.root = Node((), None)
        self.recency.clear()
        return values

    def entries(self) -> Iterator[Node]:
        """Entry nodes, least recently used first."""
        return iter(self.recency)

    def view(self, key_of: Callable[[Any], tuple[int, ...]]) -> NodeView:
        """The tree as plain data; ``key_of(value)`` reports the key an entry's value really holds."""
        return _view(self.root, key_of)

    # -- helpers named after the tree operation they perform -------------------------

    def _stamp(self, node: Node) -> None:
        self.clock += 1
        node.tick = self.clock
        self.recency[node] = None
        self.recency.move_to_end(node)

    def _walk(self, key: tuple[int, ...]) -> list[tuple[Node, int]]:
        """The nodes whose whole edge ``key`` spells, root excluded, each with its depth."""
        path, node, depth = [], self.root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                break
            shared = common_prefix_length(child.edge, key[depth:depth + len(child.edge)])
            depth = walk_step(depth, len(child.edge), shared)
            if depth < 0:
                break
            node = child
            path.append((node, depth))
        return path

    def _descend(self, key: tuple[int, ...]) -> tuple[Node, int]:
        """The deepest node whose full path is a prefix of ``key``, and that path's length."""
        path = self._walk(key)
        return path[-1] if path else (self.root, 0)

    def _add_below(self, node: Node, rest: tuple[int, ...]) -> Node:
        """A node for ``rest`` under ``node``, splitting the edge that shares its start."""
        child = node.children.get(rest[0])
        if child is None:
            leaf = Node(rest, node)
            node.children[rest[0]] = leaf
            return leaf
        upper, _lower, leaf_len = split_edge(len(child.edge), len(rest), common_prefix_length(child.edge, rest))
        middle = self._split(child, upper)
        if leaf_len == 0:
            return middle
        leaf = Node(rest[upper:], middle)
        middle.children[leaf.edge[0]] = leaf
        return leaf

    def _split(self, child: Node, at: int) -> Node:
        """Cut ``child``'s edge after ``at`` tokens; the new node above it is returned."""
        parent = child.parent
        middle = Node(child.edge[:at], parent)
        parent.children[middle.edge[0]] = middle
        child.edge = child.edge[at:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        return middle

    def _collapse(self, node: Node) -> None:
        """Merge entry-less ``node`` with its only child, which takes its place."""
        (child,) = node.children.values()
        child.edge = node.edge + child.edge
        child.parent = node.parent
        node.parent.children[child.edge[0]] = child


def _view(node: Node, key_of) -> NodeView:
    return NodeView(
        edge=node.edge,
        key=key_of(node.value) if node.value is not None else None,
        children=tuple(_view(child, key_of) for _, child in sorted(node.children.items())),
    )
