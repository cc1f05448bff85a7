"""The yardstick of ``agent_traffic``: a plain Python token-granular radix tree.

The shape of SGLang's ``RadixCache`` (written here from that description, not copied):
one node per edge, children in a dict keyed by the edge's first token, each node
holding the KV slot indices of its edge's tokens, recency stamped on every node a
lookup or insert walks through, and eviction of least recently used *leaves* that
no request holds. A lookup splits an edge it stops inside, so the matched prefix
ends on a node, and returns the slot indices of the matched tokens concatenated.

Keys are Python lists of token ids (what a serving loop holds). ``compare``
says how an edge is compared with the key: ``"token"``, token by token in a
Python loop, as SGLang's page-size-1 key match does (the tree the issue's targets
were measured against); ``"slice"``, one slice compare first (C speed) and token
by token only on the edge where the key leaves the tree: a stronger yardstick
than SGLang itself, reported beside it.
"""

from __future__ import annotations

import heapq

import numpy as np

_NO_SLOTS = np.zeros(0, np.int64)


class Node:
    __slots__ = ("edge", "slots", "children", "parent", "last_access", "lock_ref")

    def __init__(self, edge: list, slots: np.ndarray, parent: "Node | None", tick: int):
        self.edge = edge                  # token ids of the edge into this node
        self.slots = slots                # KV slot index of each of those tokens
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.last_access = tick
        self.lock_ref = 0                 # requests holding this node's slots: never evicted while > 0


class TokenRadixTree:
    def __init__(self, compare: str = "token"):
        if compare not in ("token", "slice"):
            raise ValueError(f"compare must be 'token' or 'slice', got {compare!r}")
        self.whole_edges = compare == "slice"
        self.clock = 0
        self.root = Node([], _NO_SLOTS, None, 0)
        self.tokens_held = 0

    # -- public operations ---------------------------------------------------------

    def match(self, key: list) -> tuple[np.ndarray, Node]:
        """The slot indices of the longest prefix of ``key`` in the tree, and the node it ends on."""
        node, matched, parts = self._walk(key, stamp=True)
        if not parts:
            return _NO_SLOTS, node
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), node

    def insert(self, key: list, slots: np.ndarray) -> int:
        """Store ``key`` with one slot index per token; returns how many tokens were already held
        (a server frees those duplicate slots)."""
        node, matched, _parts = self._walk(key, stamp=True)
        if matched < len(key):
            leaf = Node(key[matched:], slots[matched:], node, self.clock)
            node.children[key[matched]] = leaf
            self.tokens_held += len(key) - matched
        return matched

    def evict(self, tokens: int) -> int:
        """Drop least recently used unlocked leaves until ``tokens`` are freed or none is left;
        returns the tokens freed."""
        leaves = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.edge[0]]
            freed += len(leaf.edge)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        self.tokens_held -= freed
        return freed

    # -- helpers named after the tree operation they perform -------------------------

    def _walk(self, key: list, stamp: bool) -> tuple[Node, int, list]:
        """Follow ``key`` down, splitting the edge it leaves the tree inside; the last node reached,
        the tokens matched and the matched nodes' slot arrays."""
        self.clock += 1
        node, matched, parts = self.root, 0, []
        while matched < len(key):
            child = node.children.get(key[matched])
            if child is None:
                break
            edge = child.edge
            if self.whole_edges and key[matched:matched + len(edge)] == edge:
                shared = len(edge)
            else:
                shared = _shared(edge, key, matched)
                if shared < len(edge):
                    child = self._split(child, shared)
            if stamp:
                child.last_access = self.clock
            parts.append(child.slots)
            node, matched = child, matched + shared
            if shared < len(edge):
                break
        return node, matched, parts

    def _split(self, child: Node, at: int) -> Node:
        """Cut ``child``'s edge after ``at`` tokens; the new node above it is returned."""
        upper = Node(child.edge[:at], child.slots[:at], child.parent, child.last_access)
        upper.lock_ref = child.lock_ref
        child.parent.children[child.edge[0]] = upper
        child.edge, child.slots, child.parent = child.edge[at:], child.slots[at:], upper
        upper.children[child.edge[0]] = child
        return upper

    def _leaves(self):
        pending = [self.root]
        while pending:
            node = pending.pop()
            if node.children:
                pending.extend(node.children.values())
            elif node is not self.root:
                yield node


def _shared(edge: list, key: list, start: int) -> int:
    """Tokens ``edge`` shares with ``key[start:]``, counted one by one (as SGLang's page-size-1 match does)."""
    n = 0
    for a, b in zip(edge, key[start:start + len(edge)]):
        if a != b:
            break
        n += 1
    return n
