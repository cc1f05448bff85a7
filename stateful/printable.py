"""Text from data (a replay file, a journal, a backend's message) made safe to print on a terminal.

A replay file's ``failure.message`` or a backend's exception text may hold terminal control
sequences: printed raw, ``ESC [2J`` clears the screen and what follows can pose as kvstate's own
output (a fake "ALL GOOD"). Every control character except newline and tab, and the Unicode
controls that reorder text (bidirectional overrides and isolates), is written as its escape:
``\\x1b``, ``\\u202e``. So are lone surrogates (``\\ud800``: a JSON file may hold them; printed raw
they raised ``UnicodeEncodeError``). ``one_line`` also escapes newlines, for a field printed on one line
of kvstate's own (a failure's message, operation, error name): a file cannot print lines of its own.
"""

from __future__ import annotations

import re

_ESCAPED = "\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_CONTROLS = re.compile(f"[{_ESCAPED}]")
_CONTROLS_AND_NEWLINES = re.compile(f"[{_ESCAPED}\n]")


def _escape(found: re.Match) -> str:
    code = ord(found.group())
    if code == 0x0A:
        return "\\n"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object) -> str:
    """``str(text)`` with every control character but newline and tab, and every lone surrogate, escaped."""
    return _CONTROLS.sub(_escape, str(text))


def one_line(text: object) -> str:
    """``printable(text)`` with newlines escaped too (``\\n``): for a field printed within a line."""
    return _CONTROLS_AND_NEWLINES.sub(_escape, str(text))
