"""The hot paths' fast routes agree with the slow ones they replace (issue 15, item 3).

- ``check_tokens`` on a list takes one vectorised route; whatever it refuses is named by
  the element-by-element check, so every bad input gets the error it always got.
- Refcounts live in one array indexed by page id and each context carries its page ids:
  after any sequence of operations the ids are its pages' ids and each refcount is the
  number of holders (the invariants check the latter through ``observe``).
- ``retain`` takes its key from the context's packed key, kept by every write: the key
  must be the tokens the pages hold.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstate.impl import Cache
from kvstate.spec.errors import DTypeError, TokenError
from kvstate.spec.invariants import check_structure
from kvstate.spec.layout import Layout, _name_bad_token, check_tokens

TINY = Layout(1, 1, 1)

BAD_LISTS = [
    [1, True], [np.True_, 2], [1, 2.0], [np.array(5)], [3, np.array([5])], [2**63], [2**64 + 1], [-1],
    [5, -(2**63) - 1], [2**31], [1, np.uint64(2**64 - 1)], [1, None], ["a"], [[1]], [1, 2**70, -3],
    [np.int64(-4)], [np.float32(3)], [b"x"],
]


@pytest.mark.parametrize("items", BAD_LISTS, ids=repr)
def test_a_bad_list_gets_the_error_the_element_check_names(items):
    with pytest.raises((DTypeError, TokenError)) as slow:
        _name_bad_token(list(items))
    with pytest.raises(type(slow.value)) as fast:
        check_tokens(items)
    assert str(fast.value) == str(slow.value)
    with pytest.raises(type(slow.value)):
        check_tokens(tuple(items))


def test_a_good_list_of_mixed_int_kinds_is_its_int64_array():
    items = [np.int8(5), 3, np.uint32(7), np.uint64(2**31 - 1), 0]
    array = check_tokens(items)
    assert array.dtype == np.int64 and array.tolist() == [5, 3, 7, 2**31 - 1, 0]
    assert check_tokens([]).dtype == np.int64 and check_tokens([]).size == 0
