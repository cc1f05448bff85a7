"""The radix tree's per-subtree newest entry, kept on every stamp, split, removal and collapse,
agrees with a walk of the subtree (what ``newest_below`` computed before it was kept)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.impl.radix import RadixTree, pack

keys = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple)
steps = st.lists(st.tuples(st.sampled_from(["insert", "stamp", "remove", "pop"]), keys), max_size=40)


def _walked_newest(top):
    best, pending = None, [top]
    while pending:
        node = pending.pop()
        if node.value is not None and (best is None or node.tick > best.tick):
            best = node
        pending.extend(node.children.values())
    return best


def _nodes(tree):
    pending = [tree.root]
    while pending:
        node = pending.pop()
        yield node
        pending.extend(node.children.values())


def _entry(tree, key):
    node, length = tree.longest_key(pack(np.array(key)))
    return node if node is not None and length == len(key) else None


@settings(max_examples=300, deadline=None)
@given(steps)
def test_newest_below_is_the_most_recently_stamped_entry_of_every_subtree(script):
    tree = RadixTree()
    for op, key in script:
        node = _entry(tree, key)
        if op == "insert":
            tree.insert(pack(np.array(key)), key)
        elif op == "stamp" and node is not None:
            tree.stamp(node)
        elif op == "remove" and node is not None:
            tree.remove(node)
        elif op == "pop":
            tree.pop_oldest(where=lambda value: len(value) != len(key))
        for each in _nodes(tree):
            assert tree.newest_below(each) is _walked_newest(each), (op, key)
