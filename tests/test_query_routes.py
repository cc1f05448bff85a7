"""A lookup's int64-array route, both ways it can check (issue 26): the cast that refuses a
changed value (``same_value``, NumPy 2.3 on) with a sign test on the packed bytes, and the
OR-reduce older NumPy takes. Either refuses exactly what ``check_tokens`` refuses, with its
error, and packs the rest as ``radix.pack`` does."""

from __future__ import annotations

import numpy as np
import pytest

from kvstate.impl import query
from kvstate.impl.query import packed_query
from kvstate.impl.radix import pack
from kvstate.spec.errors import TokenError
from kvstate.spec.layout import check_tokens

BAD = [[-1], [2**31], [5, -(2**62)], [2**62], [0, 2**31 + 7], [-(2**31)], [3, 2**32], [2**32 + 5],
       [-(2**63)], [2**63 - 1], [7] * 40 + [-2]]
GOOD = [[], [0], [2**31 - 1], [5, 0, 2**31 - 1, 127, 128, 255, 256, 2**24 - 1, 2**24], list(range(0, 2**31, 2**20))]
ROUTES = ["same_value", "reduce"]


@pytest.fixture(params=ROUTES)
def route(request, monkeypatch):
    if request.param == "same_value" and not query._same_value_checked():
        pytest.skip("this NumPy has no same_value casting")
    monkeypatch.setattr(query, "SAME_VALUE", request.param == "same_value")
    return request.param


@pytest.mark.parametrize("items", BAD, ids=repr)
def test_a_bad_int64_array_is_refused_with_check_tokens_error(items, route):
    tokens = np.array(items, np.int64)
    assert query._from_int64(tokens) is None
    _refused_as_check_tokens_refuses(tokens)


@pytest.mark.parametrize("items", GOOD, ids=lambda items: repr(items[:4]))
def test_a_good_int64_array_packs_as_its_checked_tokens(items, route):
    tokens = np.array(items, np.int64)
    packed, checked = packed_query(tokens)
    assert packed == query._from_int64(tokens) == pack(check_tokens(tokens))
    assert checked is tokens


def test_the_probe_finds_same_value_casting_where_numpy_has_it():
    major, minor = (int(part) for part in np.__version__.split(".")[:2])
    assert query.SAME_VALUE == ((major, minor) >= (2, 3))


# The marshal route reads tags at every fifth byte and signs at the payloads' top bytes: ids whose
# bytes look like tags (0x69 is b"i") or sit at the sign boundary must pack as themselves, and a
# negative id anywhere (its top byte has the high bit) must go to the general route.
TAG_LIKE = [[105], [0x69696969, 5, 0x69], [2**31 - 1, 0, 0x7F000000, 0x00800000], list(range(100, 110)) * 30]
NEGATIVE = [[7] * 40 + [-2], [-(2**31)], [0x69, -0x69], [5] * 300 + [-1] + [5] * 300]


@pytest.mark.parametrize("items", TAG_LIKE, ids=lambda items: repr(items[:4]))
def test_the_marshal_route_packs_ids_whose_bytes_look_like_tags(items):
    assert query._from_marshal(items) == pack(check_tokens(items))


@pytest.mark.parametrize("items", NEGATIVE, ids=lambda items: repr(items[-2:]))
def test_the_marshal_route_hands_a_negative_id_to_the_general_route(items):
    assert query._from_marshal(items) is None
    _refused_as_check_tokens_refuses(items)


def _refused_as_check_tokens_refuses(tokens) -> None:
    """``packed_query`` refuses ``tokens`` with the very error ``check_tokens`` raises."""
    with pytest.raises(TokenError) as slow:
        check_tokens(tokens)
    with pytest.raises(TokenError) as fast:
        packed_query(tokens)
    assert str(fast.value) == str(slow.value)
