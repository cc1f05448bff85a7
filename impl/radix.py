"""The radix prefix tree over token sequences.

Each node holds the edge of tokens leading into it and, optionally, an entry:
a value (the tree's own fork of a context) stored under the key spelled by the
path to the node. Recency is a logical clock: ``insert`` and a ``lookup`` hit
stamp the entry; the least recently stamped entry is the eviction victim.
A node without an entry is never a victim: only entries are in the recency order.

``remove`` prunes upward from the victim and collapses a node that has no entry
and one child into that child, so the tree never keeps splits that split nothing.

Keys and edges are *packed*: token ids as little-endian int32 bytes (``pack``).
Why: a serving loop matches a few-thousand-token history per request, and
building a tuple of Python ints for it costs more than the whole walk.
Packed, a query is one ``tobytes`` and each edge test is one ``startswith``
(a memcmp, no slice copied); children are found by their first token's bytes.
``key()`` and ``view`` unpack back to tuples of ints for the invariants.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Any, Callable, Iterator

import numpy as np

from kvstate.spec.arithmetic import match_stop, split_edge, walk_step
from kvstate.spec.observation import NodeView

TOKEN_BYTES = 4
_PACKED = np.dtype("<i4")     # token ids are below 2**31 (spec.layout.TOKEN_LIMIT)


def pack(tokens: np.ndarray) -> bytes:
    """Validated token ids (``spec.layout.check_tokens``) as a packed key."""
    return np.asarray(tokens).astype(_PACKED, copy=False).tobytes()


def unpack(packed: bytes) -> tuple[int, ...]:
    # struct, not NumPy: the invariants unpack every edge and key at every step, a few tokens each
    return struct.unpack(f"<{len(packed) // TOKEN_BYTES}i", packed)


def shared_tokens(a: bytes, b: bytes) -> int:
    """How many leading tokens packed ``a`` and ``b`` share (where a radix edge splits).

    ``spec.arithmetic.common_prefix_length`` over packed keys, vectorised;
    ``tests/test_radix_packed.py`` checks that the two agree.
    """
    n = min(len(a), len(b)) // TOKEN_BYTES
    differ = np.flatnonzero(np.frombuffer(a, _PACKED, n) != np.frombuffer(b, _PACKED, n))
    return int(differ[0]) if differ.size else n


class Node:
    __slots__ = ("edge", "children", "parent", "value", "tick", "newest", "depth")

    def __init__(self, edge: bytes, parent: "Node | None"):
        self.edge = edge            # packed tokens
        # Bytes from the root to the end of ``edge``, set once: a split makes a new node for the
        # upper part (its own depth, here) and the lower keeps its end; a collapse prepends the
        # parent's edge to the child's, whose end stays where it was.
        self.depth = len(edge) if parent is None else parent.depth + len(edge)
        self.children: dict[bytes, Node] = {}    # keyed by the packed first token of the child's edge
        self.parent = parent
        self.value: Any = None      # None: no entry at this node
        self.tick = 0
        # The most recently stamped entry node in this subtree (None: no entry below), kept
        # on every stamp and removal so a token or block hit finds its entry in O(depth)
        # instead of walking a subtree that, under a shared system prompt, is the whole tree.
        self.newest: "Node | None" = None

    def key(self) -> tuple[int, ...]:
        parts, node = [], self
        while node is not None:
            parts.append(node.edge)
            node = node.parent
        return unpack(b"".join(reversed(parts)))


class RadixTree:
    def __init__(self, weigh: Callable[[Any], int] | None = None):
        self.root = Node(b"", None)
        self.recency: OrderedDict[Node, None] = OrderedDict()   # entries, least recent first
        self.clock = 0
        # ``weight``: the sum of ``weigh(value)`` over the entries, kept on every insert, replace,
        # removal and clear, so a bound on it (the page budget) costs O(1) per check, not O(entries).
        self.weigh = weigh
        self.weight = 0

    def __len__(self) -> int:
        return len(self.recency)

    # -- public operations ---------------------------------------------------------

    def insert(self, key: bytes, value: Any) -> Any:
        """Store ``value`` under non-empty packed ``key``; returns the value it replaced, or None."""
        node, depth = self._descend(key)
        if depth < len(key):
            node = self._add_below(node, key[depth:])
        replaced, node.value = node.value, value
        if self.weigh is not None:
            self.weight += self.weigh(value) - (0 if replaced is None else self.weigh(replaced))
        self.stamp(node)
        return replaced

    def longest_key(self, query: bytes) -> tuple[Node | None, int]:
        """The entry node whose key is the longest that prefixes packed ``query``, and that key's
        length in tokens; ``(None, 0)`` when no key prefixes the query."""
        path = self._walk(query)
        stop = match_stop(tuple([node.value is not None for node, _ in path]))
        if stop < 0:
            return None, 0
        best, depth = path[stop]
        return best, depth // TOKEN_BYTES

    def deepest(self, query: bytes) -> tuple[Node | None, int]:
        """Where packed ``query`` leaves the tree, possibly mid-edge: the node whose subtree holds
        exactly the entries sharing the longest common prefix with the query, and that prefix's
        length in tokens. ``(None, 0)`` when no entry shares even the first token."""
        node, depth = self._descend(query)
        child = node.children.get(query[depth:depth + TOKEN_BYTES])
        if child is not None:     # the walk stopped inside the child's edge
            return child, depth // TOKEN_BYTES + shared_tokens(child.edge, query[depth:])
        return (node, depth // TOKEN_BYTES) if node is not self.root else (None, 0)

    def covering(self, below: Node, length: int) -> Node:
        """The node whose subtree holds exactly the entries sharing a query's first ``length``
        tokens, given ``below`` from ``deepest`` of that query (``1 <= length <=`` its common prefix):
        the ancestor of ``below`` (or itself) whose edge holds the cut: a few steps up, not a second
        walk down from the root that would test every edge and measure the prefix again."""
        cut = length * TOKEN_BYTES
        node = below
        while node.parent.depth >= cut:
            node = node.parent
        return node

    def newest_below(self, top: Node) -> Node:
        """The most recently stamped entry node in ``top``'s subtree (``top`` included)."""
        return top.newest

    def stamp(self, node: Node) -> None:
        """Mark ``node``'s entry as used now (a ``match`` hit, an ``insert``)."""
        self.clock += 1
        node.tick = self.clock
        recency = self.recency
        recency[node] = None
        recency.move_to_end(node)
        stamped = node
        while node is not None:          # the newest stamp of all: the newest of every subtree holding it
            node.newest = stamped
            node = node.parent

    def pop_oldest(self, spare: Any = None, where: Callable[[Any], bool] | None = None) -> Any:
        """Remove the least recently used entry (never the one holding ``spare``; only one whose
        value satisfies ``where``, if given) and return its value; None when there is none."""
        for node in self.recency:
            if node.value is not spare and (where is None or where(node.value)):
                value = node.value
                self.remove(node)
                return value
        return None

    def remove(self, node: Node) -> None:
        """Drop the entry at ``node``, prune emptied nodes upward and collapse non-splits."""
        del self.recency[node]
        if self.weigh is not None:
            self.weight -= self.weigh(node.value)
        node.value = None
        victim = node
        while node is not self.root and node.value is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[:TOKEN_BYTES]]
            node = parent
        self._forget_newest(node, victim)
        if node is not self.root and node.value is None and len(node.children) == 1:
            self._collapse(node)

    def clear(self) -> list[Any]:
        """Drop every entry; returns their values."""
        values = [node.value for node in self.recency]
        self.root = Node(b"", None)
        self.recency.clear()
        self.weight = 0
        return values

    def entries(self) -> Iterator[Node]:
        """Entry nodes, least recently used first."""
        return iter(self.recency)

    def view(self, key_of: Callable[[Any], tuple[int, ...]]) -> NodeView:
        """The tree as plain data; ``key_of(value)`` reports the key an entry's value really holds."""
        return _view(self.root, key_of)

    # -- helpers named after the tree operation they perform -------------------------

    def _forget_newest(self, node: Node | None, victim: Node) -> None:
        """``victim``'s entry is gone: re-elect the newest entry of ``node`` and its ancestors
        that had it (the others' newest lies outside the victim's path, untouched)."""
        while node is not None and node.newest is victim:
            best = node if node.value is not None else None
            for child in node.children.values():
                if child.newest is not None and (best is None or child.newest.tick > best.tick):
                    best = child.newest
            node.newest = best
            node = node.parent

    def _walk(self, key: bytes) -> list[tuple[Node, int]]:
        """The nodes whose whole edge packed ``key`` spells, root excluded, each with its depth in bytes."""
        path, node, depth = [], self.root, 0
        while depth < len(key):
            child = node.children.get(key[depth:depth + TOKEN_BYTES])
            if child is None:
                break
            # One C-level compare decides "whole edge or not", all walk_step distinguishes.
            whole = key.startswith(child.edge, depth)
            depth = walk_step(depth, len(child.edge), len(child.edge) if whole else 0)
            if depth < 0:
                break
            node = child
            path.append((node, depth))
        return path

    def _descend(self, key: bytes) -> tuple[Node, int]:
        """The deepest node whose full path is a prefix of ``key``, and that path's length in bytes.

        ``_walk`` without the path list or a call a step (every call costs several times its warm
        price on the cold caches a lookup or a retain meets after the caller's ``extend``)."""
        node, depth, end = self.root, 0, len(key)
        while depth < end:
            child = node.children.get(key[depth:depth + TOKEN_BYTES])
            if child is None or not key.startswith(child.edge, depth):
                break
            depth += len(child.edge)
            node = child
        return node, depth

    def _add_below(self, node: Node, rest: bytes) -> Node:
        """A node for packed ``rest`` under ``node``, splitting the edge that shares its start."""
        child = node.children.get(rest[:TOKEN_BYTES])
        if child is None:
            leaf = Node(rest, node)
            node.children[rest[:TOKEN_BYTES]] = leaf
            return leaf
        upper, _lower, leaf = split_edge(len(child.edge) // TOKEN_BYTES, len(rest) // TOKEN_BYTES,
                                         shared_tokens(child.edge, rest))
        middle = self._split(child, upper * TOKEN_BYTES)
        if leaf == 0:
            return middle
        leaf_node = Node(rest[upper * TOKEN_BYTES:], middle)
        middle.children[leaf_node.edge[:TOKEN_BYTES]] = leaf_node
        return leaf_node

    def _split(self, child: Node, at: int) -> Node:
        """Cut ``child``'s edge after ``at`` bytes (a whole number of tokens); the new node above it is returned."""
        parent = child.parent
        middle = Node(child.edge[:at], parent)
        middle.newest = child.newest
        parent.children[middle.edge[:TOKEN_BYTES]] = middle
        child.edge = child.edge[at:]
        child.parent = middle
        middle.children[child.edge[:TOKEN_BYTES]] = child
        return middle

    def _collapse(self, node: Node) -> None:
        """Merge entry-less ``node`` with its only child, which takes its place."""
        (child,) = node.children.values()
        child.edge = node.edge + child.edge
        child.parent = node.parent
        node.parent.children[child.edge[:TOKEN_BYTES]] = child


def _first_token(view: NodeView) -> int:
    return view.edge[0]


def _view(root: Node, key_of) -> NodeView:
    """The tree below ``root`` as ``NodeView``s, built bottom-up with an explicit stack:
    nested retains (each turn of a chat) make trees thousands of nodes deep."""
    order, stack = [], [root]
    while stack:                      # parents before children; reversed below, children come first
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    views: dict[int, NodeView] = {}
    for node in reversed(order):
        children = [views.pop(id(child)) for child in node.children.values()]
        if len(children) > 1:
            children.sort(key=_first_token)
        views[id(node)] = NodeView(
            edge=unpack(node.edge),
            key=key_of(node.value) if node.value is not None else None,
            children=tuple(children),
        )
    return views[id(root)]
