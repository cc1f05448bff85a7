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
        self.displaced: tuple[Node, Any] | None = None     # see ``put``
        self.evicted: Any = None                           # see ``pop_oldest``

    def __len__(self) -> int:
        return len(self.recency)

    # -- public operations ---------------------------------------------------------

    def insert(self, key: bytes, value: Any) -> Any:
        """Store ``value`` under non-empty packed ``key``; returns the value it replaced, or None."""
        return self.put(self.place(key), value)

    def place(self, key: bytes) -> Node:
        """The node for non-empty packed ``key``, made (entry-less) if the tree has none; no entry
        changes. ``put`` stores the entry there; a caller that gives up in between ``prune``s it."""
        node, depth = self._descend(key)
        if depth < len(key):
            node = self._add_below(node, key[depth:])
        return node

    def put(self, node: Node, value: Any) -> Any:
        """Store ``value`` at ``node`` (from ``place``) and stamp it; returns the value it replaced, or None.

        Interrupt-safe (Ctrl-C, a run's deadline: CPython raises a pending one only at a call or a
        loop's backward jump): the weights are taken first, then the value and the weight change
        with no call between them, and ``stamp``, which puts the node in ``recency``, is run again
        if the interrupt lands as it begins: else the entry was one that ``match`` found and that
        ``len``, eviction and ``clear`` (all of them iterate ``recency``) never saw. Raising after
        the value went in, it leaves ``(node, replaced)`` in ``displaced`` for the caller, who
        gets no return value to release (``Cache._keep``)."""
        replaced, weigh = node.value, self.weigh
        change = 0 if weigh is None else weigh(value) - (0 if replaced is None else weigh(replaced))
        node.value = value          # from here to the weight: no call, nothing can interrupt
        self.weight += change
        try:
            self.stamp(node)
        except BaseException:       # interrupted as the call began, before the node was in ``recency``
            self.displaced = (node, replaced)
            self.stamp(node)        # (where it got further, a second stamp changes only the clock)
            raise
        return replaced

    def prune(self, node: Node) -> None:
        """``node`` (from ``place``) left without an entry: the nodes it made that split nothing go again."""
        if node.value is None and node is not self.root:
            self._collapse_if_no_split(self._cut_up(node))

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
        stamped = node
        try:
            self.clock += 1
            node.tick = self.clock
            recency = self.recency
            recency[node] = None
            recency.move_to_end(node)
            while node is not None:          # the newest stamp of all: the newest of every subtree holding it
                node.newest = stamped
                node = node.parent
        except BaseException:
            # An interrupt at the loop's jump left the lower part of the path naming ``stamped`` and the
            # upper part an older entry, which a later removal of that entry would never re-elect
            # (``_forget_newest`` stops at the first node not naming the victim): finish the path.
            node = stamped
            while node is not None:
                node.newest = stamped
                node = node.parent
            raise

    def pop_oldest(self, spare: Any = None, where: Callable[[Any], bool] | None = None) -> Any:
        """Remove the least recently used entry (never the one holding ``spare``; only one whose
        value satisfies ``where``, if given) and return its value; None when there is none.
        Raising after the entry left the tree, it leaves the value in ``evicted`` for the caller."""
        for node in self.recency:
            if node.value is not spare and (where is None or where(node.value)):
                value = node.value
                try:
                    self.remove(node)
                except BaseException:       # an interrupt in the pruning, after the entry left the tree:
                    if node.value is None:  # the caller gets no value to release, so it is kept for it
                        self.evicted = value
                    raise
                return value
        return None

    def remove(self, node: Node) -> None:
        """Drop the entry at ``node``, prune emptied nodes upward and collapse non-splits.

        Interrupt-safe as ``put``: the weight is taken first, then the entry leaves ``recency``, its
        node and the weight with no call between (an entry out of ``recency`` but still at its node
        was one ``match`` found and nothing counted, evicted or cleared); an interrupt in the pruning
        after that is finished by ``_settle`` before it propagates."""
        change = 0 if self.weigh is None else self.weigh(node.value)
        del self.recency[node]      # from here to the weight: no call, nothing can interrupt
        node.value = None
        self.weight -= change
        victim = node
        try:
            node = self._cut_up(node)
            self._forget_newest(node, victim)
            self._collapse_if_no_split(node)
        except BaseException:
            self._settle(victim)
            raise

    def clear(self) -> list[Any]:
        """Drop every entry; returns their values. The tree changes in plain assignments after
        everything is made, so an interrupt leaves it whole or empty with the values returned."""
        values = [node.value for node in self.recency]
        root, recency = Node(b"", None), OrderedDict()
        self.root = root            # from here to the return: no call, nothing can interrupt
        self.recency = recency
        self.weight = 0
        self.displaced = self.evicted = None
        return values

    def entries(self) -> Iterator[Node]:
        """Entry nodes, least recently used first."""
        return iter(self.recency)

    def view(self, key_of: Callable[[Any], tuple[int, ...]]) -> NodeView:
        """The tree as plain data; ``key_of(value)`` reports the key an entry's value really holds."""
        return _view(self.root, key_of)

    # -- helpers named after the tree operation they perform -------------------------

    def _settle(self, victim: Node) -> None:
        """``remove``'s pruning of ``victim``'s path finished from wherever an interrupt stopped it;
        each step is skipped where it was done (a node already cut, a collapse already made)."""
        node = victim
        while node is not self.root and node.value is None and not node.children:
            parent = node.parent
            if parent.children.get(node.edge[:TOKEN_BYTES]) is node:
                del parent.children[node.edge[:TOKEN_BYTES]]
            node = parent
        above = node
        while above is not None:        # no early stop: the lower part may be re-elected already
            if above.newest is victim:
                self._forget_newest(above, victim)
            above = above.parent
        if (node is not self.root and node.value is None and len(node.children) == 1
                and node.parent.children.get(node.edge[:TOKEN_BYTES]) is node):
            self._collapse(node)

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

    def _cut_up(self, node: Node) -> Node:
        """Cut ``node`` if it holds no entry and no child, and each ancestor left so; the first node kept."""
        while node is not self.root and node.value is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[:TOKEN_BYTES]]
            node = parent
        return node

    def _collapse_if_no_split(self, node: Node) -> None:
        """Merge ``node`` into its only child where it holds no entry (a split that splits nothing)."""
        if node is not self.root and node.value is None and len(node.children) == 1:
            self._collapse(node)

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
