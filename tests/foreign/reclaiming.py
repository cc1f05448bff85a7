"""A token-granular engine whose fixed pool reclaims cached pages its own way (``on_full="reclaim"``),
written from README.md and ``kvstate.spec`` only.

- One page is one position (``page_tokens=1``): a slot of a fixed array of ``pool_pages`` slots,
  refcounted; ``fork`` shares slots, a write into a shared slot copies it first.
- Retained keys sit in a trie of one token per node, each node holding a reference on its slot; a
  retain of a prefix the trie holds keeps the trie's slots and lets the context's own go (keys
  are K/V by prefix: ``values="prefix"``), as SGLang's insert does.
- ``match`` walks the trie: the hit holds the slots of the nodes it passed.
- Short of slots, the pool drops trie nodes whose slot only the trie holds, leaves first, the
  newest leaf first (not least recently used), a node with children last (its subtree goes with
  it); it refuses, changing nothing, when the slots contexts hold plus the need pass the pool.

Black-box observation. ``Reclaiming`` subclasses in ``tests/test_reclaim.py`` plant one bug each.
"""

from __future__ import annotations

import numpy as np

from kvstate.spec import Config, Layout
from kvstate.spec import precision as precisions
from kvstate.spec.errors import CapacityError, ContextClosedError, EmptyContextError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite
from kvstate.spec.observation import Observation, black_box

POOL = 12


class Node:
    __slots__ = ("token", "slot", "parent", "children", "born")

    def __init__(self, token: int, slot: int, parent: "Node | None", born: int):
        self.token, self.slot, self.parent, self.born = token, slot, parent, born
        self.children: dict[int, Node] = {}


class Context:
    def __init__(self, cache: "Cache", tokens: list[int], slots: list[int]):
        self.cache, self.token_list, self.slots, self.closed = cache, tokens, slots, False

    def __len__(self) -> int:
        return len(self.token_list)

    def _open(self) -> None:
        if self.closed:
            raise ContextClosedError("closed")

    @property
    def tokens(self) -> list[int]:
        self._open()
        return list(self.token_list)

    def _encode(self, tokens, kv, start=None):
        tokens = [int(t) for t in check_tokens(tokens)]
        kv = check_values(self.cache.config.layout, kv, len(tokens))
        self._open()
        if start is not None and not (isinstance(start, int) and 0 <= start and start + len(tokens) <= len(self)):
            raise PositionError(f"overwrite at {start!r} outside length {len(self)}")
        kv = np.asarray(kv, np.float32)
        require_finite(kv)
        return tokens, precisions.roundtrip(self.cache.config.precision, kv)

    def extend(self, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv)
        fresh = self.cache.take(len(tokens))
        self.cache.values[fresh] = values
        self.slots += fresh
        self.token_list += tokens

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv, start)
        span = range(start, start + len(tokens))
        shared = self.cache.shared_positions(self, span)
        for i, slot in zip(shared, self.cache.take(len(shared))):     # copy-on-write
            self.cache.release([self.slots[i]])
            self.slots[i] = slot
        self.cache.values[[self.slots[i] for i in span]] = values
        self.token_list[start:start + len(tokens)] = tokens

    def read(self, start: int = 0, stop: int | None = None):
        self._open()
        stop = len(self) if stop is None else stop
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= len(self)):
            raise PositionError(f"read of [{start}, {stop}) outside length {len(self)}")
        return self.cache.values[self.slots[start:stop]].copy(), np.array(self.token_list[start:stop], np.int64)

    def fork(self) -> "Context":
        self._open()
        return self.cache.adopt(list(self.token_list), list(self.slots))

    def truncate(self, n: int) -> None:
        self._open()
        if not (isinstance(n, int) and 0 <= n <= len(self)):
            raise PositionError(f"truncate to {n!r} outside length {len(self)}")
        self.cache.release(self.slots[n:])
        del self.slots[n:], self.token_list[n:]

    def close(self) -> None:
        self._open()
        self.cache.release(self.slots)
        self.slots, self.closed = [], True
        self.cache.contexts.remove(self)


