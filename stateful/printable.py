"""Text from data (a replay file, a journal, a backend's message) made safe to print on a terminal.

A replay file's ``failure.message`` or a backend's exception text may hold terminal control
sequences: printed raw, ``ESC [2J`` clears the screen and what follows can pose as kvstate's own
output (a fake "ALL GOOD"). Every control character except newline and tab, and the Unicode
controls that reorder text (bidirectional overrides and isolates), is written as its escape:
``\\x1b``, ``\\u202e``.
"""

from __future__ import annotations

import re

_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: object) -> str:
    """``str(text)`` with every control character but newline and tab escaped."""
    def escape(found: re.Match) -> str:
        code = ord(found.group())
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    return _CONTROLS.sub(escape, str(text))
