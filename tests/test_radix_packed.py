"""Packed keys of the radix tree: what the lockstep machine does not look at directly."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvstate.impl.radix import RadixTree, pack, shared_tokens, unpack


def test_pack_round_trips_the_largest_token_ids():
    tokens = np.array([0, 1, 2**31 - 1, 65536], np.int64)
    assert unpack(pack(tokens)) == (0, 1, 2**31 - 1, 65536)


def test_shared_tokens_counts_whole_tokens():
    # 256 and 512 share their low byte: a byte-wise prefix would say more than 0 tokens
    assert shared_tokens(pack(np.array([256, 7])), pack(np.array([512, 7]))) == 0
    assert shared_tokens(pack(np.array([5, 6, 7])), pack(np.array([5, 6, 8, 9]))) == 2
    assert shared_tokens(pack(np.array([5, 6])), pack(np.array([5, 6, 8]))) == 2


def test_lookup_never_matches_inside_a_token():
    tree = RadixTree()
    tree.insert(pack(np.array([1, 256])), "a")
    tree.insert(pack(np.array([1, 512])), "b")
    node, length = tree.longest_key(pack(np.array([1, 256, 3])))
    assert (node.value, length) == ("a", 2)
    assert tree.longest_key(pack(np.array([1, 768]))) == (None, 0)
    # token-granular: [1, 768] shares only token 1 with both keys; 768's low byte equals 256's
    below, common = tree.deepest(pack(np.array([1, 768])))
    assert common == 1 and tree.newest_below(below).value == "b"   # b is the more recently stamped
    assert [unpack(node.edge) for node in tree.root.children.values()] == [(1,)]


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
def test_shared_tokens_is_the_specs_common_prefix_length(a, b):
    from kvstate.spec.arithmetic import common_prefix_length

    packed_a, packed_b = pack(np.array(a, np.int64)), pack(np.array(b, np.int64))
    assert shared_tokens(packed_a, packed_b) == common_prefix_length(tuple(a), tuple(b))


@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=6),
       st.integers(0, 3), st.lists(st.integers(0, 2), min_size=1, max_size=8), st.data())
def test_covering_is_deepest_of_the_cut_query(keys, evicted, query, data):
    """``covering`` (a block hit's subtree, found by climbing from ``deepest``'s node) is ``deepest``
    of the query cut at any length up to the common prefix: whose subtree holds the entries sharing the cut."""
    tree = RadixTree()
    for i, key in enumerate(keys):
        tree.insert(pack(np.array(key, np.int64)), i)
    for _ in range(evicted):      # prunes and collapses: edges change, every node's depth must not
        tree.pop_oldest()
    stack = [(child, 0) for child in tree.root.children.values()]
    while stack:
        node, above = stack.pop()
        assert node.depth == above + len(node.edge)
        stack.extend((child, node.depth) for child in node.children.values())
    packed = pack(np.array(query, np.int64))
    below, common = tree.deepest(packed)
    if common:
        length = data.draw(st.integers(1, common))
        assert tree.covering(below, length) is tree.deepest(packed[:4 * length])[0]
