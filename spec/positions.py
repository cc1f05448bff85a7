"""What a position (a count or an index of positions) is, for every surface that takes one.

Ints of every width are positions, Python's or NumPy's, converted at the door
(``operator.index``): a NumPy ``uint8`` or ``int8`` would otherwise carry its width into the
page arithmetic and wrap. A bool is not one, nor a float, a string or a 0-d array: each is
refused by name, never read as the number it happens to convert to.
"""

from __future__ import annotations

import operator

import numpy as np


def as_position(value) -> int | None:
    """``value`` as a Python int, or None for anything that is not a position."""
    if type(value) is int:      # the common case first: a plain int (a bool's type is bool)
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return operator.index(value)


def not_a_position(what: str, value) -> str:
    """A refusal's words for a position that is no integer (a float, a bool, a 0-d array)."""
    return f"{what} takes integer positions, not {value!r} ({type(value).__name__})"