class Cache:
    def __init__(self, config: Config):
        self.config = config
        self.values = np.zeros((config.pool_limit, *config.layout.position_shape), np.float32)
        self.refs = [0] * config.pool_limit
        self.free = list(range(config.pool_limit))
        self.root = Node(-1, -1, None, 0)
        self.contexts: list[Context] = []
        self.births = 0
        self.reclaimed = 0          # trie nodes dropped for room: a test's proof that its run reclaimed

    def born(self) -> int:
        self.births += 1
        return self.births

    # -- slots ---------------------------------------------------------------------------

    def held_by_contexts(self) -> int:
        return len({slot for ctx in self.contexts for slot in ctx.slots})

    def take(self, n: int) -> list[int]:
        """``n`` fresh slots, reclaiming trie slots if short; ``CapacityError`` (nothing changed) when the
        slots contexts hold leave no room."""
        if self.held_by_contexts() + n > self.config.pool_limit:
            raise CapacityError(f"{self.held_by_contexts()} held + {n} needed > {self.config.pool_limit}")
        while len(self.free) < n:
            self.reclaim_one()
        taken, self.free = self.free[:n], self.free[n:]
        for slot in taken:
            self.refs[slot] = 1
        return taken

    def shared_positions(self, ctx: Context, span) -> list[int]:
        """The positions of ``span`` whose slot another holder shares: a write copies them first."""
        return [i for i in span if self.refs[ctx.slots[i]] > 1]

    def release(self, slots) -> None:
        for slot in slots:
            self.refs[slot] -= 1
            if self.refs[slot] == 0:
                self.free.append(slot)

    def reclaimable(self) -> list[Node]:
        """Trie nodes whose slot only the trie holds: leaves first, the newest first."""
        nodes = [node for node in self.nodes() if self.refs[node.slot] == 1]
        return sorted(nodes, key=lambda node: (bool(node.children), -node.born))

    def reclaim_one(self) -> None:
        self.reclaimed += 1
        self.drop(self.reclaimable()[0])

    def drop(self, node: Node) -> None:
        """``node`` and its subtree leave the trie, letting their slots go."""
        del node.parent.children[node.token]
        stack = [node]
        while stack:
            gone = stack.pop()
            self.release([gone.slot])
            stack.extend(gone.children.values())

    def nodes(self) -> list[Node]:
        found, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found

    # -- the protocol ----------------------------------------------------------------------

    def adopt(self, tokens: list[int], slots: list[int]) -> Context:
        for slot in slots:
            self.refs[slot] += 1
        ctx = Context(self, tokens, slots)
        self.contexts.append(ctx)
        return ctx

    def allocate(self) -> Context:
        return self.adopt([], [])

    def retain(self, ctx: Context) -> None:
        ctx._open()
        if not len(ctx):
            raise EmptyContextError("cannot retain an empty context")
        node = self.root
        for i, token in enumerate(ctx.token_list):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node(token, ctx.slots[i], node, self.born())
                self.refs[child.slot] += 1
            elif child.slot != ctx.slots[i]:          # the trie's slot holds the same K/V: keep it
                self.release([ctx.slots[i]])
                self.refs[child.slot] += 1
                ctx.slots[i] = child.slot
            node = child

    def walk(self, query: list[int]) -> list[Node]:
        path, node = [], self.root
        for token in query:
            node = node.children.get(token)
            if node is None:
                break
            path.append(node)
        return path

    def match(self, tokens):
        query = [int(t) for t in check_tokens(tokens)]
        path = self.walk(query)
        return self.adopt(query[:len(path)], [node.slot for node in path]), len(path)

    def clear(self) -> None:
        for node in list(self.root.children.values()):
            self.drop(node)

    def observe(self) -> Observation:
        return black_box()


LAYOUT = Layout(layers=1, kv_heads=1, head_dim=2)
CONFIG = Config(LAYOUT, page_tokens=1, match="token", pool_pages=POOL, on_full="reclaim", values="prefix",
                max_entries=1 << 20)


def factory(config: Config) -> Cache:
    return Cache(config)


factory.configs = [CONFIG]
factory.any_page_size = False
