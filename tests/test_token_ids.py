"""``TokenIds``: a conversation's ids checked once as they are added, taken whole by ``match``.

A lookup given ``TokenIds`` must answer exactly as given the same ids as a list, and every id
that ``match`` would refuse must be refused, by the same error, when it is added, the ids held
before unchanged.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate import Cache, Layout, TokenIds
from kvstate.spec.errors import DTypeError, ShapeError, TokenError

LAYOUT = Layout(layers=1, kv_heads=1, head_dim=2)
BAD = [[1, -1], [2**31], [1, True], [1.0], [np.int64(3), "4"], [[1, 2]], np.zeros((1, 2), np.int64)]


def _refusal(call):
    try:
        call()
    except (TokenError, DTypeError, ShapeError) as error:
        return type(error), str(error)
    raise AssertionError("accepted")


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_bad_id_is_refused_when_added_as_match_refuses_it(bad):
    cache = Cache(LAYOUT, page_tokens=2)
    held = TokenIds([5, 6])
    assert _refusal(lambda: held + bad) == _refusal(lambda: cache.match(bad)) == _refusal(lambda: TokenIds(bad))
    assert list(held) == [5, 6]                      # what was held before is as it was


def test_reads_as_a_sequence_of_ints():
    ids = TokenIds([1, 2, 3]) + np.array([4, 5], np.int64) + TokenIds([6])
    assert len(ids) == 6 and list(ids) == [1, 2, 3, 4, 5, 6] and ids[0] == 1 and ids[-1] == 6 and ids[4] == 5
    with pytest.raises(IndexError):
        ids[6]
    assert ids[2:4] == TokenIds([3, 4]) and ids[::2] == TokenIds([1, 3, 5]) and len(ids[4:2]) == 0
    assert np.asarray(ids).dtype == np.int64 and np.asarray(ids).tolist() == list(ids)
    assert ids == TokenIds(range(1, 7)) and hash(ids) == hash(TokenIds(range(1, 7))) and ids != list(ids)
    assert ids.packed == np.arange(1, 7, dtype="<i4").tobytes()
    assert "6 ids" in repr(ids)


def test_is_a_sequence_with_its_searches():
    # From an audit: "reads as a sequence of ints", yet no index, no count, and no collections.abc.Sequence.
    from collections.abc import Sequence
    ids = TokenIds([5, 6, 7, 6])
    assert isinstance(ids, Sequence) and not hasattr(ids, "__dict__")
    assert ids.index(6) == 1 and ids.index(6, 2) == 3 and ids.count(6) == 2 and ids.count(9) == 0
    assert 7 in ids and 9 not in ids and list(reversed(ids)) == [6, 7, 6, 5]
    with pytest.raises(ValueError):
        ids.index(5, 1)


def test_token_ids_never_change_and_a_pickle_is_checked_again():
    import pickle

    ids = TokenIds([5, 6])
    for change in (lambda: ids.__init__([7]), lambda: setattr(ids, "_packed", b"\xff\xff\xff\xff"),
                   lambda: delattr(ids, "_packed")):
        with pytest.raises((TypeError, AttributeError)):
            change()
    assert list(ids) == [5, 6] and pickle.loads(pickle.dumps(ids)) == ids
    honest = pickle.dumps(ids, 2)                          # protocol 2: no frame lengths to mend
    forged = honest.replace(b"K\x05", b"J\xff\xff\xff\xff")    # the id 5 made -1 in the pickle
    assert forged != honest
    with pytest.raises(TokenError):
        pickle.loads(forged)
    with pytest.raises(TypeError):
        np.array([4, 5]) + ids                   # not element-wise sums of ids
    with pytest.raises(ValueError):
        np.asarray(ids, copy=False)


def _entry(cache, tokens):
    ctx = cache.allocate()
    ctx.extend(tokens, np.full(LAYOUT.batch_shape(len(tokens)), len(tokens), np.float32))
    cache.retain(ctx)
    ctx.close()


keys = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=9), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None, database=None)
@given(keys, st.lists(st.integers(0, 2), max_size=12), st.sampled_from(["entry", "token", "block"]))
def test_match_of_token_ids_is_match_of_the_list(stored, query, match):
    caches = [Cache(LAYOUT, page_tokens=2, match=match, block_tokens=2 if match == "block" else 0)
              for _ in range(2)]
    for cache in caches:
        for tokens in stored:
            _entry(cache, tokens)
    (a, n), (b, m) = caches[0].match(query), caches[1].match(TokenIds(query))
    assert n == m
    assert a.read()[1].tolist() == b.read()[1].tolist() and np.array_equal(a.read()[0], b.read()[0])
    assert caches[0].observe().entries == caches[1].observe().entries      # the same entry stamped
    a.close(), b.close()


def test_extend_takes_token_ids_as_the_ints_they_hold():
    cache = Cache(LAYOUT, page_tokens=2)
    ids = TokenIds([7, 8, 9])
    with cache.allocate() as ctx:
        ctx.extend(ids[1:], np.zeros(LAYOUT.batch_shape(2), np.float32))
        assert ctx.read()[1].tolist() == [8, 9]
